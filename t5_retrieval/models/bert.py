"""BERT encoder (Devlin et al. 2019) in Flax linen, with logical axis names for `jax.sharding`.

The MT-DPR model family (Maillard et al. 2021) and sentence-transformers' MiniLM: learned word,
position and token-type embeddings followed by LayerNorm; post-LN transformer layers (attention or
MLP, add the residual, then LayerNorm); exact (erf) GELU; attention scaled by 1/sqrt(d_kv) with
padded keys (token id 0 = [PAD]) masked. Parameter and activation names follow `t5.py` (same
helpers), so the sharding rules of `t5_retrieval.sharding` apply unchanged.

Logical names: parameters use 'vocab', 'embed', 'heads', 'kv', 'mlp', plus 'positions' and
'token_types' for the two small embedding tables; activations use 'batch', 'length', 'embed',
'heads', 'kv', 'mlp'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.attention import (
    SharedBias,
    check_implementation,
    fused_attention,
    kernel_bias,
    short_attention_per_shard,
    uses_kernel,
)
from t5_retrieval.models.t5 import (
    attend,
    padding_bias,
    param_init,
    remat_layer,
    scan_layers,
    scans_layers,
    token_groups,
    unrolled_layers,
    with_constraint,
)

Array = jax.Array
PAD_ID = 0


@gin.configurable
@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture of one BERT encoder; defaults are BERT-base, gin files set other sizes."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    num_layers: int = 12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    dropout_rate: float = 0.1  # hidden and attention-probability dropout (equal in every BERT release)
    layer_norm_epsilon: float = 1e-12
    initializer_range: float = 0.02
    dtype: str = "float32"  # compute dtype; "bfloat16" for bf16 activations (params stay fp32)
    remat: bool = False  # recompute each layer in the backward pass to save activation memory
    scan_layers: bool = False  # one scanned layer body: compile time independent of depth, same params
    # The attention core, as T5Config.attention (gin macro ATTENTION_IMPL; never stored with a model).
    attention: str = "xla"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"BertConfig: hidden_size {self.hidden_size} is not a multiple of "
                              f"num_heads {self.num_heads}")
        check_implementation(self.attention, self.dtype, "BertConfig")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def d_kv(self) -> int:
        return self.hidden_size // self.num_heads


def _normal(cfg: BertConfig, names: tuple[str, ...]):
    return param_init(names, nn.initializers.normal(cfg.initializer_range))


def _zeros(names: tuple[str, ...]):
    return param_init(names, nn.initializers.zeros)


def layer_norm(cfg: BertConfig, name: str) -> nn.LayerNorm:
    """Mean/variance LayerNorm with scale and bias over 'embed'; statistics in float32."""
    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
                        scale_init=param_init(("embed",), nn.initializers.ones),
                        bias_init=_zeros(("embed",)), name=name)


class Embeddings(nn.Module):
    """word + position + token-type (always type 0: one segment per text) embeddings, then LayerNorm."""

    config: BertConfig

    @nn.compact
    def __call__(self, tokens: Array, deterministic: bool) -> Array:
        cfg = self.config
        length = tokens.shape[1]
        if length > cfg.max_position_embeddings:
            raise ConfigError(f"sequence length {length} exceeds BertConfig.max_position_embeddings "
                              f"{cfg.max_position_embeddings}")
        embed = functools.partial(nn.Embed, features=cfg.hidden_size, dtype=jnp.float32, param_dtype=jnp.float32)
        x = embed(cfg.vocab_size, embedding_init=_normal(cfg, ("vocab", "embed")), name="word")(tokens)
        positions = embed(cfg.max_position_embeddings, embedding_init=_normal(cfg, ("positions", "embed")),
                          name="position")
        token_types = embed(cfg.type_vocab_size, embedding_init=_normal(cfg, ("token_types", "embed")),
                            name="token_type")
        x = x + positions(jnp.arange(length))[None] + token_types(jnp.zeros((1, length), jnp.int32))
        x = layer_norm(cfg, "layer_norm")(x.astype(cfg.compute_dtype))
        x = with_constraint(x, ("batch", "length", "embed"))
        return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


class SelfAttention(nn.Module):
    """Scaled dot-product multi-head self-attention with biased projections.

    Kernels are declared in their [embed, heads, kv] / [heads, kv, embed] shapes, as in t5.Attention.
    """

    config: BertConfig

    def _param(self, name: str, shape: tuple[int, ...], init) -> Array:
        return self.param(name, init, shape, jnp.float32).astype(self.config.compute_dtype)

    def _project_qkv(self, x: Array) -> tuple[Array, Array, Array]:
        """Queries, keys and values from one matmul over the three stacked kernels: one
        [d, 3 x heads x kv] GEMM runs ~8% faster on CPU than three [d, heads x kv] ones (MiniLM
        encode), with the same parameters (and checkpoints) and outputs equal to float32 rounding."""
        cfg = self.config
        h, dk = cfg.num_heads, cfg.d_kv
        names = ("query", "key", "value")
        kernels = [self._param(f"{n}_kernel", (cfg.hidden_size, h, dk), _normal(cfg, ("embed", "heads", "kv")))
                   for n in names]
        biases = [self._param(f"{n}_bias", (h, dk), _zeros(("heads", "kv"))) for n in names]
        qkv = jnp.einsum("bld,dnhk->blnhk", x, jnp.stack(kernels, 1)) + jnp.stack(biases)
        q, k, v = (with_constraint(qkv[:, :, i], ("batch", "length", "heads", "kv")) for i in range(3))
        return q, k, v

    @nn.compact
    def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
        """`key_mask` [b, l]: the keys to attend to (padding is not; BERT masks keys only)."""
        cfg = self.config
        q, k, v = self._project_qkv(x)
        q = q * jnp.asarray(cfg.d_kv ** -0.5, cfg.compute_dtype)
        bias = padding_bias(jnp.ones_like(key_mask), key_mask)
        if cfg.attention == "pallas_tpu" and uses_kernel(cfg.attention, x.shape[1]):
            # padding as segment ids: no [b, heads, q, k] bias is built
            context = fused_attention(cfg.attention, q, k, v, key_mask=key_mask)
        elif cfg.attention == "pallas_tpu_short" and uses_kernel(cfg.attention, x.shape[1]):
            # no bias but the padding of the keys; the kernel takes heads-major rows
            length = x.shape[1]
            shared = SharedBias(jnp.zeros((1, length, length), jnp.float32), jnp.ones_like(key_mask), key_mask)
            q_rows, k_rows, v_rows = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))
            context = jnp.swapaxes(short_attention_per_shard(q_rows, k_rows, v_rows, shared), 1, 2)
        elif uses_kernel(cfg.attention, x.shape[1]):
            context = fused_attention(cfg.attention, q, k, v, kernel_bias(bias, x.shape[0], cfg.num_heads, cfg.attention))
        else:
            logits = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32) + bias
            weights = jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype)
            weights = nn.Dropout(cfg.dropout_rate)(weights, deterministic=deterministic)
            context = attend(weights, v)
        wo = self._param("out_kernel", (cfg.num_heads, cfg.d_kv, cfg.hidden_size),
                         _normal(cfg, ("heads", "kv", "embed")))
        bo = self._param("out_bias", (cfg.hidden_size,), _zeros(("embed",)))
        return with_constraint(jnp.einsum("bqhk,hkd->bqd", context, wo) + bo, ("batch", "length", "embed"))


class MLP(nn.Module):
    """Dense -> exact GELU -> Dense, with biases."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dense = functools.partial(nn.Dense, dtype=cfg.compute_dtype, param_dtype=jnp.float32)
        h = dense(cfg.intermediate_size, name="wi", kernel_init=_normal(cfg, ("embed", "mlp")),
                  bias_init=_zeros(("mlp",)))(x)
        h = with_constraint(jax.nn.gelu(h, approximate=False), ("batch", "length", "mlp"))
        return dense(cfg.hidden_size, name="wo", kernel_init=_normal(cfg, ("mlp", "embed")),
                     bias_init=_zeros(("embed",)))(h)


