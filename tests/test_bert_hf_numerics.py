"""Our Flax BERT against transformers' PyTorch BertModel on the same random weights."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util

from t5_retrieval.models import hf_bert_import
from t5_retrieval.models.bert import Bert
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder, BertDualEncoderConfig
from t5_retrieval.models.hf_import import HFImportError, read_safetensors
from t5_retrieval.models.t5 import abstract_params


def save_random_hf_bert(directory: str, seed: int = 0) -> transformers.BertModel:
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=40, type_vocab_size=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # HF's init leaves LayerNorms at (1, 0) and biases at 0: make them matter
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("LayerNorm.weight") else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def bert_tokens(batch: int = 4, length: int = 17, seed: int = 1) -> np.ndarray:
    """[CLS]=2 ... [SEP]=3 rows with ragged padding (0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 99, size=(batch, length)).astype(np.int32)
    lengths = np.array([length, length - 3, 5, length - 7])[:batch]
    tokens[:, 0] = 2
    tokens[np.arange(batch), lengths - 1] = 3
    tokens[np.arange(length)[None] >= lengths[:, None]] = 0
    return tokens


def import_dir(directory: str):
    cfg = hf_bert_import.bert_config_from_hf(hf_bert_import.read_hf_config(directory))
    model = Bert(cfg)
    target = abstract_params(model, (jnp.ones((1, 4), jnp.int32),))
    return cfg, model, hf_bert_import.load_bert(directory, target, cfg)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("hf_bert"))
    return directory, save_random_hf_bert(directory)


def test_hidden_states_cls_and_mean_embeddings_match_transformers(hf_dir):
    directory, hf = hf_dir
    cfg, model, params = import_dir(directory)
    tokens = bert_tokens()
    mask = tokens != 0
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long)).last_hidden_state.numpy()
    hidden = np.asarray(model.apply({"params": params}, (jnp.asarray(tokens),))[0])
    diff = np.abs(hidden[mask] - ref[mask]).max()
    assert diff < 1e-4, f"last hidden states differ from transformers by {diff:.2e} (expected < 1e-4)"

    ref_mean = (ref * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    for pooling, expected in (("cls", ref[:, 0]), ("mean", ref_mean)):
        for normalize in (False, True):
            dual = BertDualEncoder(cfg, BertDualEncoderConfig(pooling=pooling, l2_normalize=normalize))
            got = np.asarray(dual.apply({"params": {"bert": params}}, jnp.asarray(tokens)))
            want = expected / np.linalg.norm(expected, axis=1, keepdims=True) if normalize else expected
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4,
                                       err_msg=f"{pooling} pooling (l2={normalize}) differs from transformers")


def test_bert_prefixed_layout_loads_the_same_weights(hf_dir):
    directory, _ = hf_dir
    cfg, _, params = import_dir(directory)
    tensors = read_safetensors(directory)
    prefixed = {f"bert.{name}": value for name, value in tensors.items()}
    prefixed["cls.predictions.bias"] = np.zeros(99, np.float32)  # a BertForMaskedLM head: known, unused
    again = hf_bert_import.convert(prefixed, cfg, jax.tree.map(np.asarray, params))
    flat, flat_again = traverse_util.flatten_dict(params), traverse_util.flatten_dict(again)
    assert flat.keys() == flat_again.keys()
    for path in flat:
        np.testing.assert_array_equal(np.asarray(flat[path]), flat_again[path], err_msg="/".join(path))


def test_misshaped_tensor_names_it_and_both_shapes(hf_dir):
    directory, _ = hf_dir
    cfg, _, params = import_dir(directory)
    tensors = read_safetensors(directory)
    tensors["encoder.layer.1.output.LayerNorm.weight"] = np.ones((31,), np.float32)
    with pytest.raises(HFImportError, match=r"encoder\.layer\.1\.output\.LayerNorm\.weight.*\(31,\).*expected \(32,\)"):
        hf_bert_import.convert(tensors, cfg, params)


def test_missing_and_unexpected_tensors_are_named(hf_dir):
    directory, _ = hf_dir
    cfg, _, params = import_dir(directory)
    tensors = read_safetensors(directory)
    del tensors["encoder.layer.0.attention.self.key.bias"]
    with pytest.raises(HFImportError, match=r"missing tensor 'encoder\.layer\.0\.attention\.self\.key\.bias'"):
        hf_bert_import.convert(tensors, cfg, params)
    tensors = read_safetensors(directory)
    tensors["encoder.layer.7.output.dense.weight"] = np.zeros((32, 48), np.float32)
    with pytest.raises(HFImportError, match=r"unexpected tensors.*encoder\.layer\.7"):
        hf_bert_import.convert(tensors, cfg, params)


def test_init_from_a_bert_directory_refuses_a_t5_model(hf_dir):
    from t5_retrieval.checkpoint import CheckpointError
    from t5_retrieval.models.build import initial_params
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config

    t5 = DualEncoder(T5Config(vocab_size=99, d_model=16, num_heads=2, d_kv=8, d_ff=32, num_encoder_layers=1,
                              num_decoder_layers=1))
    like = nn.unbox(t5.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))["params"])
    with pytest.raises(CheckpointError, match="is a Hugging Face BERT directory, but the model is not"):
        initial_params(hf_dir[0], like, {"t5": dataclasses.asdict(t5.t5_config)})


@pytest.mark.parametrize("field, value, key", [
    ("num_layers", 1, "num_hidden_layers"),
    ("layer_norm_epsilon", 1e-6, "layer_norm_eps"),  # shapes alike
    ("max_position_embeddings", 64, "max_position_embeddings"),
    ("num_heads", 2, "num_attention_heads"),  # shapes alike: only the split into heads changes
    ("intermediate_size", 64, "intermediate_size"),
    ("type_vocab_size", 1, "type_vocab_size"),
])
def test_a_config_that_changes_numerics_is_refused_naming_the_field_and_both_values(hf_dir, field, value, key):
    directory, _ = hf_dir
    file_cfg = hf_bert_import.bert_config_from_hf(hf_bert_import.read_hf_config(directory))
    model_cfg = dataclasses.replace(file_cfg, **{field: value})
    target = abstract_params(Bert(model_cfg), (jnp.ones((1, 4), jnp.int32),))
    checkpoint_value, model_value = re.escape(repr(getattr(file_cfg, field))), re.escape(repr(value))
    pattern = rf"{field}: checkpoint {checkpoint_value} \(config.json {key}\), model {model_value}"
    with pytest.raises(HFImportError, match=pattern):
        hf_bert_import.load_bert(directory, target, model_cfg)


def test_a_misshaped_attention_bias_is_named_before_any_reshape(hf_dir):
    directory, _ = hf_dir
    cfg, _, params = import_dir(directory)
    tensors = read_safetensors(directory)
    tensors["encoder.layer.0.attention.self.query.bias"] = np.zeros((30,), np.float32)
    with pytest.raises(HFImportError,
                       match=r"'encoder\.layer\.0\.attention\.self\.query\.bias' has shape \(30,\), expected \(32,\)"):
        hf_bert_import.convert(tensors, cfg, params)
