"""The unchanged trainer and inference with a BERT dual encoder: `t5r train` on a gin model file of the
BERT family (WordPiece vocabulary, separate query encoder) writes a model directory that
`load_encoder` rebuilds into a BERT that embeds queries and passages."""

import os

import gin
import numpy as np
import pytest
from conftest import prepare_small_demo

from t5_retrieval import checkpoint, gin_utils
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tokenizers.tokenize import tokenize, vocabulary_digest
from t5_retrieval.inference import load_encoder
from t5_retrieval.models.build import build_model
from t5_retrieval.models.pretrained import minilm_l6_dir
from t5_retrieval.train import train

TASKS = ("fever", "trex")
CLS, SEP = 101, 102  # in MiniLM's (BERT uncased) vocab.txt


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from t5_retrieval.data import layout

    out = prepare_small_demo(tmp_path_factory.mktemp("bert_demo"), TASKS)
    assert os.path.isdir(layout.kb_dir(out))
    return out


@pytest.fixture(scope="module")
def trained_dir(data_dir, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("bert_run") / "model")
    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/bert_tiny.gin", "runs/base.gin"], [
            f"DATA_DIR = '{data_dir}'", "VOCABULARY = @minilm_l6_dir()", "VOCAB_SIZE = 30522",
            f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}_noprefix' for t in TASKS]}", "TRAIN_STEPS = 1", "QUERY_LEN = 16",
            "PASSAGE_LEN = 32", "NUM_NEGATIVES = 1", "PER_DEVICE_BATCH = 4", "NUM_LAYERS = 1",
            "BertDualEncoderConfig.separate_query_encoder = True"])
        train(model_dir)
    finally:
        gin.clear_config()
    return model_dir


def test_trained_config_records_the_bert_family_and_wordpiece_vocabulary(trained_dir):
    config = checkpoint.read_config(trained_dir)
    assert config["family"] == "bert" and config["bert"]["hidden_size"] == 32
    assert config["dual_encoder"]["separate_query_encoder"] is True
    assert config["features"]["vocabulary"] == "vocabulary/vocab.txt", "a copy inside the model directory"
    assert config["features"]["vocabulary_digest"] == vocabulary_digest(minilm_l6_dir())
    assert type(build_model(config)).__name__ == "BertDualEncoder"


def test_load_encoder_embeds_queries_with_the_query_encoder_and_passages_with_the_main_one(trained_dir, data_dir):
    encoder = load_encoder(trained_dir, batch_size=4)
    assert encoder.model.config.query_tower(0) == 0
    tokens = tokenize(encoder.vocabulary, ["Who is the cafe owner?"], encoder.features["query_len"])[0]
    assert tokens[0] == CLS and SEP in tokens and tokens[-1] == 0, f"expected [CLS] .. [SEP] then padding, got {tokens}"
    text = "Who founded the Fourth International?"
    query = encoder.encode_queries([text], "demo_fever_noprefix")
    as_passage = encoder.encode_tokens(tokenize(encoder.vocabulary, [text], encoder.features["query_len"]))
    assert query.shape == (1, 32) and np.all(np.isfinite(query))
    assert not np.allclose(query, as_passage), "queries must go through the separate query encoder"
    store = PassageStore.open(os.path.join(data_dir, "kb"))
    passages = [store.get(pid) for pid in store.ids()[:5]]
    embedded = encoder.encode_passages(passages)
    assert embedded.shape == (5, 32) and np.all(np.isfinite(embedded))
