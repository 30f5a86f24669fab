"""Arithmetic over the leading task axis K of per-task gradient pytrees.

Per-task gradients are a pytree shaped like the params whose leaves carry a leading axis K. The
sums and maxima over K are unrolled into K-1 elementwise ops: XLA:CPU reduces a leading axis ~100x
slower (measured 4.4 s vs 0.05 s for [6, 6M] float32).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def num_tasks(task_grads: Any) -> int:
    """K, checked to be the leading axis of every leaf."""
    leaves = jax.tree_util.tree_leaves(task_grads)
    if not leaves:
        raise ValueError("per-task gradients are an empty pytree")
    k = leaves[0].shape[0] if leaves[0].ndim else 0
    for leaf in leaves:
        if leaf.ndim == 0 or leaf.shape[0] != k:
            raise ValueError(
                "per-task gradients must have the same leading task axis K on every leaf; got "
                f"shapes {[tuple(x.shape) for x in leaves]}")
    return k


def sum_tasks(x: jax.Array) -> jax.Array:
    """sum over the leading task axis, as K-1 elementwise adds."""
    return functools.reduce(jnp.add, [x[i] for i in range(x.shape[0])])


def softmax_tasks(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(softmax, log softmax) over the leading task axis, with the same unrolled reductions.

    Only log-sum-exp is a [P] intermediate; the weights exp(z - lse) are whole-array
    expressions that XLA fuses into each consumer, so no consumer recomputes all K exps per
    weight (which a per-task list of weights would make it do).
    """
    m = functools.reduce(jnp.maximum, [z[i] for i in range(z.shape[0])])
    lse = m + jnp.log(functools.reduce(jnp.add, [jnp.exp(z[i] - m) for i in range(z.shape[0])]))
    log_w = z - lse[None]
    return jnp.exp(log_w), log_w


def weighted_sum(weights: jax.Array, task_grads: Any) -> Any:
    """sum_k weights[k] * g_k, for a weight vector of shape [K]."""
    return jax.tree_util.tree_map(
        lambda g: sum_tasks(weights.astype(g.dtype).reshape((-1,) + (1,) * (g.ndim - 1)) * g),
        task_grads)


def gram(task_grads: Any) -> jax.Array:
    """[K, K] matrix of inner products <g_i, g_j> over all parameters, in float32."""
    def leaf_gram(g):  # contracted in the leaf's own shape: a sharded leaf is not gathered to flatten it
        g = g.astype(jnp.float32)
        rest = tuple(range(1, g.ndim))
        return jnp.tensordot(g, g, axes=(rest, rest))
    return sum(leaf_gram(g) for g in jax.tree_util.tree_leaves(task_grads))


def task_losses(losses: Any, k: int, name: str) -> jax.Array:
    """The per-task losses a loss-aware transform was given, as float32 [K]."""
    if losses is None:
        raise ValueError(f"{name} needs the per-task losses: call update(..., task_losses=[K])")
    losses = jnp.asarray(losses, jnp.float32)
    if losses.shape != (k,):
        raise ValueError(f"{name}: task_losses must have shape ({k},), got {losses.shape}")
    return losses
