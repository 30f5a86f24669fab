"""Uncertainty weighting: Kendall et al., "Multi-Task Learning Using Uncertainty to Weigh Losses
for Scene Geometry and Semantics", CVPR 2018, in the form GDMTL uses (Liu et al., 2021)::

    total = sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2)

The log(1 + sigma^2) regulariser (instead of Kendall's log sigma) keeps the total bounded below.
The transform returns d total / d theta = sum_k g_k / (2 sigma_k^2) with this step's sigma, then
takes one plain SGD step on sigma with the analytic
d total / d sigma_k = -L_k / sigma_k^3 + 2 sigma_k / (1 + sigma_k^2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import gin
import jax
import jax.numpy as jnp
import optax

from t5_retrieval.multitask.state import MultitaskProblem, hyperparameter_arrays
from t5_retrieval.multitask.task_axis import (
    num_tasks as task_count,
)
from t5_retrieval.multitask.task_axis import (
    task_losses as checked_losses,
)
from t5_retrieval.multitask.task_axis import (
    weighted_sum,
)


class UncertaintyState(NamedTuple):
    sigma: jax.Array  # f32 [K], learned per-task sigma
    hyperparams: dict[str, jax.Array]  # scalars: init_sigma, learning_rate

    def metrics(self) -> dict[str, jax.Array]:
        """``uncertainty/sigma/{k}``: each task's (objective's) sigma_k."""
        return {f"uncertainty/sigma/{k}": self.sigma[k] for k in range(self.sigma.shape[0])}

    def statistics(self) -> dict[str, jax.Array]:
        return {}

    def exported(self) -> None:
        return None

    def reset(self) -> UncertaintyState:
        """Every sigma_k back at init_sigma."""
        return self._replace(sigma=jnp.full_like(self.sigma, self.hyperparams["init_sigma"]))

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """None: every state of this transform is the method as defined."""
        return []


def uncertainty_total_loss(losses: jax.Array, sigma: jax.Array) -> jax.Array:
    """sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2)."""
    return jnp.sum(losses / (2.0 * sigma**2) + jnp.log1p(sigma**2))


@gin.register(module="multitask")
def uncertainty_weighting(num_tasks: int, total_steps: int, learning_rate: float = 0.01, init_sigma: float = 1.0
                          ) -> optax.GradientTransformationExtraArgs:
    """Uncertainty weighting (Kendall et al., CVPR 2018; GDMTL form): sum_k g_k / (2 sigma_k^2).

    ``update(per_task_grads, state, task_losses=[K])`` returns the gradient of
    total = sum_k L_k / (2 sigma_k^2) + log(1 + sigma_k^2), i.e. sum_k g_k / (2 sigma_k^2), and
    takes one SGD step on sigma with d total / d sigma_k = -L_k / sigma_k^3 + 2 sigma_k / (1 + sigma_k^2).

    Args:
      num_tasks: K (GDMTL: 2, retrieval and query generation).
      total_steps: the run's length, which uncertainty weighting does not depend on.
      learning_rate: SGD step size on sigma.
      init_sigma: every sigma_k's starting value.
    """
    del total_steps

    def recorded() -> dict[str, jax.Array]:
        return hyperparameter_arrays(init_sigma=float(init_sigma), learning_rate=float(learning_rate))

    def init_fn(params: Any) -> UncertaintyState:
        del params
        return UncertaintyState(sigma=jnp.full([num_tasks], init_sigma, jnp.float32), hyperparams=recorded())

    def update_fn(updates: Any, state: UncertaintyState, params: Any = None, *, task_losses: Any = None,
                  **extra_args: Any) -> tuple[Any, UncertaintyState]:
        del params, extra_args
        losses = checked_losses(task_losses, task_count(updates), "uncertainty_weighting")
        sigma = state.sigma
        d_sigma = -losses / sigma**3 + 2.0 * sigma / (1.0 + sigma**2)
        new_state = UncertaintyState(sigma=sigma - learning_rate * d_sigma, hyperparams=recorded())
        return weighted_sum(1.0 / (2.0 * sigma**2), updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