class Layer(nn.Module):
    """Post-LN transformer layer: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    config: BertConfig

    @nn.compact
    def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        attended = SelfAttention(cfg, name="attention")(x, key_mask, deterministic)
        x = layer_norm(cfg, "attention_norm")(x + drop(attended, deterministic=deterministic))
        x = layer_norm(cfg, "mlp_norm")(x + drop(MLP(cfg, name="mlp")(x), deterministic=deterministic))
        return with_constraint(x, ("batch", "length", "embed"))


class Bert(nn.Module):
    """Groups of [b, l] token ids (0 = [PAD]) -> their [b, l, hidden] last hidden states (no pooler
    head), every group through each layer in one pass of the stack (see `scan_layers`)."""

    config: BertConfig

    @nn.compact
    def __call__(self, tokens: Sequence[Array], deterministic: bool = True) -> tuple[Array, ...]:
        cfg = self.config
        tokens = token_groups(tokens)
        embeddings = Embeddings(cfg, name="embeddings")
        xs = [embeddings(group, deterministic) for group in tokens]
        # Only keys are masked (as in BERT); padded query rows are ignored by the pooling.
        masks = [(group != PAD_ID,) for group in tokens]
        if scans_layers(self, cfg.scan_layers):
            return scan_layers(self, Layer(cfg, parent=None), cfg.num_layers, xs, masks, deterministic,
                               "nothing_saveable" if cfg.remat else None)
        layer_cls = remat_layer(Layer) if cfg.remat else Layer
        return unrolled_layers(layer_cls, cfg, cfg.num_layers, xs, masks, deterministic)
