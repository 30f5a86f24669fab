"""The attention core, softmax(q k^T + bias) v per head, by the implementation a run names.

`T5Config.attention` / `BertConfig.attention` (gin macro `ATTENTION_IMPL`) choose it per platform:

- "xla": the models' own einsum -> softmax -> einsum (t5.Attention, bert.SelfAttention); every
  platform, and the only path that drops out attention probabilities.
- "pallas_tpu": Pallas flash attention for TPU (`jax.experimental.pallas.ops.tpu.flash_attention`):
  the [b, heads, q, k] logits never reach HBM. T5's bias (relative positions, with padding and
  causality folded in) goes in as the kernel's additive `ab`, which it differentiates (T5 learns
  its relative position bias); BERT's padding goes in as segment ids (padded keys in segment 0),
  so no [b, heads, q, k] bias is built at all. The kernel takes key lengths in multiples of 128
  (its backward pass tiles the logits in 128-lane blocks) and query lengths in multiples of 8 up
  to one block (512; beyond, of 128): both are padded up to one, and the padded keys masked (T5:
  bias `PADDED_KEY`; BERT: segment 0, as its padding). A 160-token passage runs at 160 x 256.
- "pallas_tpu_short": this project's kernel for short sequences (`short_attention`): whole rows per
  grid step, T5's bias per head shared by the batch (read once per head, its gradient summed in
  place) and padding as query and key masks, so neither the [b, heads, q, k] bias nor padding to
  128 is built; q, k and v heads-major, as the models project them for it.
- "cudnn": cuDNN's fused attention through `jax.nn.dot_product_attention(implementation="cudnn")`
  on NVIDIA GPUs, bfloat16 or float16 only; bias full-shape in the compute dtype, lengths padded
  to even (its backward pass with a bias takes even lengths only).

The fused kernels compute logits and softmax in float32 whatever the compute dtype, and have no
dropout on attention probabilities (residual, MLP and embedding dropout are unchanged). A single
query position (ST5-EncDec's one decoder step) keeps the XLA path under every implementation:
its logits are [b, heads, 1, k], nothing to fuse, and t5.Attention folds the key and value
projections into the query there, which a kernel taking k and v would undo.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from t5_retrieval.errors import ConfigError
from t5_retrieval.models.short_attention import BACKWARD_MATMULS, FORWARD_MATMULS, short_attention

Array = jax.Array
IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_tpu_short", "cudnn")
NEG_INF = -1e10  # masked attention logit; finite so fully-masked rows stay NaN-free
# A kernel's padded keys: below any masked logit, so that a row whose every key is masked (a padded
# query of T5) spreads over the real keys, as the XLA path does, and not over the padding too.
PADDED_KEY = 2 * NEG_INF
PALLAS_MULTIPLE = 128  # Pallas TPU flash attention: key lengths in multiples of its 128-lane blocks
PALLAS_QUERY_MULTIPLE = 8  # and query lengths up to PALLAS_MAX_BLOCK in multiples of 8 sublanes
PALLAS_MAX_BLOCK = 512  # a (padded) length up to this is one block; longer ones blocks of 512/256/128
CUDNN_MULTIPLE = 2  # cuDNN with a bias, in training: even lengths
# Matmuls of 2*b*h*q'*k'*d FLOPs each in the Pallas attention kernels, by the names
# `plan.hlo.tpu_kernels` gives them: flash attention's forward (q k^T, p v), its backward's dkv
# kernel (q k^T again, p^T do, do v^T, ds^T q) and dq kernel (q k^T, do v^T, ds k); the short
# kernels' forward and backward (`short_attention`).
PALLAS_KERNEL_MATMULS = {"flash_forward": 2, "flash_dkv": 4, "flash_dq": 3,
                         "short_forward": FORWARD_MATMULS, "short_backward": BACKWARD_MATMULS}


def check_implementation(implementation: str, dtype: str, owner: str) -> None:
    """Refuses an implementation this module does not know, and cuDNN with float32 compute."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"{owner}.attention: expected one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "cudnn" and dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"{owner}.attention 'cudnn': cuDNN's fused attention takes bfloat16 or float16, and "
                          f"{owner}.dtype is {dtype!r}; --gin.DTYPE=\"'bfloat16'\" computes in bfloat16")


def uses_kernel(implementation: str, query_length: int) -> bool:
    """Whether attention over `query_length` query positions runs a fused kernel (module docstring)."""
    return implementation != "xla" and query_length > 1


def padded_length(length: int, implementation: str, queries: bool = False) -> int:
    """The sequence length the implementation's kernel runs `length` key (or query) positions at."""
    multiple = {"pallas_tpu": PALLAS_MULTIPLE, "cudnn": CUDNN_MULTIPLE}.get(implementation, 1)
    if implementation == "pallas_tpu" and queries and length <= PALLAS_MAX_BLOCK:
        multiple = PALLAS_QUERY_MULTIPLE
    return math.ceil(length / multiple) * multiple


