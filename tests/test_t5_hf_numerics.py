"""Our Flax T5 against transformers' PyTorch T5 on the same random weights (v1.0 and v1.1)."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util

from t5_retrieval.models import hf_import
from t5_retrieval.models.dual_encoder import DualEncoder, DualEncoderConfig
from t5_retrieval.models.t5 import T5, abstract_params

HF_CONFIGS = {
    "v1_0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "v1_1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


# Teacher-forced decoder input starting with the start token 0; position 0 is the dual encoder's step.
DECODER_TOKENS = np.array([[0, 5, 9], [0, 7, 7], [0, 3, 1], [0, 40, 2]], np.int32)


def save_random_hf_t5(directory: str, version: str, seed: int = 0) -> transformers.T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                   num_decoder_layers=3, num_heads=4, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=20, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, **HF_CONFIGS[version])
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and the relative bias near 0: make them matter
        for name, p in model.named_parameters():
            if "layer_norm" in name or "relative_attention_bias" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "layer_norm" in name else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def random_tokens(batch: int, length: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, 99, size=(batch, length)).astype(np.int32)
    lengths = np.array([length, length - 3, 5, length - 7])[:batch]  # ragged padding
    tokens[np.arange(length)[None] >= lengths[:, None]] = 0
    return tokens


def import_dir(directory: str):
    with open(os.path.join(directory, "config.json")) as f:
        cfg = hf_import.t5_config_from_hf(json.load(f))
    model = T5(cfg)
    tokens = jnp.ones((1, 4), jnp.int32)
    abstract = abstract_params(model, tokens, tokens)
    return cfg, model, hf_import.load_t5(directory, abstract, cfg)


@pytest.mark.parametrize("version", sorted(HF_CONFIGS))
def test_encoder_and_first_decoder_step_match_transformers(tmp_path, version):
    hf = save_random_hf_t5(str(tmp_path), version)
    cfg, model, params = import_dir(str(tmp_path))
    tokens = random_tokens(4, 17)
    mask = tokens != 0
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                 decoder_input_ids=torch.tensor(DECODER_TOKENS, dtype=torch.long), output_hidden_states=True)
    ref_encoded = out.encoder_last_hidden_state.numpy()
    ref_first_step = out.decoder_hidden_states[-1][:, 0].numpy()
    ref_logits = out.logits.numpy()

    (encoded,) = model.apply({"params": params}, (jnp.asarray(tokens),), method=T5.encode)
    np.testing.assert_allclose(np.asarray(encoded)[mask], ref_encoded[mask], atol=1e-4, rtol=1e-4,
                               err_msg="encoder states differ from transformers")
    logits = model.apply({"params": params}, jnp.asarray(tokens), jnp.asarray(DECODER_TOKENS))
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=1e-4,
                               err_msg="teacher-forced LM logits (3 decoder steps) differ from transformers")

    dual = DualEncoder(cfg, DualEncoderConfig(pooling="encdec"))
    embedding = dual.apply({"params": {"t5": params}}, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(embedding), ref_first_step, atol=1e-4, rtol=1e-4,
                               err_msg="ST5-EncDec embedding != decoder final-norm state after one step")


def test_dual_encoder_mean_pooling_ignores_padding(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, _, params = import_dir(str(tmp_path))
    dual = DualEncoder(cfg, DualEncoderConfig(pooling="mean"))
    tokens = random_tokens(4, 17)
    padded = np.concatenate([tokens, np.zeros((4, 6), np.int32)], axis=1)
    a = dual.apply({"params": {"t5": params}}, jnp.asarray(tokens))
    b = dual.apply({"params": {"t5": params}}, jnp.asarray(padded))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5,
                               err_msg="extra padding changed the mean-pooled embedding")


def _flat_target(directory):
    cfg, _, params = import_dir(directory)
    return cfg, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def test_missing_tensor_is_named(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, target = _flat_target(str(tmp_path))
    tensors = hf_import.read_safetensors(str(tmp_path))
    del tensors["encoder.block.1.layer.1.DenseReluDense.wi_0.weight"]
    missing = r"missing tensor 'encoder\.block\.1\.layer\.1\.DenseReluDense\.wi_0\.weight'"
    with pytest.raises(hf_import.HFImportError, match=missing):
        hf_import.convert(tensors, cfg, target)


def test_misshaped_tensor_names_both_shapes(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, target = _flat_target(str(tmp_path))
    tensors = hf_import.read_safetensors(str(tmp_path))
    tensors["decoder.final_layer_norm.weight"] = np.ones((31,), np.float32)
    with pytest.raises(hf_import.HFImportError, match=r"decoder\.final_layer_norm\.weight.*\(31,\).*expected \(32,\)"):
        hf_import.convert(tensors, cfg, target)


def test_unexpected_tensor_is_named(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, target = _flat_target(str(tmp_path))
    tensors = hf_import.read_safetensors(str(tmp_path))
    tensors["encoder.block.9.layer.0.SelfAttention.q.weight"] = np.zeros((32, 32), np.float32)
    with pytest.raises(hf_import.HFImportError, match=r"unexpected tensors.*encoder\.block\.9"):
        hf_import.convert(tensors, cfg, target)


def test_dual_encoder_skips_unused_lm_head(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, _, _ = import_dir(str(tmp_path))
    dual = DualEncoder(cfg)
    abstract = abstract_params(dual, jnp.ones((1, 4), jnp.int32))
    params = hf_import.load_t5(str(tmp_path), abstract["t5"], cfg)
    assert "lm_head" not in params and "decoder" in params, sorted(params)
    flat = traverse_util.flatten_dict(params)
    assert len(flat) == len(traverse_util.flatten_dict(abstract["t5"]))


def _model_target(cfg):
    tokens = jnp.ones((1, 4), jnp.int32)
    return abstract_params(T5(cfg), tokens, tokens)


@pytest.mark.parametrize("field, value, key", [
    ("num_encoder_layers", 1, "num_layers"),  # a shallower model than the file: today an INFO log only
    ("num_decoder_layers", 2, "num_decoder_layers"),
    ("relative_attention_max_distance", 128, "relative_attention_max_distance"),  # shapes alike
    ("relative_attention_num_buckets", 32, "relative_attention_num_buckets"),
    ("layer_norm_epsilon", 1e-5, "layer_norm_epsilon"),  # shapes alike
    ("num_heads", 2, "num_heads"),
    ("d_kv", 16, "d_kv"),
    ("d_ff", 64, "d_ff"),
    ("vocab_size", 128, "vocab_size"),
    ("mlp_activation", "relu", "feed_forward_proj"),
    ("tie_word_embeddings", True, "tie_word_embeddings"),
])
def test_a_config_that_changes_numerics_is_refused_naming_the_field_and_both_values(tmp_path, field, value, key):
    save_random_hf_t5(str(tmp_path), "v1_1")
    with open(tmp_path / "config.json") as f:
        file_cfg = hf_import.t5_config_from_hf(json.load(f))
    model_cfg = dataclasses.replace(file_cfg, **{field: value})
    checkpoint_value, model_value = re.escape(repr(getattr(file_cfg, field))), re.escape(repr(value))
    pattern = rf"{field}: checkpoint {checkpoint_value} \(config.json {key}.*model {model_value}"
    with pytest.raises(hf_import.HFImportError, match=pattern):
        hf_import.load_t5(str(tmp_path), _model_target(model_cfg), model_cfg)


def test_training_only_fields_may_differ_from_the_checkpoint(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    with open(tmp_path / "config.json") as f:
        model_cfg = hf_import.t5_config_from_hf(json.load(f), dropout_rate=0.3, dtype="bfloat16")
    params = hf_import.load_t5(str(tmp_path), _model_target(model_cfg), model_cfg)
    assert "encoder" in params and "decoder" in params, sorted(params)


def test_a_misshaped_attention_weight_is_named_before_any_reshape(tmp_path):
    save_random_hf_t5(str(tmp_path), "v1_1")
    cfg, target = _flat_target(str(tmp_path))
    tensors = hf_import.read_safetensors(str(tmp_path))
    tensors["encoder.block.0.layer.0.SelfAttention.q.weight"] = np.zeros((30, 32), np.float32)  # 30 = no heads*d_kv
    with pytest.raises(hf_import.HFImportError,
                       match=r"'encoder\.block\.0\.layer\.0\.SelfAttention\.q\.weight' has shape \(30, 32\), "
                             r"expected \(32, 32\)"):
        hf_import.convert(tensors, cfg, target)


def test_a_bert_directory_given_to_load_t5_is_a_clear_error(tmp_path):
    from test_bert_hf_numerics import save_random_hf_bert

    save_random_hf_bert(str(tmp_path))
    cfg = hf_import.T5Config(vocab_size=99, d_model=32, num_heads=4, d_kv=8, d_ff=48, num_encoder_layers=2,
                             num_decoder_layers=2)
    with pytest.raises(hf_import.HFImportError, match=r"model_type='bert', expected 't5'"):
        hf_import.load_t5(str(tmp_path), _model_target(cfg), cfg)
