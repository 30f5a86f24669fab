"""One training step over a multi-task batch: per-task losses, per-task gradients, one update.

A batch holds one sub-batch per task (dict keyed by task name). Each task's loss is the in-batch
softmax loss over that task's *global* sub-batch. Tasks are processed one after another, chained by
`optimization_barrier`, so that only one task's activations are alive at a time: the next task's
forward pass cannot start before the previous task's gradient exists.

With a multi-task optimiser (TACO, PCGrad, ...) the K gradients are stacked on a leading task axis
and handed to the optimiser; without one, they are summed as they come (the naive multi-task sum,
with memory for one gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from t5_retrieval.losses import in_batch_softmax_loss

Batch = dict[str, dict[str, jax.Array]]
Params = Any


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array


def task_loss_fn(model: nn.Module, logit_scale: float) -> Callable:
    """(params, task_batch, rng) -> (loss, metrics) for one task's sub-batch."""

    def loss_fn(params: Params, task_batch: dict[str, jax.Array], rng: jax.Array):
        query_rng, passage_rng = jax.random.split(rng)
        queries = model.apply({"params": params}, task_batch["query_tokens"], deterministic=False,
                              rngs={"dropout": query_rng})
        passages = model.apply({"params": params}, task_batch["passage_tokens"], deterministic=False,
                               rngs={"dropout": passage_rng})
        return in_batch_softmax_loss(queries, passages, logit_scale)

    return loss_fn


def per_task_gradients(loss_fn: Callable, params: Params, batch: Batch, task_names: Sequence[str],
                       rng: jax.Array, stack: bool) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """Gradients of each task's loss, one task's activations alive at a time.

    Returns (gradients, losses[K], metrics): gradients stacked on a leading task axis when `stack`,
    else summed over tasks.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    rngs = jax.random.split(rng, len(task_names))
    grads, losses, metrics = [], [], {}
    task_params = params
    for k, name in enumerate(task_names):
        (loss, aux), grad = grad_fn(task_params, batch[name], rngs[k])
        # The next task reads params only after this task's gradient is complete.
        grad, task_params = jax.lax.optimization_barrier((grad, params))
        if stack or not grads:
            grads.append(grad)
        else:
            grads[0] = jax.tree.map(jnp.add, grads[0], grad)
        losses.append(loss)
        metrics[f"loss/{name}"] = loss
        metrics.update({f"{key}/{name}": value for key, value in aux.items()})
    combined = jax.tree.map(lambda *g: jnp.stack(g), *grads) if stack else grads[0]
    return combined, jnp.stack(losses), metrics


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformationExtraArgs,
                    task_names: Sequence[str], per_task: bool, logit_scale: float = 1.0,
                    extra_metrics: Callable[[optax.OptState], dict[str, jax.Array]] | None = None) -> Callable:
    """Returns train_step(state, batch) -> (state, metrics), to be jitted with shardings by the caller."""
    loss_fn = task_loss_fn(model, logit_scale)
    task_names = tuple(task_names)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        rng, step_rng = jax.random.split(state.rng)
        grads, losses, metrics = per_task_gradients(loss_fn, state.params, batch, task_names, step_rng,
                                                    stack=per_task)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, task_losses=losses)
        params = optax.apply_updates(state.params, updates)
        metrics["loss"] = jnp.sum(losses)
        metrics["update_norm"] = optax.tree.norm(updates)
        if extra_metrics is not None:
            metrics.update(extra_metrics(opt_state))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng), metrics

    return train_step
