"""Sentence-T5 dual encoder: one shared T5 embeds queries and passages the same way.

ST5-EncDec (the TACO model, default): the encoder reads the text, the decoder runs one step from the
start token (id 0) cross-attending to it, and the embedding is the decoder's final-norm hidden state
(before any LM head). ST5-Enc: mean of the encoder states over non-padding tokens. GTR/ST5 options
(projection, L2 normalisation) are switches; TACO uses raw dot products with none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.families import HFImport, ModelFamily, register_family
from t5_retrieval.models.t5 import T5, T5Config, param_init, with_constraint

POOLINGS = ("encdec", "mean")


class QueryTowers:
    """Which encoder embeds a task's queries; shared by the configs of both model families.

    Needs fields `query_towers` (> 0: one query encoder per task) and `separate_query_encoder`
    (one query encoder for all tasks, DPR's two towers). Passages always use the main encoder.
    """

    query_towers: int
    separate_query_encoder: bool

    @property
    def num_query_towers(self) -> int:
        return self.query_towers or int(self.separate_query_encoder)

    def query_tower(self, task_index: int) -> int | None:
        """The tower index for task `task_index`'s queries; None = the shared (passage) encoder."""
        if self.query_towers:
            return task_index
        return 0 if self.separate_query_encoder else None

    def check_towers(self) -> None:
        if self.query_towers and self.separate_query_encoder:
            raise ConfigError(f"{type(self).__name__}: choose per-task query towers (query_towers="
                              f"{self.query_towers}) or one separate query encoder, not both")


def mean_pool(encoded: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of the states of non-padding tokens, in float32."""
    weights = mask.astype(jnp.float32)[..., None]
    return jnp.sum(encoded.astype(jnp.float32) * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + 1e-12)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DualEncoderConfig(QueryTowers):
    pooling: str = "encdec"  # "encdec" (ST5-EncDec) or "mean" (ST5-Enc)
    projection_dim: int | None = None  # a bias-free linear map after pooling (ST5/GTR), or none
    l2_normalize: bool = False
    logit_scale: float = 1.0  # similarity multiplier in the loss (1/temperature); TACO: 1.0
    # > 0: one separate query encoder per task (TACO/MT-DPR ablation); passages keep the shared one.
    query_towers: int = 0
    # GDMTL: the shared T5 also learns to generate each query from its positive passage (the
    # trainer adds that loss); creates the LM head.
    query_generation: bool = False
    # One query encoder for all tasks (its own weights), a shared passage encoder.
    separate_query_encoder: bool = False

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"DualEncoderConfig.pooling: expected one of {POOLINGS}, got {self.pooling!r}")
        self.check_towers()


class DualEncoder(nn.Module):
    """Shared-tower text encoder: [b, l] token ids (0 = padding) -> [b, dim] float32 embeddings."""

    t5_config: T5Config
    config: DualEncoderConfig = DualEncoderConfig()

    def setup(self) -> None:
        self.t5 = T5(self.t5_config)
        self.query_t5 = [T5(self.t5_config, name=f"query_t5_{k}") for k in range(self.config.num_query_towers)]
        if self.config.projection_dim:
            self.projection = nn.Dense(
                self.config.projection_dim, use_bias=False, dtype=self.t5_config.compute_dtype,
                param_dtype=jnp.float32,
                kernel_init=param_init(("embed", "projection"),
                                       nn.initializers.normal(self.t5_config.d_model ** -0.5)))

    @property
    def embedding_dim(self) -> int:
        return self.config.projection_dim or self.t5_config.d_model

    def __call__(self, tokens: jax.Array, deterministic: bool = True, tower: int | None = None) -> jax.Array:
        """Embeds texts with the shared T5, or with query tower `tower` (a static task index)."""
        if self.is_initializing() and tower is None:
            for k in range(self.config.num_query_towers):  # create every tower's parameters at init
                self(tokens, deterministic, tower=k)
            if self.config.query_generation:  # and the LM head
                self.query_generation_logits(tokens, tokens, deterministic)
        (embedded,) = self.embed_groups((tokens,), deterministic, tower)
        return embedded

    def embed_groups(self, tokens: Sequence[jax.Array], deterministic: bool = True, tower: int | None = None
                     ) -> tuple[jax.Array, ...]:
        """Embeds groups of texts ([b_g, l_g] each, e.g. a step's queries of each length and its
        passages) in one pass of the encoder and one of the decoder: under FSDP each layer's
        weights are gathered once for all groups, and the backward pass builds one gradient per
        stack instead of one per group."""
        if tower is not None and not 0 <= tower < self.config.num_query_towers:
            raise ValueError(f"query tower {tower} requested, but the model has {self.config.num_query_towers}")
        t5 = self.t5 if tower is None else self.query_t5[tower]
        masks = tuple(group != 0 for group in tokens)
        encoded = t5.encode(tokens, deterministic)
        if self.config.pooling == "encdec":
            starts = tuple(jnp.zeros((group.shape[0], 1), dtype=group.dtype) for group in tokens)
            pooled = tuple(h[:, 0] for h in t5.decode(starts, encoded, masks, deterministic))
        else:
            pooled = tuple(mean_pool(e, mask) for e, mask in zip(encoded, masks, strict=True))
        return tuple(self._head(p) for p in pooled)

    def _head(self, pooled: jax.Array) -> jax.Array:
        """Pooled states -> embeddings: the projection if any, float32, L2-normalised if asked."""
        if self.config.projection_dim:
            pooled = self.projection(pooled)
        pooled = pooled.astype(jnp.float32)
        if self.config.l2_normalize:
            pooled = l2_normalize(pooled)
        return with_constraint(pooled, ("batch", "embed"))

    def query_generation_logits(self, passage_tokens: jax.Array, query_tokens: jax.Array,
                                deterministic: bool = True) -> jax.Array:
        """GDMTL: teacher-forced logits [b, l_q, vocab] of the query given its passage.

        The shared T5 encodes the passage; the decoder reads the query shifted right by one
        (start token 0 first), so position t predicts query token t.
        """
        decoder_inputs = jnp.pad(query_tokens[:, :-1], ((0, 0), (1, 0)))
        return self.t5(passage_tokens, decoder_inputs, deterministic).astype(jnp.float32)


def t5_forward_flops(config: dict[str, Any], rows: int, length: int) -> float:
    """Matmul FLOPs (2*m*n*k each) of one encoder forward over [rows, length] tokens, padding included:
    projections, attention scores and mixing, MLP; with encdec pooling also the decoder's one step
    (cross-attention over the sequence)."""
    tokens = rows * length
    c = config["t5"]
    inner = c["num_heads"] * c["d_kv"]
    mlp = 2 * c["d_model"] * c["d_ff"] * (3 if c["mlp_activation"] == "gated-gelu" else 2)
    encoder = tokens * (2 * c["d_model"] * inner * 4 + 2 * 2 * length * inner + mlp) * c["num_encoder_layers"]
    if config["dual_encoder"]["pooling"] != "encdec":
        return float(encoder)
    # one decoder position: self-attention on itself, cross-attention keys/values over the sequence
    decoder = (rows * (2 * c["d_model"] * inner * 6 + 2 * 2 * length * inner + mlp)
               + tokens * 2 * c["d_model"] * inner * 2) * c["num_decoder_layers"]
    return float(encoder + decoder)


def load_hf_t5(directory: str, target: Any, cfg: T5Config) -> Any:
    from t5_retrieval.models import hf_import  # safetensors: only when importing

    return hf_import.load_t5(directory, target, cfg)


T5_FAMILY = register_family(ModelFamily(
    name="t5", network=T5Config, head=DualEncoderConfig, module=DualEncoder,
    depth_keys=("num_encoder_layers", "num_decoder_layers"), forward_flops=t5_forward_flops, dropout_keys=("dropout_rate",),
    float32_params=("scale", "rel_embedding"), runtime_keys=("attention",),
    hf_import=HFImport(model_type="t5", load=load_hf_t5)))
