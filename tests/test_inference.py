"""Inference recovers what training did from the stored config alone."""

import jax
import numpy as np

from t5_retrieval import checkpoint, sharding
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.inference import DualEncoderInference
from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5Config

CFG = T5Config(vocab_size=64, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
               num_decoder_layers=1, dropout_rate=0.0)


def test_query_towers_follow_the_training_order_not_the_stored_key_order(tmp_path):
    mixture_order = ["zsre", "fever", "aidayago2"]  # not alphabetical, as in a real mixture
    features = RandomBatches(per_device_batch=3, local_data_devices=1, task_names=mixture_order, vocab_size=64,
                             query_len=6, passage_len=8, num_negatives=1).features
    checkpoint.write_config(str(tmp_path), {"features": features})  # stored with sorted keys
    stored = checkpoint.read_config(str(tmp_path))["features"]
    assert list(stored["tasks"]) == sorted(mixture_order), "precondition: the stored key order is alphabetical"
    model = DualEncoder(CFG, DualEncoderConfig(query_towers=3))
    params = model.init(jax.random.PRNGKey(0), np.ones((1, 4), np.int32))["params"]
    encoder = DualEncoderInference(model, params, {"features": stored}, "fp", sharding.make_mesh())
    assert encoder.training_task_order == mixture_order


def test_length_bucketed_encoding_equals_full_width_encoding_in_input_order():
    model = DualEncoder(CFG, DualEncoderConfig())
    params = model.init(jax.random.PRNGKey(0), np.ones((1, 4), np.int32))["params"]
    encoder = DualEncoderInference(model, params, {"features": {}}, "fp", sharding.make_mesh(), batch_size=4)
    rng = np.random.default_rng(0)
    length = 80
    tokens = np.zeros((11, length), np.int32)
    for i, n in enumerate(rng.integers(2, length + 1, size=11)):  # rows of 2..80 ids, then padding
        tokens[i, :n - 1] = rng.integers(2, 64, size=n - 1)
        tokens[i, n - 1] = 1
    full = np.asarray(model.apply({"params": params}, tokens))
    np.testing.assert_allclose(encoder.encode_tokens(tokens), full, rtol=1e-5, atol=1e-5,
                               err_msg="cutting batches to their longest row must not change any embedding")


def _wordpiece(path, words):
    path.write_text("".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words]))
    return str(path)


def _model_dir(tmp_path, features):
    """A t5r model directory (config + step-0 checkpoint) of a tiny T5 dual encoder."""
    import dataclasses

    model_dir = str(tmp_path / "model")
    config = {"family": "t5", "t5": dataclasses.asdict(CFG), "dual_encoder": dataclasses.asdict(DualEncoderConfig()),
              "features": features}
    checkpoint.write_config(model_dir, config)
    import flax.linen as nn

    boxed = DualEncoder(CFG, DualEncoderConfig()).init(jax.random.PRNGKey(0), np.ones((1, 4), np.int32))["params"]
    params = nn.unbox(boxed)
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": params}, {})
    return model_dir


def test_a_vocabulary_changed_since_training_is_refused_naming_both_digests(tmp_path):
    import pathlib

    import pytest

    from t5_retrieval.data.tokenizers.tokenize import vocabulary_digest
    from t5_retrieval.inference import load_encoder

    vocab = _wordpiece(tmp_path / "vocab.txt", ["paris", "berlin"])
    trained = vocabulary_digest(vocab)
    model_dir = _model_dir(tmp_path, {"vocabulary": vocab, "vocabulary_digest": trained, "query_len": 8,
                                      "passage_len": 8, "tasks": {}})
    load_encoder(model_dir)  # the unchanged vocabulary loads
    copy = checkpoint.vocabulary_file(model_dir, checkpoint.read_config(model_dir)["features"])
    _wordpiece(pathlib.Path(copy), ["berlin", "paris"])  # the model's own copy, other ids
    now = vocabulary_digest(copy)
    assert now != trained
    with pytest.raises(checkpoint.CheckpointError, match=f"content digest {now}.*trained with digest {trained}"):
        load_encoder(model_dir)


def test_a_model_without_a_recorded_digest_loads_and_its_fingerprint_follows_the_vocabulary_content(tmp_path):
    """An older model directory (layout version 1, accepted with `t5r checksum --accept`): the
    vocabulary by absolute path, which is not read (a model directory reads no file outside it),
    no digest. The error's command copies it in, and the copy is the model's vocabulary."""
    import json
    import shlex
    import shutil
    import subprocess

    import pytest

    from t5_retrieval import cli
    from t5_retrieval.inference import load_encoder

    vocab = _wordpiece(tmp_path / "vocab.txt", ["paris", "berlin"])
    model_dir = _model_dir(tmp_path, {"vocabulary": vocab, "query_len": 8, "passage_len": 8, "tasks": {}})
    config = checkpoint.read_config(model_dir)
    config.pop("version")
    config["features"] = {"vocabulary": vocab, "query_len": 8, "passage_len": 8, "tasks": {}}
    with open(f"{model_dir}/{checkpoint.CONFIG_FILE}", "w") as f:
        json.dump(config, f)
    shutil.rmtree(f"{model_dir}/{checkpoint.VOCABULARY_DIR}")
    assert cli.main(["checksum", "--accept", f"{model_dir}/0"]) == 0
    with pytest.raises(checkpoint.CheckpointError, match="outside the model directory") as refused:
        load_encoder(model_dir)
    command = str(refused.value).rpartition("copy it in: ")[2]
    assert subprocess.run(command, shell=True).returncode == 0, shlex.quote(command)
    before = load_encoder(model_dir).fingerprint
    assert load_encoder(model_dir).fingerprint == before, "the fingerprint is a function of the model"
    _wordpiece(tmp_path / "model" / "vocabulary" / "vocab.txt", ["berlin", "paris"])
    after = load_encoder(model_dir).fingerprint
    assert after != before, "an index built with the old vocabulary must not match the model with the new one"
