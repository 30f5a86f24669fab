"""T5 v1.0 / v1.1 encoder-decoder in Flax linen, with logical axis names for `jax.sharding`.

The layer layout follows the T5 paper (Raffel et al. 2020) and the v1.1 release: pre-norm RMSNorm
residual blocks, relative position buckets shared by all layers of a stack, no attention scaling
(folded into the initialisation), ReLU (v1.0) or gated-GELU (v1.1) MLPs, tied or untied output
embeddings. Every parameter carries logical axis names and the main activations carry logical
constraints, so a mesh plus rules (`t5_retrieval.sharding`) decides data/FSDP/tensor parallelism.

Logical names: parameters use 'vocab', 'embed', 'heads', 'kv', 'mlp', 'relpos_buckets';
activations use 'batch', 'length', 'embed', 'heads', 'kv', 'mlp'.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.attention import (
    NEG_INF,
    SharedBias,
    check_implementation,
    fused_attention,
    kernel_bias,
    short_attention_per_shard,
    uses_kernel,
)

Array = jax.Array
# `jax.checkpoint_policies` a rematerialised layer may use, from keeping nothing (every activation
# recomputed) to keeping the outputs of its weight matmuls (only attention and elementwise
# recomputed) or of every matmul.
REMAT_POLICIES = ("nothing_saveable", "dots_with_no_batch_dims_saveable", "dots_saveable")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config:
    """Architecture of one T5 model; gin files in gin_configs/models/ set these per size."""

    vocab_size: int = 32128
    d_model: int = 512
    num_heads: int = 8
    d_kv: int = 64
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    mlp_activation: str = "gated-gelu"  # "relu" (T5 v1.0) or "gated-gelu" (T5 v1.1)
    tie_word_embeddings: bool = False  # True in T5 v1.0
    dtype: str = "float32"  # compute dtype; "bfloat16" for bf16 activations (params stay fp32)
    remat: bool = False  # recompute each layer in the backward pass to save activation memory
    remat_policy: str = "nothing_saveable"  # with remat, what the backward pass keeps (REMAT_POLICIES)
    scan_layers: bool = False  # one scanned layer body: compile time independent of depth, same params
    # Attention logits and softmax in float32 whatever `dtype`. False computes them in `dtype`, as
    # t5x and MaxText do by default: T5-base's bf16 train step on v5e is estimated 8% faster, for a
    # softmax rounded to bf16.
    float32_attention_logits: bool = True
    # The attention core: "xla", "pallas_tpu" (flash attention on TPU), "pallas_tpu_short" (whole
    # rows per kernel step, the bias per head) or "cudnn" (fused attention on NVIDIA GPUs;
    # bf16/fp16), gin macro ATTENTION_IMPL (models/attention.py, docs/attention.md).
    # How the chips compute, not what: never stored with a model (`ModelFamily.runtime_keys`), so a
    # model directory loads anywhere with the run's own choice.
    attention: str = "xla"

    def __post_init__(self) -> None:
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(f"T5Config.remat_policy: expected one of {REMAT_POLICIES}, got {self.remat_policy!r}")
        check_implementation(self.attention, self.dtype, "T5Config")

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def logits_dtype(self) -> jnp.dtype:
        """The dtype attention logits are computed, biased and normalised in."""
        return jnp.dtype(jnp.float32) if self.float32_attention_logits else self.compute_dtype


def attend(weights: jax.Array, values: jax.Array) -> jax.Array:
    """Attention weights [b, h, q, s] applied to values [b, s, h, k] -> [b, q, h, k].

    The product is taken head-major ([b, h, q, k]) and then transposed: asked for [b, q, h, k]
    directly, XLA's CPU backend fuses the softmax into a strided batched matmul that took a third of
    MiniLM's encode time; this form gives the same values (to float32 rounding; bitwise for MiniLM's
    16 x 128 encode) 1.3x faster end to end.
    """
    return jnp.swapaxes(jnp.einsum("bhqs,bshk->bhqk", weights, values), 1, 2)


def with_constraint(x: Array, names: tuple[str | None, ...]) -> Array:
    """Annotates an activation with logical axes; a no-op outside a mesh/rules context."""
    return nn.with_logical_constraint(x, names)


def param_init(names: tuple[str, ...], init: Callable) -> Callable:
    return nn.with_logical_partitioning(init, names)


class RMSNorm(nn.Module):
    """T5 layer norm: scale only, no mean subtraction, no bias; statistics in float32."""

    epsilon: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", param_init(("embed",), nn.initializers.ones), (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return (x32 * scale).astype(self.dtype)


def relative_position_bucket(relative_position: Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> Array:
    """Maps key-minus-query offsets to buckets: exact for small offsets, log-spaced up to max_distance."""
    bucket = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """Learned per-head scalar bias for each relative-position bucket (computed once per stack)."""

    config: T5Config
    bidirectional: bool

    @nn.compact
    def __call__(self, query_length: int, key_length: int) -> Array:
        cfg = self.config
        table = self.param(
            "rel_embedding", param_init(("relpos_buckets", "heads"), nn.initializers.normal(1.0)),
            (cfg.relative_attention_num_buckets, cfg.num_heads), jnp.float32)
        context = jnp.arange(query_length)[:, None]
        memory = jnp.arange(key_length)[None, :]
        buckets = relative_position_bucket(memory - context, self.bidirectional,
                                           cfg.relative_attention_num_buckets,
                                           cfg.relative_attention_max_distance)
        bias = jnp.take(table, buckets, axis=0)  # [q, k, heads]
        return jnp.transpose(bias, (2, 0, 1))[None]  # [1, heads, q, k]


class Attention(nn.Module):
    """Multi-head attention without the 1/sqrt(d) scaling (T5 folds it into the query init).

    Kernels are declared directly in their [embed, heads, kv] / [heads, kv, embed] shapes (rather than
    through nn.DenseGeneral, whose flat-then-reshape init clashes with logical-axis boxing).
    """

    config: T5Config

    def _kernel(self, name: str, names: tuple[str, ...], shape: tuple[int, ...], stddev: float) -> Array:
        kernel = self.param(name, param_init(names, nn.initializers.normal(stddev)), shape, jnp.float32)
        return kernel.astype(self.config.compute_dtype)

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array, bias: Array | SharedBias, deterministic: bool) -> Array:
        cfg = self.config
        d, h, dk = cfg.d_model, cfg.num_heads, cfg.d_kv
        in_names, in_shape = ("embed", "heads", "kv"), (d, h, dk)
        wq = self._kernel("query", in_names, in_shape, (d * dk) ** -0.5)
        wk = self._kernel("key", in_names, in_shape, d ** -0.5)
        wv = self._kernel("value", in_names, in_shape, d ** -0.5)
        wo = self._kernel("out", ("heads", "kv", "embed"), (h, dk, d), (h * dk) ** -0.5)
        if isinstance(bias, SharedBias):  # "pallas_tpu_short": projected straight into heads-major
            q, k, v = (with_constraint(jnp.einsum("bld,dhk->bhlk", x, w), ("batch", "heads", "length", "kv"))
                       for x, w in ((inputs_q, wq), (inputs_kv, wk), (inputs_kv, wv)))
            out = short_attention_per_shard(q, k, v, bias)
            return with_constraint(jnp.einsum("bhqk,hkd->bqd", out, wo), ("batch", "length", "embed"))
        names = ("batch", "length", "heads", "kv")
        q = with_constraint(jnp.einsum("bld,dhk->blhk", inputs_q, wq), names)
        dropout = nn.Dropout(cfg.dropout_rate)
        if uses_kernel(cfg.attention, inputs_q.shape[1]):
            # `bias` as `stack_bias` made it for the kernel; no dropout on attention probabilities.
            k = with_constraint(jnp.einsum("bld,dhk->blhk", inputs_kv, wk), names)
            v = with_constraint(jnp.einsum("bld,dhk->blhk", inputs_kv, wv), names)
            out = fused_attention(cfg.attention, q, k, v, bias)
            return with_constraint(jnp.einsum("bqhk,hkd->bqd", out, wo), ("batch", "length", "embed"))
        bias = bias.astype(cfg.logits_dtype)
        if inputs_q.shape[1] == 1:
            # One query position (the dual encoder's single decoder step): fold the key and value
            # projections into the query side instead of projecting every memory state. Same
            # result up to float reassociation, O(L*d*h) instead of O(L*d*h*d_kv) per layer.
            q_in_memory_space = jnp.einsum("bqhk,dhk->bqhd", q, wk)
            logits = jnp.einsum("bqhd,bsd->bhqs", q_in_memory_space, inputs_kv,
                                preferred_element_type=cfg.logits_dtype) + bias
            weights = dropout(jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype), deterministic=deterministic)
            context = jnp.einsum("bhqs,bsd->bqhd", weights, inputs_kv)
            out = jnp.einsum("bqhd,dhk->bqhk", context, wv)
        else:
            k = with_constraint(jnp.einsum("bld,dhk->blhk", inputs_kv, wk), names)
            v = with_constraint(jnp.einsum("bld,dhk->blhk", inputs_kv, wv), names)
            logits = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=cfg.logits_dtype) + bias
            weights = dropout(jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype), deterministic=deterministic)
            out = attend(weights, v)
        out = jnp.einsum("bqhk,hkd->bqd", out, wo)
        return with_constraint(out, ("batch", "length", "embed"))


class MLP(nn.Module):
    """ReLU (v1.0) or gated-GELU (v1.1, tanh-approximated GELU as in the release) feed-forward block."""

    config: T5Config

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        cfg = self.config
        dense = functools.partial(nn.Dense, use_bias=False, dtype=cfg.compute_dtype, param_dtype=jnp.float32)
        init_in = param_init(("embed", "mlp"), nn.initializers.normal(cfg.d_model ** -0.5))
        if cfg.mlp_activation == "relu":
            h = jax.nn.relu(dense(cfg.d_ff, name="wi", kernel_init=init_in)(x))
        elif cfg.mlp_activation == "gated-gelu":
            gate = jax.nn.gelu(dense(cfg.d_ff, name="wi_0", kernel_init=init_in)(x), approximate=True)
            h = gate * dense(cfg.d_ff, name="wi_1", kernel_init=init_in)(x)
        else:
            raise ConfigError(f"T5Config.mlp_activation: expected 'relu' or 'gated-gelu', got {cfg.mlp_activation!r}")
        h = with_constraint(h, ("batch", "length", "mlp"))
        h = nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        init_out = param_init(("mlp", "embed"), nn.initializers.normal(cfg.d_ff ** -0.5))
        return dense(cfg.d_model, name="wo", kernel_init=init_out)(h)


class EncoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: Array, bias: Array, deterministic: bool) -> Array:
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        h = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="pre_attention_norm")(x)
        x = x + drop(Attention(cfg, name="attention")(h, h, bias, deterministic), deterministic=deterministic)
        h = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="pre_mlp_norm")(x)
        x = x + drop(MLP(cfg, name="mlp")(h, deterministic), deterministic=deterministic)
        return with_constraint(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: Array, encoded: Array, self_bias: Array, cross_bias: Array,
                 deterministic: bool) -> Array:
        cfg = self.config
        drop = nn.Dropout(cfg.dropout_rate)
        h = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="pre_self_attention_norm")(x)
        x = x + drop(Attention(cfg, name="self_attention")(h, h, self_bias, deterministic),
                     deterministic=deterministic)
        h = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="pre_cross_attention_norm")(x)
        x = x + drop(Attention(cfg, name="cross_attention")(h, encoded, cross_bias, deterministic),
                     deterministic=deterministic)
        h = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="pre_mlp_norm")(x)
        x = x + drop(MLP(cfg, name="mlp")(h, deterministic), deterministic=deterministic)
        return with_constraint(x, ("batch", "length", "embed"))


def padding_bias(query_mask: Array, key_mask: Array) -> Array:
    """[b, 1, q, k] additive bias that hides padded keys (and rows of padded queries)."""
    allowed = query_mask[:, None, :, None] & key_mask[:, None, None, :]
    return jnp.where(allowed, 0.0, NEG_INF).astype(jnp.float32)


def stack_bias(cfg: T5Config, per_head: Array | None, query_mask: Array, key_mask: Array | None
               ) -> Array | SharedBias:
    """A stack's attention bias as its layers take it, once per stack: from the bias every row shares
    (`per_head` [1, heads, q, k], or None) and the real queries [b, q] and keys [b, k] (None: every
    key real, no padding term, as a decoder's self-attention).

    The XLA path takes their sum [b or 1, heads or 1, q, k]; "pallas_tpu" and "cudnn" that sum laid
    out for their kernel (`attention.kernel_bias`); "pallas_tpu_short" the parts (`SharedBias`)."""
    batch, q_len = query_mask.shape
    if cfg.attention == "pallas_tpu_short" and uses_kernel(cfg.attention, q_len):
        k_len = query_mask.shape[1] if key_mask is None else key_mask.shape[1]
        shared = jnp.zeros((1, q_len, k_len), jnp.float32) if per_head is None else per_head[0].astype(jnp.float32)
        return SharedBias(shared, query_mask, jnp.ones((batch, k_len), bool) if key_mask is None else key_mask)
    bias = None if key_mask is None else padding_bias(query_mask, key_mask)
    if per_head is not None:
        bias = per_head if bias is None else per_head + bias
    if bias is None:
        raise ValueError("stack_bias: neither a per-head bias nor key padding")
    if not uses_kernel(cfg.attention, q_len):
        return bias
    return kernel_bias(bias, batch, cfg.num_heads, cfg.attention)


def _plain(tree: Any) -> Any:
    """`tree` with every mapping a dict: parameters handed in by TensorFlow (jax2tf, the SavedModel
    export) come wrapped in its own dict type, which pytree functions do not match with a dict."""
    return {k: _plain(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def _stack_layers(params: Mapping[str, Any], num_layers: int, matrix_dtype: jnp.dtype) -> dict:
    """The `layers_{i}` subtrees stacked leaf-wise along a new leading layer axis, their matrices
    (leaves of 2+ dimensions) cast to `matrix_dtype` first.

    A layer uses its matrices only in the compute dtype (T5's and BERT's layers cast them at use;
    only the norms' vectors stay float32), so casting before stacking computes the same values, and
    the gradient the scan's backward pass builds for the stacked copy, one per call of the stack,
    is in that dtype too. In bf16 those gradients were float32 and most of T5-XXL's train-step
    temporaries (on 16 v5e chips: ten calls, about 1.1 GiB each per device, 10.8 of 15.6 GiB)."""
    layers = [_plain(params[f"layers_{i}"]) for i in range(num_layers)]

    def stack(*leaves: Array) -> Array:
        return jnp.stack([x.astype(matrix_dtype) if x.ndim >= 2 else x for x in leaves])

    return jax.tree_util.tree_map(stack, *layers)


def _constrain_stacked(layer: nn.Module, stacked: dict, inputs: tuple[Any, ...]) -> dict:
    """Keeps the stacked parameters sharded like the per-layer ones (layer axis replicated), so
    XLA slices each layer's shard inside the loop instead of gathering every layer up front."""
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    boxed = jax.eval_shape(lambda *a: layer.init(jax.random.PRNGKey(0), *a, True), *specs)["params"]

    def constrain(box: object, value: Array) -> Array:
        names = box.names if isinstance(box, nn.LogicallyPartitioned) else (None,) * (value.ndim - 1)
        return with_constraint(value, (None, *names))

    is_box = lambda v: isinstance(v, nn.meta.AxisMetadata)  # noqa: E731
    return jax.tree_util.tree_map(constrain, boxed, stacked, is_leaf=is_box)


def token_groups(tokens: Sequence[Array]) -> tuple[Array, ...]:
    """`tokens` as a tuple of groups; one array (whose rows would pass for groups) is refused."""
    if isinstance(tokens, jax.Array | np.ndarray):
        raise TypeError(f"expected a sequence of [b, l] token arrays (groups of texts), got one array of shape "
                        f"{tokens.shape}: pass (tokens,)")
    return tuple(tokens)


def scan_layers(module: nn.Module, layer: nn.Module, num_layers: int, xs: Sequence[Array],
                args: Sequence[tuple[Array | SharedBias, ...]], deterministic: bool, remat_policy: str | None
                ) -> tuple[Array, ...]:
    """Runs `module`'s `layers_{i}` children as one `lax.scan` over their stacked parameters.

    The unrolled stack compiles a program that grows with depth; the scan compiles one layer body.
    `layer` is an unbound copy of the layer module applied functionally to each layer's slice, so
    the parameter tree (created unrolled at init) is unchanged. `xs[g]` and `args[g]` are group g's
    input and the layer's further arguments: each layer runs every group before the next layer, so
    one loop reads (and under FSDP gathers) each layer's weights once for all groups, and its
    backward pass builds one stack of weight gradients instead of one per group. Each layer's
    dropout key is the stack's key folded with the layer index (groups after the first draw
    further masks from it). `remat_policy`: the body rematerialised with that
    `jax.checkpoint_policies` policy (None: not rematerialised).
    """
    params = nn.unbox(module.variables["params"])
    stacked = _constrain_stacked(layer, _stack_layers(params, num_layers, layer.config.compute_dtype),
                                 (xs[0], *args[0]))
    key = None if deterministic else module.make_rng("dropout")

    def every_group(bound: nn.Module, xs: tuple[Array, ...]) -> tuple[Array, ...]:
        return tuple(bound(x, *a, deterministic) for x, a in zip(xs, args, strict=True))

    def body(carry: tuple[Array, ...], sliced: tuple[dict, Array]) -> tuple[tuple[Array, ...], None]:
        layer_params, index = sliced
        rngs = {} if key is None else {"dropout": jax.random.fold_in(key, index)}
        out = layer.apply({"params": layer_params}, carry, rngs=rngs, method=every_group)
        return cast(tuple[Array, ...], out), None

    step = body if remat_policy is None else jax.checkpoint(body, policy=getattr(jax.checkpoint_policies,
                                                                                remat_policy))
    out, _ = jax.lax.scan(step, tuple(xs), (stacked, jnp.arange(num_layers)))
    return out


def unrolled_layers(layer_cls: type[nn.Module], config: Any, num_layers: int, xs: Sequence[Array],
                    args: Sequence[tuple[Array | SharedBias, ...]], deterministic: bool) -> tuple[Array, ...]:
    """The `layers_{i}` children created in the calling compact method and applied in turn, every
    group through each layer before the next (the unscanned form of `scan_layers`)."""
    out = tuple(xs)
    for i in range(num_layers):
        layer = layer_cls(config, name=f"layers_{i}")
        out = tuple(layer(x, *a, deterministic) for x, a in zip(out, args, strict=True))
    return out


def scans_layers(module: nn.Module, scan: bool) -> bool:
    """Scan only when applying: init creates the layers unrolled, which defines the parameter tree."""
    return scan and not module.is_initializing()


def remat_layer(cls: type[nn.Module], policy: str = "nothing_saveable") -> type[nn.Module]:
    """`cls` recomputed in the backward pass (keeping what the `jax.checkpoint_policies` `policy`
    saves), its `deterministic` flag (the last argument of `__call__`) kept static. Flax counts
    `static_argnums` with `self` as 0 and shifts them by one, so a negative index would name the
    argument before it: the position is counted from the signature."""
    deterministic = len(inspect.signature(cls.__call__).parameters) - 1
    return nn.remat(cls, static_argnums=(deterministic,), policy=getattr(jax.checkpoint_policies, policy))


def remat_policy(cfg: T5Config) -> str | None:
    """The layers' rematerialisation policy, None without remat."""
    return cfg.remat_policy if cfg.remat else None


def _layer(cls: type[nn.Module], cfg: T5Config) -> type[nn.Module]:
    return remat_layer(cls, cfg.remat_policy) if cfg.remat else cls


class Encoder(nn.Module):
    """Encodes groups of texts of their own shapes through one stack (see `scan_layers`)."""

    config: T5Config
    embedder: nn.Module

    @nn.compact
    def __call__(self, tokens: Sequence[Array], deterministic: bool) -> tuple[Array, ...]:
        cfg = self.config
        dropout = nn.Dropout(cfg.dropout_rate)
        position_bias = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")
        xs, biases = [], []
        for group in token_groups(tokens):
            x = with_constraint(self.embedder(group).astype(cfg.compute_dtype), ("batch", "length", "embed"))
            xs.append(dropout(x, deterministic=deterministic))
            mask, length = group != 0, group.shape[1]
            biases.append((stack_bias(cfg, position_bias(length, length), mask, mask),))
        if scans_layers(self, cfg.scan_layers):
            out = scan_layers(self, EncoderLayer(cfg, parent=None), cfg.num_encoder_layers, xs, biases,
                              deterministic, remat_policy(cfg))
        else:
            out = unrolled_layers(_layer(EncoderLayer, cfg), cfg, cfg.num_encoder_layers, xs, biases, deterministic)
        final_norm = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="final_norm")
        final_dropout = nn.Dropout(cfg.dropout_rate)
        return tuple(final_dropout(final_norm(x), deterministic=deterministic) for x in out)


class Decoder(nn.Module):
    config: T5Config
    embedder: nn.Module

    @nn.compact
    def __call__(self, tokens: Sequence[Array], encoded: Sequence[Array], encoder_masks: Sequence[Array],
                 deterministic: bool) -> tuple[Array, ...]:
        """Teacher-forced causal decoding of each group; its final-norm hidden states [b, t, d_model]."""
        cfg = self.config
        dropout = nn.Dropout(cfg.dropout_rate)
        position_bias = RelativePositionBias(cfg, bidirectional=False, name="relpos_bias")
        xs, args = [], []
        for group, memory, memory_mask in zip(token_groups(tokens), encoded, encoder_masks, strict=True):
            xs.append(dropout(self.embedder(group).astype(cfg.compute_dtype), deterministic=deterministic))
            length = group.shape[1]
            causal = jnp.tril(jnp.ones((length, length), dtype=bool))
            self_bias = position_bias(length, length) + jnp.where(causal, 0.0, NEG_INF)[None, None]
            queries = jnp.ones(group.shape, dtype=bool)
            args.append((memory, stack_bias(cfg, self_bias, queries, None), stack_bias(cfg, None, queries, memory_mask)))
        if scans_layers(self, cfg.scan_layers):
            out = scan_layers(self, DecoderLayer(cfg, parent=None), cfg.num_decoder_layers, xs, args,
                              deterministic, remat_policy(cfg))
        else:
            out = unrolled_layers(_layer(DecoderLayer, cfg), cfg, cfg.num_decoder_layers, xs, args, deterministic)
        final_norm = RMSNorm(cfg.layer_norm_epsilon, cfg.compute_dtype, name="final_norm")
        final_dropout = nn.Dropout(cfg.dropout_rate)
        return tuple(final_dropout(final_norm(x), deterministic=deterministic) for x in out)


class T5(nn.Module):
    """Encoder-decoder T5 with a shared token embedding.

    `encode` and `decode` are separate entry points so that a dual encoder can run the decoder for a
    single step; `logits` gives the LM head (tied embeddings are scaled by d_model^-0.5 as in T5 v1.0).
    Both take groups of texts, each group its own shape, and run them through one pass of each stack.
    """

    config: T5Config

    def setup(self) -> None:
        cfg = self.config
        self.token_embedder = nn.Embed(
            cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
            embedding_init=param_init(("vocab", "embed"), nn.initializers.normal(1.0)))
        self.encoder = Encoder(cfg, self.token_embedder)
        self.decoder = Decoder(cfg, self.token_embedder)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                                    param_dtype=jnp.float32,
                                    kernel_init=param_init(("embed", "vocab"),
                                                           nn.initializers.normal(cfg.d_model ** -0.5)))

    def encode(self, tokens: Sequence[Array], deterministic: bool = True) -> tuple[Array, ...]:
        """Groups of [b, l] token ids (0 = padding) -> their [b, l, d_model] final-norm encoder states."""
        return self.encoder(tokens, deterministic)

    def decode(self, decoder_tokens: Sequence[Array], encoded: Sequence[Array], encoder_masks: Sequence[Array],
               deterministic: bool = True) -> tuple[Array, ...]:
        return self.decoder(decoder_tokens, encoded, encoder_masks, deterministic)

    def logits(self, hidden: Array) -> Array:
        if self.config.tie_word_embeddings:
            return self.token_embedder.attend(hidden * self.config.d_model ** -0.5)
        return self.lm_head(hidden)

    def __call__(self, tokens: Array, decoder_tokens: Array, deterministic: bool = True) -> Array:
        """Teacher-forced LM logits [b, t, vocab]; used by the generative auxiliary loss."""
        (encoded,) = self.encode((tokens,), deterministic)
        (hidden,) = self.decode((decoder_tokens,), (encoded,), (tokens != 0,), deterministic)
        return self.logits(hidden)


def abstract_params(module: nn.Module, *init_args: Array, **init_kwargs) -> dict:
    """Parameter shapes/dtypes of `module` (unboxed ShapeDtypeStructs), without allocating them."""
    variables = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *init_args, **init_kwargs))
    return nn.unbox(variables["params"])