def _pad_axis(x: Array, axis: int, length: int, value: float = 0.0) -> Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value) if length != x.shape[axis] else x


def kernel_bias(bias: Array, batch: int, num_heads: int, implementation: str) -> Array:
    """An additive bias broadcastable to [batch, heads, q, k] (float32, masks folded in) as the
    implementation's kernel reads it: full [batch, heads, q', k'] at its padded lengths, padded keys
    at `PADDED_KEY`, padded query rows 0 (their outputs are dropped). Built once per stack."""
    q_len, k_len = bias.shape[-2:]
    full = jnp.broadcast_to(bias, (batch, num_heads, q_len, k_len))
    full = _pad_axis(full, 3, padded_length(k_len, implementation), PADDED_KEY)
    return _pad_axis(full, 2, padded_length(q_len, implementation, queries=True))


def pallas_block_size(length: int) -> int:
    """A block for a padded length: the whole length up to `PALLAS_MAX_BLOCK`, else the largest
    of 512, 256, 128 that divides it."""
    if length <= PALLAS_MAX_BLOCK:
        return length
    return next(b for b in (512, 256, 128) if length % b == 0)


def pallas_block_sizes(q_len: int, k_len: int):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    bq, bk = pallas_block_size(q_len), pallas_block_size(k_len)
    return fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                         block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
                         block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)


def pallas_tpu_attention(q: Array, k: Array, v: Array, bias: Array | None = None,
                         key_mask: Array | None = None) -> Array:
    """softmax(q k^T + bias) v by Pallas flash attention, unscaled (scale q first).

    q [b, tq, heads, d], k and v [b, tk, heads, d] -> [b, tq, heads, d]. `bias`: from
    `kernel_bias(..., "pallas_tpu")` ([b, heads, tq', tk'], padded keys masked), or None;
    `key_mask` [b, tk] (True: a key to attend to), or None: every key. Runs on a TPU, or on any
    backend under `jax.experimental.pallas.tpu.force_tpu_interpret_mode(True)` (the tests' way).
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    tq, tk = q.shape[1], k.shape[1]
    lq, lk = padded_length(tq, "pallas_tpu", queries=True), padded_length(tk, "pallas_tpu")

    def heads_major(x: Array, length: int) -> Array:
        return jnp.swapaxes(_pad_axis(x, 1, length), 1, 2)

    segment_ids = None
    if key_mask is not None or (bias is None and lk != tk):
        keys = jnp.ones(k.shape[:2], jnp.int32) if key_mask is None else key_mask.astype(jnp.int32)
        segment_ids = fa.SegmentIds(q=jnp.ones((q.shape[0], lq), jnp.int32), kv=_pad_axis(keys, 1, lk))
    out = fa.flash_attention(heads_major(q, lq), heads_major(k, lk), heads_major(v, lk), bias, segment_ids,
                             sm_scale=1.0, block_sizes=pallas_block_sizes(lq, lk))
    return jnp.swapaxes(out, 1, 2)[:, :tq]


def cudnn_attention(q: Array, k: Array, v: Array, bias: Array,
                    jax_implementation: Literal["cudnn", "xla"] = "cudnn") -> Array:
    """softmax(q k^T + bias) v by `jax.nn.dot_product_attention`, unscaled (scale q first).

    q [b, tq, heads, d], k and v [b, tk, heads, d] (jax's [B, T, N, H] layout) -> [b, tq, heads, d];
    `bias` from `kernel_bias(..., "cudnn")`, cast here to the compute dtype as cuDNN takes it.
    `jax_implementation` "xla" runs jax's XLA reference of the same call (a CPU checks this module's
    layout, bias and padding with it).
    """
    tq = q.shape[1]
    lq, lk = bias.shape[-2:]
    pad = lambda x, n: _pad_axis(x, 1, n)  # noqa: E731
    try:
        out = jax.nn.dot_product_attention(pad(q, lq), pad(k, lk), pad(v, lk), bias=bias.astype(q.dtype), scale=1.0,
                                           implementation=jax_implementation)
    except RuntimeError as e:
        if "cuDNN is not detected" not in str(e):
            raise
        raise ConfigError(f"attention 'cudnn': {e} (this jax has no CUDA plugin; pip install \"jax[cuda12]=="
                          f"{jax.__version__}\" on a GPU host, or run with --gin.ATTENTION_IMPL=\"'xla'\")") from None
    return out[:, :tq]


def _mesh_axes(mesh: jax.sharding.AbstractMesh, name: str, size: int) -> str | tuple[str, ...] | None:
    """The mesh axes the current logical axis rules give `name`, if they divide `size`, else None."""
    spec = nn.logical_to_mesh_axes((name,))
    axes = None if spec is None else spec[0]
    if axes is None:
        return None
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return axes if size % math.prod(mesh.shape[a] for a in names) == 0 else None


def per_shard(fn, q: Array, k: Array, v: Array, bias: Array | None, key_mask: Array | None) -> Array:
    """`fn(q, k, v, bias, key_mask)` on each device's shard of the batch and the heads.

    XLA's partitioner cannot split a Pallas kernel (a custom call): left to it, every device would
    gather whole operands. Under a mesh (`jax.set_mesh`) the kernel runs in a `shard_map` over the
    mesh axes the logical rules give 'batch' and 'heads' (as MaxText runs it); lengths and head
    dimension are whole on each device (gathered if a layout splits them)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(mesh.axis_names) - set(mesh.manual_axes):
        return fn(q, k, v, bias, key_mask)
    batch, heads = _mesh_axes(mesh, "batch", q.shape[0]), _mesh_axes(mesh, "heads", q.shape[2])
    qkv = P(batch, None, heads, None)
    specs = (qkv, qkv, qkv, None if bias is None else P(batch, heads, None, None),
             None if key_mask is None else P(batch, None))
    return jax.shard_map(fn, in_specs=specs, out_specs=qkv, check_vma=False)(q, k, v, bias, key_mask)


