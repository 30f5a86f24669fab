"""Hugging Face T5 checkpoints (`config.json` + `*.safetensors`) -> our Flax parameter tree.

Works for `T5Model`, `T5EncoderModel` and `T5ForConditionalGeneration` directories, v1.0 and v1.1.
The file's config.json must describe the model being filled: every field that changes the numbers
(sizes, layers, relative attention, layer-norm epsilon, activation, tied embeddings) is compared
with the model's T5Config, since a shape check alone misses an epsilon or a max distance and a
model with fewer layers than the file would load a truncated network. Every tensor of our model
must come from the file with the right shape, checked by name before any reshape; every tensor in
the file must be a known T5 tensor. Known tensors our model does not use (the LM head for a dual
encoder, the decoder for mean pooling) are skipped and reported. A problem is an error naming the
field or tensor and both values, never a silent partial load. `fill_target` and `check_config` are
that machinery for any architecture (the BERT importer, `hf_bert_import`, uses them too).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
from flax import traverse_util
from safetensors.numpy import load_file

from t5_retrieval.errors import UserError
from t5_retrieval.models.t5 import T5Config

log = logging.getLogger(__name__)
# Tied copies of `shared.weight` that HF may or may not write.
TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
# Our T5Config fields that change what the network computes, with the config.json key of each
# (dropout, compute dtype, remat and scan_layers are training choices and may differ).
T5_NUMERIC_FIELDS = {
    "vocab_size": "vocab_size", "d_model": "d_model", "num_heads": "num_heads", "d_kv": "d_kv", "d_ff": "d_ff",
    "num_encoder_layers": "num_layers", "num_decoder_layers": "num_decoder_layers",
    "relative_attention_num_buckets": "relative_attention_num_buckets",
    "relative_attention_max_distance": "relative_attention_max_distance",
    "layer_norm_epsilon": "layer_norm_epsilon", "mlp_activation": "feed_forward_proj",
    "tie_word_embeddings": "tie_word_embeddings / scale_decoder_outputs"}
T5_REQUIRED_KEYS = ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_layers")


class Converter(NamedTuple):
    """How one HF tensor becomes one of our arrays: `hf_shape` gives the HF shape that makes our
    expected shape, so a misshaped tensor is named before `convert` reshapes anything."""

    convert: Callable[[np.ndarray], np.ndarray]
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


class HFImportError(UserError, ValueError):
    """A checkpoint that does not fit the model; the message names the field or tensor and both values."""


def check_config(source: str, checkpoint_cfg: Any, model_cfg: Any, fields: Mapping[str, str]) -> None:
    """Refuses a checkpoint whose config differs from the model's in a field that changes numerics.

    `fields` maps our config field to the config.json key it comes from (named in the error).
    """
    diffs = [f"{field}: checkpoint {getattr(checkpoint_cfg, field)!r} (config.json {key}), "
             f"model {getattr(model_cfg, field)!r}"
             for field, key in fields.items() if getattr(checkpoint_cfg, field) != getattr(model_cfg, field)]
    if diffs:
        raise HFImportError(f"{source}/config.json does not describe this model ({type(model_cfg).__name__}): "
                           + "; ".join(diffs))


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise HFImportError(f"{model_dir}: no config.json; is this a Hugging Face model directory?")
    with open(path) as f:
        return json.load(f)


def t5_config_from_hf(hf: dict[str, Any], **overrides: Any) -> T5Config:
    """Our T5Config from a HF T5 config.json (dropout and dtype may be overridden for fine-tuning).

    Another architecture's config (a BERT directory) is an HFImportError, not a missing key.
    """
    if hf.get("model_type", "t5") != "t5":
        raise HFImportError(f"config.json: model_type={hf.get('model_type')!r}, expected 't5' "
                           "(a Hugging Face T5 directory)")
    missing = [key for key in T5_REQUIRED_KEYS if key not in hf]
    if missing:
        raise HFImportError(f"config.json: no {missing}; not a Hugging Face T5 config")
    projection = hf.get("feed_forward_proj", "relu")
    activation = {"relu": "relu", "gated-gelu": "gated-gelu"}.get(projection)
    if activation is None:
        raise HFImportError(f"config.json: feed_forward_proj={projection!r} is not supported "
                           f"(expected 'relu' or 'gated-gelu')")
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"], num_heads=hf["num_heads"], d_kv=hf["d_kv"],
        d_ff=hf["d_ff"], num_encoder_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
        dropout_rate=hf.get("dropout_rate", 0.1), layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
        mlp_activation=activation, tie_word_embeddings=scales_decoder_output(hf))
    fields.update(overrides)
    return T5Config(**fields)


def scales_decoder_output(hf: dict[str, Any]) -> bool:
    """T5 v1.0 semantics (tied LM head on d_model^-0.5-scaled states) vs v1.1 (untied, unscaled).

    transformers >= 5 always ties the weights and records the v1.0/v1.1 difference as
    `scale_decoder_outputs`; older exports say `tie_word_embeddings` (default True).
    """
    return bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)))


def lm_head_shares_embedding(hf: dict[str, Any]) -> bool:
    """An unscaled (v1.1-style) head whose weights the file stores only as `shared.weight`."""
    return not scales_decoder_output(hf) and bool(hf.get("tie_word_embeddings", False))


def dense_in(heads: int, d_kv: int) -> Converter:
    # torch Linear weight [heads*d_kv, d_model] -> kernel [d_model, heads, d_kv]
    return Converter(lambda w: w.T.reshape(w.shape[1], heads, d_kv), lambda s: (s[1] * s[2], s[0]))


def dense_out(heads: int, d_kv: int) -> Converter:
    # torch Linear weight [d_model, heads*d_kv] -> kernel [heads, d_kv, d_model]
    return Converter(lambda w: w.T.reshape(heads, d_kv, w.shape[0]), lambda s: (s[2], s[0] * s[1]))


transpose = Converter(lambda w: w.T, lambda s: tuple(reversed(s)))
identity = Converter(lambda w: w, lambda s: tuple(s))


def name_map(cfg: T5Config) -> Iterator[tuple[str, tuple[str, ...], Converter]]:
    """(HF tensor name, our path under the T5 module, converter) for every tensor of a T5."""
    h, k = cfg.num_heads, cfg.d_kv

    def attention(hf_prefix: str, ours: tuple[str, ...]):
        for short, long_ in (("q", "query"), ("k", "key"), ("v", "value")):
            yield f"{hf_prefix}.{short}.weight", (*ours, long_), dense_in(h, k)
        yield f"{hf_prefix}.o.weight", (*ours, "out"), dense_out(h, k)

    def mlp(hf_prefix: str, ours: tuple[str, ...]):
        names = ("wi",) if cfg.mlp_activation == "relu" else ("wi_0", "wi_1")
        for name in (*names, "wo"):
            yield f"{hf_prefix}.{name}.weight", (*ours, name, "kernel"), transpose

    def norm(hf_name: str, ours: tuple[str, ...]):
        yield hf_name, (*ours, "scale"), identity

    yield "shared.weight", ("token_embedder", "embedding"), identity
    for stack, layers in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        yield (f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
               (stack, "relpos_bias", "rel_embedding"), identity)
        yield from norm(f"{stack}.final_layer_norm.weight", (stack, "final_norm"))
        for i in range(layers):
            block, ours = f"{stack}.block.{i}.layer", (stack, f"layers_{i}")
            if stack == "encoder":
                yield from norm(f"{block}.0.layer_norm.weight", (*ours, "pre_attention_norm"))
                yield from attention(f"{block}.0.SelfAttention", (*ours, "attention"))
                yield from norm(f"{block}.1.layer_norm.weight", (*ours, "pre_mlp_norm"))
                yield from mlp(f"{block}.1.DenseReluDense", (*ours, "mlp"))
            else:
                yield from norm(f"{block}.0.layer_norm.weight", (*ours, "pre_self_attention_norm"))
                yield from attention(f"{block}.0.SelfAttention", (*ours, "self_attention"))
                yield from norm(f"{block}.1.layer_norm.weight", (*ours, "pre_cross_attention_norm"))
                yield from attention(f"{block}.1.EncDecAttention", (*ours, "cross_attention"))
                yield from norm(f"{block}.2.layer_norm.weight", (*ours, "pre_mlp_norm"))
                yield from mlp(f"{block}.2.DenseReluDense", (*ours, "mlp"))
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), transpose


def read_safetensors(model_dir: str) -> dict[str, np.ndarray]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise HFImportError(f"{model_dir}: no *.safetensors files (PyTorch .bin checkpoints are not read)")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(load_file(path))
    return tensors



def fill_target(tensors: dict[str, np.ndarray], known: dict[str, tuple[tuple[str, ...], Converter]],
                target: Any, source: str, model_name: str, ignorable: Any = frozenset()) -> Any:
    """Fills `target` (a parameter tree of arrays or ShapeDtypeStructs) from HF tensors by name.

    `known` maps every HF tensor name of the architecture to (our path, converter); names in
    `ignorable` may appear in the file and are dropped. Known tensors whose path is not in
    `target` (parts of the architecture this model does not use) are skipped and logged; an
    unexpected, missing or misshaped tensor is an HFImportError naming it (and both shapes).
    """
    flat_target = traverse_util.flatten_dict(target)
    unexpected = sorted(n for n in tensors if n not in known and n not in ignorable)
    if unexpected:
        raise HFImportError(f"{source}: unexpected tensors for a {model_name} with this config: {unexpected[:5]}"
                           f"{' ...' if len(unexpected) > 5 else ''}")
    out, skipped = {}, []
    for hf_name, (path, fn) in known.items():
        if path not in flat_target:
            if hf_name in tensors:
                skipped.append(hf_name)
            continue
        expected = tuple(flat_target[path].shape)
        hf_expected = fn.hf_shape(expected)
        if hf_name not in tensors:
            raise HFImportError(f"{source}: missing tensor {hf_name!r} for {'/'.join(path)} "
                               f"(expected shape {hf_expected})")
        shape = tuple(tensors[hf_name].shape)
        if shape != hf_expected:
            raise HFImportError(f"{source}: tensor {hf_name!r} has shape {shape}, expected {hf_expected} "
                               f"(for {'/'.join(path)} of shape {expected})")
        out[path] = fn.convert(np.asarray(tensors[hf_name], dtype=np.float32))
    missing = sorted("/".join(p) for p in flat_target if p not in out)
    if missing:
        raise HFImportError(f"{source}: no tensor in the checkpoint for our parameters {missing[:5]}")
    if skipped:
        log.info("%s: %d tensors not used by this model (e.g. %s)", source, len(skipped), skipped[0])
    return traverse_util.unflatten_dict(out)


def convert(tensors: dict[str, np.ndarray], cfg: T5Config, target: Any, source: str = "checkpoint",
            lm_head_from_shared: bool = False) -> Any:
    """Fills `target` (our T5 parameter tree; arrays or ShapeDtypeStructs) from HF tensors."""
    if lm_head_from_shared and "lm_head.weight" not in tensors and "shared.weight" in tensors:
        tensors = {**tensors, "lm_head.weight": tensors["shared.weight"]}
    known = {hf_name: (path, fn) for hf_name, path, fn in name_map(cfg)}
    # Tied copies of the embedding, and an LM head some exports write even when tied.
    ignorable = {*TIED_COPIES, *(("lm_head.weight",) if cfg.tie_word_embeddings else ())}
    return fill_target(tensors, known, target, source, "T5", ignorable)


def load_t5(model_dir: str, target: Any, cfg: T5Config) -> Any:
    """Reads an HF T5 directory into `target`, the parameter tree of a T5 with config `cfg`;
    refuses a directory whose config.json describes another network (`check_config`)."""
    hf = read_hf_config(model_dir)
    check_config(model_dir, t5_config_from_hf(hf), cfg, T5_NUMERIC_FIELDS)
    return convert(read_safetensors(model_dir), cfg, target, source=model_dir,
                   lm_head_from_shared=lm_head_shares_embedding(hf))
