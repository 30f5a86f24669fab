"""Hugging Face T5 checkpoints (`config.json` + `*.safetensors`) -> our Flax parameter tree.

Works for `T5Model`, `T5EncoderModel` and `T5ForConditionalGeneration` directories, v1.0 and v1.1.
Every tensor of our model must come from the file with the right shape; every tensor in the file
must be a known T5 tensor. Known tensors our model does not use (the LM head for a dual encoder, the
decoder for mean pooling) are skipped and reported. A problem is an error naming the tensor and both
shapes, never a silent partial load. `fill_target` is that machinery for any architecture (the BERT
importer, `hf_bert_import`, uses it too).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from flax import traverse_util
from safetensors.numpy import load_file

from t5_retrieval.models.t5 import T5Config

log = logging.getLogger(__name__)
# Tied copies of `shared.weight` that HF may or may not write.
TIED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
Converter = Callable[[np.ndarray], np.ndarray]  # HF tensor -> our array


class HFImportError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor and the shapes."""


def t5_config_from_hf(hf: dict[str, Any], **overrides: Any) -> T5Config:
    """Our T5Config from a HF T5 config.json (dropout and dtype may be overridden for fine-tuning)."""
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
    return lambda w: w.T.reshape(w.shape[1], heads, d_kv)


def dense_out(heads: int, d_kv: int) -> Converter:
    # torch Linear weight [d_model, heads*d_kv] -> kernel [heads, d_kv, d_model]
    return lambda w: w.T.reshape(heads, d_kv, w.shape[0])


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def identity(w: np.ndarray) -> np.ndarray:
    return w


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
        if hf_name not in tensors:
            raise HFImportError(f"{source}: missing tensor {hf_name!r} for {'/'.join(path)} "
                               f"(expected shape {expected})")
        value = fn(np.asarray(tensors[hf_name], dtype=np.float32))
        if value.shape != expected:
            raise HFImportError(f"{source}: tensor {hf_name!r} has shape {tuple(tensors[hf_name].shape)} "
                               f"-> {value.shape} for {'/'.join(path)}, expected {expected}")
        out[path] = value
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


def load_t5(model_dir: str, target: Any, cfg: T5Config | None = None) -> Any:
    """Reads an HF T5 directory into `target`'s structure; cfg defaults to the directory's config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        hf = json.load(f)
    cfg = cfg or t5_config_from_hf(hf)
    return convert(read_safetensors(model_dir), cfg, target, source=model_dir,
                   lm_head_from_shared=lm_head_shares_embedding(hf))
