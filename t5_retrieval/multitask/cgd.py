"""CGD: Piratla et al., "Focus on the Common Good: Group Distributional Robustness Follows", ICLR 2022.

Common Gradient Descent up-weights tasks whose gradient helps the other tasks. Per step, a
multiplicative-weights step on the task weights alpha (the simplex), then the weighted gradient::

    A_ij     = cos(g_i, g_j) * sqrt(L_i * L_j)          (gradient agreement, loss-scaled)
    alpha_i <- alpha_i * exp(lr * mean_j A_ij);  alpha <- alpha / sum(alpha)
    return sum_i alpha_i g_i

What this implementation does beyond that, exactly:

- Parameter set: the inner products run over every parameter in the per-task gradient tree, i.e.
  all trainable parameters (shared and task-specific alike), not a chosen subset of them.
- The cosine's denominator ||g_i|| ||g_j|| is clamped below at 1e-12, so a task with a zero
  gradient gets cosine 0 with everything instead of NaN.
- After normalising, each weight is floored at ``min_weight`` (no renormalisation after the floor,
  so the weights may sum to slightly more than 1); no task's weight can reach 0 and stay there.
- The returned gradient uses the weights *after* this step's update.
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
    gram,
    weighted_sum,
)
from t5_retrieval.multitask.task_axis import (
    num_tasks as task_count,
)
from t5_retrieval.multitask.task_axis import (
    task_losses as checked_losses,
)


class CGDState(NamedTuple):
    weights: jax.Array  # f32 [K], on the simplex (up to the min_weight floor)
    hyperparams: dict[str, jax.Array]  # scalars: learning_rate, min_weight

    def metrics(self) -> dict[str, jax.Array]:
        """``cgd/weight/{k}``: each task's weight alpha_k."""
        return {f"cgd/weight/{k}": self.weights[k] for k in range(self.weights.shape[0])}

    def statistics(self) -> dict[str, jax.Array]:
        return {}

    def exported(self) -> None:
        return None

    def reset(self) -> CGDState:
        """Uniform weights again."""
        return self._replace(weights=jnp.full_like(self.weights, 1.0 / self.weights.shape[0]))

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """None: every state of this transform is the method as defined."""
        return []


@gin.register(module="multitask")
def cgd(num_tasks: int, total_steps: int, learning_rate: float = 0.1, min_weight: float = 1e-5
        ) -> optax.GradientTransformationExtraArgs:
    """Common Gradient Descent (Piratla et al., ICLR 2022): sum_i alpha_i g_i with learned alpha.

    ``update(per_task_grads, state, task_losses=[K])``::

        A_ij     = cos(g_i, g_j) * sqrt(L_i * L_j)
        alpha_i <- max(alpha_i exp(lr mean_j A_ij) / sum_m alpha_m exp(lr mean_j A_mj), min_weight)
        return sum_i alpha_i g_i

    Where this departs from the paper: the module docstring.

    Args:
      num_tasks: K; the weights start uniform at 1/K.
      total_steps: the run's length, which CGD does not depend on.
      learning_rate: step size of the multiplicative-weights update.
      min_weight: floor of every weight after normalising.
    """
    del total_steps

    def recorded() -> dict[str, jax.Array]:
        return hyperparameter_arrays(learning_rate=float(learning_rate), min_weight=float(min_weight))

    def init_fn(params: Any) -> CGDState:
        del params
        return CGDState(weights=jnp.full([num_tasks], 1.0 / num_tasks, jnp.float32), hyperparams=recorded())

    def update_fn(updates: Any, state: CGDState, params: Any = None, *, task_losses: Any = None,
                  **extra_args: Any) -> tuple[Any, CGDState]:
        del params, extra_args
        losses = checked_losses(task_losses, task_count(updates), "cgd")
        gram_matrix = gram(updates)
        norms = jnp.sqrt(jnp.diag(gram_matrix))
        cosine = gram_matrix / jnp.maximum(norms[:, None] * norms[None, :], 1e-12)
        agreement = cosine * jnp.sqrt(jnp.outer(losses, losses))
        logits = jnp.log(state.weights) + learning_rate * jnp.mean(agreement, axis=1)
        weights = jnp.maximum(jax.nn.softmax(logits), min_weight)
        return weighted_sum(weights, updates), CGDState(weights=weights, hyperparams=recorded())

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
