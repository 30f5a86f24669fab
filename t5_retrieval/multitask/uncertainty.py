"""Uncertainty weighting: Kendall et al., "Multi-Task Learning Using Uncertainty to Weigh Losses
for Scene Geometry and Semantics", CVPR 2018, in the form GDMTL uses (Liu et al., 2021)::

    total = sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2)

The log(1 + sigma^2) regulariser (instead of Kendall's log sigma) keeps the total bounded below.
The transform returns d total / d theta = sum_k g_k / (2 sigma_k^2) with this step's sigma, then
takes one plain SGD step on sigma with the analytic
d total / d sigma_k = -L_k / sigma_k^3 + 2 sigma_k / (1 + sigma_k^2).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from t5_retrieval.multitask.task_axis import (
    num_tasks as task_count, task_losses as checked_losses, weighted_sum,
)


class UncertaintyState(NamedTuple):
    sigma: jax.Array  # f32 [K], learned per-task sigma


def uncertainty_total_loss(losses: jax.Array, sigma: jax.Array) -> jax.Array:
    """sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2)."""
    return jnp.sum(losses / (2.0 * sigma**2) + jnp.log1p(sigma**2))


def uncertainty_weighting(num_tasks: int, learning_rate: float = 0.01, init_sigma: float = 1.0
                          ) -> optax.GradientTransformationExtraArgs:
    """Uncertainty weighting (Kendall et al., CVPR 2018; GDMTL form): sum_k g_k / (2 sigma_k^2).

    ``update(per_task_grads, state, task_losses=[K])`` returns the gradient of
    total = sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2), i.e. sum_k g_k / (2 sigma_k^2), and
    takes one SGD step on sigma with d total / d sigma_k = -L_k / sigma_k^3 + 2 sigma_k / (1 + sigma_k^2).

    Args:
      num_tasks: K (GDMTL: 2, retrieval and query generation).
      learning_rate: SGD step size on sigma.
      init_sigma: every sigma_k's starting value.
    """

    def init_fn(params: Any) -> UncertaintyState:
        del params
        return UncertaintyState(sigma=jnp.full([num_tasks], init_sigma, jnp.float32))

    def update_fn(updates: Any, state: UncertaintyState, params: Any = None, *, task_losses: Any = None,
                  **extra_args: Any) -> tuple[Any, UncertaintyState]:
        del params, extra_args
        losses = checked_losses(task_losses, task_count(updates), "uncertainty_weighting")
        sigma = state.sigma
        d_sigma = -losses / sigma**3 + 2.0 * sigma / (1.0 + sigma**2)
        new_state = UncertaintyState(sigma=sigma - learning_rate * d_sigma)
        return weighted_sum(1.0 / (2.0 * sigma**2), updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
