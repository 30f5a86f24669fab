"""Attention over short sequences as one Pallas TPU kernel per pass, each row's logits kept on chip.

softmax(q k^T + bias + mask) v per head, for sequences short enough that a row's whole
[q, k] logits fit in the TPU core's vector memory (T5-base's 160-token passages: 100 KiB in float32).
Two things set it apart from jax's Pallas flash attention (`attention.pallas_tpu_attention`):

- **The bias is per head, shared by the batch** ([heads or 1, q, k]: T5's relative positions, with a
  decoder's causal mask folded in), and padding comes as boolean masks of queries and keys. Flash
  attention reads a full [b, heads, q, k] float32 bias and writes its gradient at that size; here the
  kernel's grid walks the batch innermost, so each head's bias block is read once and its gradient
  is summed over the batch in place.
- **No tiling of the sequence**: a grid step holds whole rows, so neither length is padded to 128
  (flash attention runs a 160-token passage at 160 x 256) and no softmax statistics are stored; the
  backward pass recomputes the probabilities from q, k and the bias in a single kernel.

q, k and v are heads-major ([b, heads, length, d]), so a model projects straight into that layout.
The forward kernel does 2 matmuls of 2*q*k*d FLOPs per row and head, the backward 5 (q k^T again,
p^T do, do v^T, ds k, ds^T q), and each carries that cost estimate for the TPU compiler's cost model.
Logits and softmax are float32 whatever the inputs' dtype; there is no dropout on the probabilities.
Runs on a TPU, or anywhere under `jax.experimental.pallas.tpu.force_tpu_interpret_mode(True)`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from t5_retrieval.errors import ConfigError

Array = jax.Array
NEG_INF = -1e10  # the models' masked logit (attention.NEG_INF): a row with no real key spreads evenly
MAX_LENGTH = 1024  # a row's float32 logits, probabilities and their gradients: 4 x 4 MiB at 1024 x 1024
FORWARD_MATMULS, BACKWARD_MATMULS = 2, 5
BATCH_BLOCKS = (8, 4, 2, 1)  # rows per grid step: the largest that divides the batch


def _batch_block(batch: int) -> int:
    return next(b for b in BATCH_BLOCKS if batch % b == 0)


def _probabilities(q: Array, k: Array, bias: Array, real: Array) -> Array:
    """softmax over keys of q k^T + bias, the logits of a padded query or key (not `real`) at
    NEG_INF, in float32."""
    logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) + bias
    logits = jnp.where(real, logits, NEG_INF)
    p = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, query_ref, key_ref, out_ref):
    bias = bias_ref[...]
    for row in range(q_ref.shape[0]):  # unrolled: BATCH_BLOCKS rows at most
        p = _probabilities(q_ref[row], k_ref[row], bias, (query_ref[row] > 0) & (key_ref[row] > 0))
        out = jnp.dot(p.astype(v_ref.dtype), v_ref[row], preferred_element_type=jnp.float32)
        out_ref[row] = out.astype(out_ref.dtype)


def _backward_kernel(q_ref, k_ref, v_ref, bias_ref, query_ref, key_ref, dout_ref,
                     dq_ref, dk_ref, dv_ref, dbias_ref, *, first_step):
    @pl.when(first_step())
    def _():
        dbias_ref[...] = jnp.zeros_like(dbias_ref)

    bias = bias_ref[...]
    dbias = jnp.zeros(bias.shape, jnp.float32)
    transposed = (((0,), (0,)), ((), ()))  # a^T b
    for row in range(q_ref.shape[0]):
        q, k, v, dout = q_ref[row], k_ref[row], v_ref[row], dout_ref[row]
        real = (query_ref[row] > 0) & (key_ref[row] > 0)
        p = _probabilities(q, k, bias, real)
        dv = jax.lax.dot_general(p.astype(dout.dtype), dout, transposed, preferred_element_type=jnp.float32)
        dp = jax.lax.dot_general(dout, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        # the softmax's gradient, d logits; a masked logit is a constant, so it passes none on
        ds = jnp.where(real, p * (dp - (dp * p).sum(axis=-1, keepdims=True)), 0.0)
        dq = jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
        dk = jax.lax.dot_general(ds.astype(q.dtype), q, transposed, preferred_element_type=jnp.float32)
        dq_ref[row], dk_ref[row], dv_ref[row] = dq.astype(dq_ref.dtype), dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)
        dbias = dbias + ds
    dbias_ref[...] += dbias


def _specs(q: Array, k: Array, bias: Array) -> tuple[pl.BlockSpec, ...]:
    """Block specs over the grid (heads, batch / rows per step): rows of one head, the head's bias
    (the same block while the batch advances), and the rows' masks as [b, q, 1] and [b, 1, k]."""
    rows = _batch_block(q.shape[0])
    shared_heads = bias.shape[0] == 1
    return (pl.BlockSpec((rows, None, q.shape[2], q.shape[3]), lambda h, b: (b, h, 0, 0)),
            pl.BlockSpec((rows, None, k.shape[2], k.shape[3]), lambda h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, q.shape[2], k.shape[2]), lambda h, b: (0 if shared_heads else h, 0, 0)),
            pl.BlockSpec((rows, q.shape[2], 1), lambda h, b: (b, 0, 0)),
            pl.BlockSpec((rows, 1, k.shape[2]), lambda h, b: (b, 0, 0)))


