"""PCGrad: Yu et al., "Gradient Surgery for Multi-Task Learning", NeurIPS 2020.

For each task gradient g_i, visit the other tasks j in a random order; when they conflict,
project g_i onto the normal plane of g_j, then sum::

    g_i^PC = g_i
    for j in shuffle(tasks), j != i:
        if <g_i^PC, g_j> < 0:  g_i^PC -= <g_i^PC, g_j> / ||g_j||^2 * g_j
    return sum_i g_i^PC

Computed in coefficient space from the K x K Gram matrix (one pass over the parameters), not by
K^2 passes over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import gin
import jax
import jax.numpy as jnp
import optax

from t5_retrieval.multitask.state import MultitaskProblem, hyperparameter_arrays
from t5_retrieval.multitask.task_axis import gram, weighted_sum
from t5_retrieval.multitask.task_axis import num_tasks as task_count


class PCGradState(NamedTuple):
    key: jax.Array  # PRNG key for the random task order
    hyperparams: dict[str, jax.Array]  # scalars: seed

    def metrics(self) -> dict[str, jax.Array]:
        return {}

    def statistics(self) -> dict[str, jax.Array]:
        return {}

    def exported(self) -> None:
        return None

    def reset(self) -> PCGradState:
        """The key drawn from the seed again."""
        return self._replace(key=jax.random.PRNGKey(self.hyperparams["seed"]))

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """None: every state of this transform is the method as defined."""
        return []


def pcgrad_coefficients(gram_matrix: jax.Array, orders: jax.Array) -> jax.Array:
    """PCGrad in coefficient space: returns C with g_i^PC = sum_m C[i, m] g_m.

    For each task i, visit the other tasks j in ``orders[i]``; if <g_i^PC, g_j> < 0, set
    g_i^PC -= <g_i^PC, g_j> / ||g_j||^2 * g_j. All inner products follow from the Gram matrix,
    so the projection costs O(K^3) scalars instead of K^2 passes over the parameters.
    """
    k = gram_matrix.shape[0]
    coeffs = jnp.eye(k, dtype=gram_matrix.dtype)
    for i in range(k):
        def project(pos, row, i=i):
            j = orders[i, pos]
            dot = row @ gram_matrix[:, j]
            coef = jnp.where((dot < 0) & (j != i), dot / jnp.maximum(gram_matrix[j, j], 1e-30), 0.0)
            return row.at[j].add(-coef)
        coeffs = coeffs.at[i].set(jax.lax.fori_loop(0, k, project, coeffs[i]))
    return coeffs


@gin.register(module="multitask")
def pcgrad(num_tasks: int, total_steps: int, seed: int = 0) -> optax.GradientTransformation:
    """PCGrad (Yu et al., NeurIPS 2020): project away conflicting components, then sum.

    ``update(per_task_grads, state)`` with task gradients g (leaves [K, ...]): for each task i, in
    a random order over the other tasks j, when <g_i^PC, g_j> < 0,
    g_i^PC <- g_i^PC - <g_i^PC, g_j> / ||g_j||^2 g_j; returns sum_i g_i^PC.

    Args:
      num_tasks: K, checked against the gradients' task axis.
      total_steps: the run's length, which PCGrad does not depend on.
      seed: seeds the PRNG key in the state from which each step draws every task's random order.
    """
    del total_steps

    def init_fn(params: Any) -> PCGradState:
        del params
        return PCGradState(key=jax.random.PRNGKey(seed), hyperparams=hyperparameter_arrays(seed=seed))

    def update_fn(updates: Any, state: PCGradState, params: Any = None) -> tuple[Any, PCGradState]:
        del params
        k = task_count(updates)
        if k != num_tasks:
            raise ValueError(f"pcgrad was built for {num_tasks} tasks, got gradients with K={k}")
        key, sub = jax.random.split(state.key)
        orders = jax.vmap(lambda kk: jax.random.permutation(kk, k))(jax.random.split(sub, k))
        coeffs = pcgrad_coefficients(gram(updates), orders)
        return weighted_sum(jnp.sum(coeffs, axis=0), updates), PCGradState(
            key=key, hyperparams=hyperparameter_arrays(seed=seed))

    return optax.GradientTransformation(init_fn, update_fn)
