"""Hugging Face BERT checkpoints (`config.json` + `*.safetensors`) -> our Flax `Bert` parameter tree.

Reads `BertModel` directories (tensor names `embeddings.*`, `encoder.layer.*`, as sentence-transformers
models such as all-MiniLM-L6-v2 store them) and `BertFor*` directories (the same names under a
`bert.` prefix). The pooler and pre-training heads are known but unused (a dual encoder pools the
last hidden states itself) and are skipped; anything else, a missing tensor or a wrong shape is an
HFImportError naming the tensor and both shapes, checked by name before any reshape; a config.json
that differs from the model's BertConfig in a field that changes numerics (sizes, layers, positions,
layer-norm epsilon) is refused naming the field and both values (the shared machinery of `hf_import`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from t5_retrieval.models.bert import BertConfig
from t5_retrieval.models.hf_import import (
    Converter,
    HFImportError,
    check_config,
    dense_in,
    dense_out,
    fill_target,
    identity,
    read_hf_config,
    read_safetensors,
    transpose,
)

# Tensors a BERT checkpoint may hold that our encoder does not use.
UNUSED_PREFIXES = ("pooler.", "cls.")
UNUSED_NAMES = ("embeddings.position_ids", "embeddings.token_type_ids")
# Our BertConfig fields that change what the network computes, with the config.json key of each
# (hidden_act and position_embedding_type are checked by `bert_config_from_hf`).
BERT_NUMERIC_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
    "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
    "layer_norm_epsilon": "layer_norm_eps"}


def is_bert_config(hf: dict[str, Any]) -> bool:
    """Whether a HF config.json describes a BERT encoder (rather than a T5)."""
    return hf.get("model_type") == "bert"


def bert_config_from_hf(hf: dict[str, Any], **overrides: Any) -> BertConfig:
    """Our BertConfig from a HF BERT config.json (dropout and dtype may be overridden for fine-tuning)."""
    if not is_bert_config(hf):
        raise HFImportError(f"config.json: model_type={hf.get('model_type')!r}, expected 'bert'")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise HFImportError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (expected 'gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFImportError(f"config.json: position_embedding_type={hf['position_embedding_type']!r} is not "
                           "supported (expected 'absolute')")
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        max_position_embeddings=hf.get("max_position_embeddings", 512),
        type_vocab_size=hf.get("type_vocab_size", 2), dropout_rate=hf.get("hidden_dropout_prob", 0.1),
        layer_norm_epsilon=hf.get("layer_norm_eps", 1e-12), initializer_range=hf.get("initializer_range", 0.02))
    fields.update(overrides)
    return BertConfig(**fields)


def _bias_in(heads: int, d_kv: int) -> Converter:
    # torch Linear bias [heads*d_kv] -> [heads, d_kv]
    return Converter(lambda b: b.reshape(heads, d_kv), lambda s: (s[0] * s[1],))


def name_map(cfg: BertConfig) -> Iterator[tuple[str, tuple[str, ...], Converter]]:
    """(HF tensor name without `bert.`, our path under the Bert module, converter) for every tensor."""
    h, k = cfg.num_heads, cfg.d_kv

    def norm(hf_prefix: str, ours: tuple[str, ...]):
        yield f"{hf_prefix}.weight", (*ours, "scale"), identity
        yield f"{hf_prefix}.bias", (*ours, "bias"), identity

    def dense(hf_prefix: str, ours: tuple[str, ...]):
        yield f"{hf_prefix}.weight", (*ours, "kernel"), transpose
        yield f"{hf_prefix}.bias", (*ours, "bias"), identity

    for table in ("word", "position", "token_type"):
        yield f"embeddings.{table}_embeddings.weight", ("embeddings", table, "embedding"), identity
    yield from norm("embeddings.LayerNorm", ("embeddings", "layer_norm"))
    for i in range(cfg.num_layers):
        layer, ours = f"encoder.layer.{i}", (f"layers_{i}",)
        for name in ("query", "key", "value"):
            yield f"{layer}.attention.self.{name}.weight", (*ours, "attention", f"{name}_kernel"), dense_in(h, k)
            yield f"{layer}.attention.self.{name}.bias", (*ours, "attention", f"{name}_bias"), _bias_in(h, k)
        yield f"{layer}.attention.output.dense.weight", (*ours, "attention", "out_kernel"), dense_out(h, k)
        yield f"{layer}.attention.output.dense.bias", (*ours, "attention", "out_bias"), identity
        yield from norm(f"{layer}.attention.output.LayerNorm", (*ours, "attention_norm"))
        yield from dense(f"{layer}.intermediate.dense", (*ours, "mlp", "wi"))
        yield from dense(f"{layer}.output.dense", (*ours, "mlp", "wo"))
        yield from norm(f"{layer}.output.LayerNorm", (*ours, "mlp_norm"))


def strip_model_prefix(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`bert.encoder...` (BertFor* heads) -> `encoder...`; other prefixed tensors (heads) keep their name."""
    if not any(n.startswith("bert.") for n in tensors):
        return tensors
    return {n[len("bert."):] if n.startswith("bert.") else n: v for n, v in tensors.items()}


def convert(tensors: dict[str, np.ndarray], cfg: BertConfig, target: Any, source: str = "checkpoint") -> Any:
    """Fills `target` (our Bert parameter tree; arrays or ShapeDtypeStructs) from HF BERT tensors."""
    tensors = strip_model_prefix(tensors)
    known = {hf_name: (path, fn) for hf_name, path, fn in name_map(cfg)}
    ignorable = {n for n in tensors if n.startswith(UNUSED_PREFIXES) or n in UNUSED_NAMES}
    return fill_target(tensors, known, target, source, "BERT", ignorable)


def load_bert(model_dir: str, target: Any, cfg: BertConfig) -> Any:
    """Reads an HF BERT directory into `target`, the parameter tree of a Bert with config `cfg`;
    refuses a directory whose config.json describes another network (`check_config`)."""
    check_config(model_dir, bert_config_from_hf(read_hf_config(model_dir)), cfg, BERT_NUMERIC_FIELDS)
    return convert(read_safetensors(model_dir), cfg, target, source=model_dir)