class SharedBias(NamedTuple):
    """A stack's attention bias as "pallas_tpu_short" takes it, built once per stack."""

    per_head: Array  # [heads or 1, q, k] float32, the same for every row (relative positions, causality)
    query_mask: Array  # [b, q] bool: real queries
    key_mask: Array  # [b, k] bool: real keys


def short_attention_per_shard(q: Array, k: Array, v: Array, bias: SharedBias) -> Array:
    """`short_attention` (heads-major q, k, v) on each device's shard of the batch and the heads, as
    `per_shard`; the bias gradient of each shard is summed over the batch's mesh axes by shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(mesh.axis_names) - set(mesh.manual_axes):
        return short_attention(q, k, v, *bias)
    batch, heads = _mesh_axes(mesh, "batch", q.shape[0]), _mesh_axes(mesh, "heads", q.shape[1])
    qkv, rows = P(batch, heads, None, None), P(batch, None)
    per_head = P(heads if bias.per_head.shape[0] > 1 else None, None, None)
    return jax.shard_map(short_attention, in_specs=(qkv, qkv, qkv, per_head, rows, rows), out_specs=qkv,
                         check_vma=False)(q, k, v, *bias)


def fused_attention(implementation: str, q: Array, k: Array, v: Array, bias: Array | None = None,
                    key_mask: Array | None = None) -> Array:
    """The implementation's kernel (`pallas_tpu_attention` per shard, `cudnn_attention`, which jax
    partitions itself); `bias` from `kernel_bias`, or None with `key_mask` (Pallas only: padding as
    segment ids)."""
    if implementation == "pallas_tpu":
        return per_shard(pallas_tpu_attention, q, k, v, bias, key_mask)
    if implementation == "cudnn":
        if bias is None:
            raise ValueError("cudnn_attention takes padding as a bias (kernel_bias), not a key mask")
        return cudnn_attention(q, k, v, bias)
    raise ValueError(f"no fused kernel for attention implementation {implementation!r}")


def flash_cost(batch: int, num_heads: int, q_len: int, k_len: int, head_dim: int, dtype_bytes: int,
               with_bias: bool, backward: bool = False) -> dict[str, float]:
    """FLOPs and HBM bytes of one Pallas flash attention call at its padded lengths, for where a cost
    model prices the kernel as nothing; one matmul is 2*b*h*q'*k'*d FLOPs.

    Forward: q k^T and p v (2 matmuls); reads q, k, v (and the float32 bias), writes the output.
    Backward: its dk/dv kernel recomputes q k^T and takes p^T do, do v^T, ds^T q; its dq kernel
    recomputes q k^T and do v^T and takes ds k (7 matmuls); each kernel reads q, do, k, v (and the
    bias), and they write dq, dk, dv (and the bias gradient). Softmax statistics (b*h*q' floats
    each) are left out."""
    lq, lk = padded_length(q_len, "pallas_tpu", queries=True), padded_length(k_len, "pallas_tpu")
    matmul = 2 * batch * num_heads * lq * lk * head_dim
    qo = batch * num_heads * lq * head_dim * dtype_bytes
    kv = batch * num_heads * lk * head_dim * dtype_bytes
    bias = batch * num_heads * lq * lk * 4 if with_bias else 0
    if not backward:
        return {"flops": PALLAS_KERNEL_MATMULS["flash_forward"] * matmul, "bytes": float(2 * qo + 2 * kv + bias)}
    backward_matmuls = PALLAS_KERNEL_MATMULS["flash_dkv"] + PALLAS_KERNEL_MATMULS["flash_dq"]
    return {"flops": backward_matmuls * float(matmul),
            "bytes": float(2 * (2 * qo + 2 * kv + bias) + qo + 2 * kv + bias)}