def _grid(q: Array) -> tuple[int, int]:
    return q.shape[1], q.shape[0] // _batch_block(q.shape[0])


def _cost(q: Array, k: Array, bias: Array, matmuls: int, arrays_of_q: int, arrays_of_k: int,
          bias_copies: int) -> pl.CostEstimate:
    b, h, tq, d = q.shape
    tk = k.shape[2]
    itemsize = q.dtype.itemsize
    size = (arrays_of_q * b * h * tq * d + arrays_of_k * b * h * tk * d) * itemsize
    masks = h * b * (tq + tk) * 4  # int32, read again for every head
    return pl.CostEstimate(flops=matmuls * 2 * b * h * tq * tk * d, transcendentals=b * h * tq * tk,
                           bytes_accessed=size + bias_copies * bias.size * 4 + masks)


def _forward(q, k, v, bias, query_real, key_real):
    q_spec, k_spec, bias_spec, query_spec, key_spec = _specs(q, k, bias)
    return pl.pallas_call(
        _forward_kernel, grid=_grid(q), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        in_specs=[q_spec, k_spec, k_spec, bias_spec, query_spec, key_spec], out_specs=q_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=_cost(q, k, bias, FORWARD_MATMULS, 2, 2, 1), name="short_attention_forward",
    )(q, k, v, bias, query_real, key_real)


def _backward(q, k, v, bias, query_real, key_real, dout):
    q_spec, k_spec, bias_spec, query_spec, key_spec = _specs(q, k, bias)
    # Each head's bias gradient sums over the batch (the inner grid axis); a bias shared by the heads
    # sums over both axes, so then neither may be split between cores.
    if bias.shape[0] == 1:
        params = pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"))
        first = lambda: (pl.program_id(0) == 0) & (pl.program_id(1) == 0)  # noqa: E731
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
        first = lambda: pl.program_id(1) == 0  # noqa: E731
    return pl.pallas_call(
        functools.partial(_backward_kernel, first_step=first), grid=_grid(q),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                   jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(bias.shape, jnp.float32)],
        in_specs=[q_spec, k_spec, k_spec, bias_spec, query_spec, key_spec, q_spec],
        out_specs=[q_spec, k_spec, k_spec, bias_spec],
        compiler_params=params,
        cost_estimate=_cost(q, k, bias, BACKWARD_MATMULS, 3, 4, 2), name="short_attention_backward",
    )(q, k, v, bias, query_real, key_real, dout)


@jax.custom_vjp
def _attention(q, k, v, bias, query_real, key_real):
    return _forward(q, k, v, bias, query_real, key_real)


def _attention_forward(q, k, v, bias, query_real, key_real):
    return _forward(q, k, v, bias, query_real, key_real), (q, k, v, bias, query_real, key_real)


def _attention_backward(residuals, dout):
    q, k, v, bias, query_real, key_real = residuals
    dq, dk, dv, dbias = _backward(q, k, v, bias, query_real, key_real, dout)
    return dq, dk, dv, dbias, None, None


_attention.defvjp(_attention_forward, _attention_backward)


def short_attention(q: Array, k: Array, v: Array, bias: Array, query_mask: Array, key_mask: Array) -> Array:
    """softmax(q k^T + bias) v, unscaled, over the real keys of each row.

    q [b, heads, tq, d], k and v [b, heads, tk, d] -> [b, heads, tq, d]; `bias` [heads or 1, tq, tk]
    (float32, shared by the batch; differentiated); `query_mask` [b, tq] and `key_mask` [b, tk]
    (True: real). A padded query's logits are all NEG_INF, so it spreads evenly over every key, as
    the models' XLA path does (its output is padding, never read)."""
    if max(q.shape[2], k.shape[2]) > MAX_LENGTH:
        raise ConfigError(f"attention 'pallas_tpu_short': sequences of at most {MAX_LENGTH} positions (a row's "
                          f"logits stay on chip), got {q.shape[2]} x {k.shape[2]}; use --gin.ATTENTION_IMPL=\"'pallas_tpu'\"")
    query_real = query_mask.astype(jnp.int32)[:, :, None]
    key_real = key_mask.astype(jnp.int32)[:, None, :]
    return _attention(q, k, v, bias.astype(jnp.float32), query_real, key_real)
