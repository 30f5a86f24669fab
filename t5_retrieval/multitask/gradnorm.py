"""GradNorm: Chen et al., "GradNorm: Gradient Normalization for Adaptive Loss Balancing in Deep
Multitask Networks", ICML 2018.

Learned loss weights w_k that equalise the tasks' weighted gradient norms. Per step::

    return sum_k w_k g_k                                  (the weights before this step's update)
    G_k   = w_k ||g_k||;  r_k = (L_k / L_k(0)) / mean_j (L_j / L_j(0))
    L_grad = sum_k |G_k - mean(G) * r_k^alpha|            (the target held constant)
    w     <- w - lr * dL_grad/dw;  w <- K * w / sum(w)

L_k(0) are the losses of the first update.

Where this implementation departs from the paper, exactly:

- ||g_k|| is the norm of task k's gradient over *all* parameters in the per-task gradient tree,
  not over the last shared layer's weights the paper uses to save compute (the per-task
  gradients are computed in full anyway, so the whole-model norm costs one Gram matrix).
- Before renormalising to sum K, each weight is floored at 1e-6, so no weight reaches 0 or
  goes negative.
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

WEIGHT_FLOOR = 1e-6


class GradNormState(NamedTuple):
    weights: jax.Array  # f32 [K], sum K
    initial_losses: jax.Array  # f32 [K], L_k(0)
    step: jax.Array  # int32 []
    hyperparams: dict[str, jax.Array]  # scalars: alpha, learning_rate

    def metrics(self) -> dict[str, jax.Array]:
        """``gradnorm/weight/{k}``: each task's loss weight w_k."""
        return {f"gradnorm/weight/{k}": self.weights[k] for k in range(self.weights.shape[0])}

    def statistics(self) -> dict[str, jax.Array]:
        return {}

    def exported(self) -> None:
        return None

    def reset(self) -> GradNormState:
        """Weights 1 and step 0, so the next update's losses become L_k(0)."""
        return self._replace(weights=jnp.ones_like(self.weights), initial_losses=jnp.ones_like(self.initial_losses),
                             step=jnp.zeros_like(self.step))

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """None: every state of this transform is the method as defined."""
        return []


def gradnorm_weight_gradient(weights: jax.Array, grad_norms: jax.Array, losses: jax.Array,
                             initial_losses: jax.Array, alpha: float) -> jax.Array:
    """d/dw of sum_k |G_k - mean(G) r_k^alpha| with the target held constant (the paper's rule).

    G_k = w_k ||g_k||; r_k = (L_k / L_k(0)) / mean_j(L_j / L_j(0)).
    """
    g = weights * grad_norms
    ratio = losses / initial_losses
    target = jax.lax.stop_gradient(jnp.mean(g) * (ratio / jnp.mean(ratio)) ** alpha)
    return jnp.sign(g - target) * grad_norms


@gin.register(module="multitask")
def gradnorm(num_tasks: int, total_steps: int, learning_rate: float = 0.025, alpha: float = 1.5
             ) -> optax.GradientTransformationExtraArgs:
    """GradNorm (Chen et al., ICML 2018): sum_k w_k g_k with weights that balance gradient norms.

    ``update(per_task_grads, state, task_losses=[K])`` returns sum_k w_k g_k, then takes one SGD
    step on L_grad = sum_k |G_k - mean(G) r_k^alpha| (target held constant) with G_k = w_k ||g_k||
    and r_k = (L_k / L_k(0)) / mean_j (L_j / L_j(0)), and renormalises w to sum K. L_k(0) are the
    losses of the first update. Where this departs from the paper: the module docstring.

    Args:
      num_tasks: K; the weights start at 1 and are renormalised to sum K.
      total_steps: the run's length, which GradNorm does not depend on.
      learning_rate: SGD step size on L_grad.
      alpha: the paper's asymmetry: how strongly tasks that train slower are pulled up.
    """
    del total_steps

    def recorded() -> dict[str, jax.Array]:
        return hyperparameter_arrays(alpha=float(alpha), learning_rate=float(learning_rate))

    def init_fn(params: Any) -> GradNormState:
        del params
        return GradNormState(weights=jnp.ones([num_tasks], jnp.float32),
                             initial_losses=jnp.ones([num_tasks], jnp.float32),
                             step=jnp.zeros([], jnp.int32), hyperparams=recorded())

    def update_fn(updates: Any, state: GradNormState, params: Any = None, *, task_losses: Any = None,
                  **extra_args: Any) -> tuple[Any, GradNormState]:
        del params, extra_args
        k = task_count(updates)
        losses = checked_losses(task_losses, k, "gradnorm")
        initial = jnp.where(state.step == 0, losses, state.initial_losses)
        grad_norms = jnp.sqrt(jnp.diag(gram(updates)))
        step = gradnorm_weight_gradient(state.weights, grad_norms, losses, initial, alpha)
        weights = jnp.maximum(state.weights - learning_rate * step, WEIGHT_FLOOR)
        weights = k * weights / jnp.sum(weights)
        new_state = GradNormState(weights=weights, initial_losses=initial, step=state.step + 1, hyperparams=recorded())
        return weighted_sum(state.weights, updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
