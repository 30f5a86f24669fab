"""The naive multi-task gradient: the plain sum over tasks."""

from __future__ import annotations

from typing import Any

import gin
import jax
import optax

from t5_retrieval.multitask.task_axis import num_tasks as task_count
from t5_retrieval.multitask.task_axis import sum_tasks


@gin.register(module="multitask")
def naive_sum(num_tasks: int, total_steps: int) -> optax.GradientTransformation:
    """The naive multi-task gradient: sum_k g_k (the gradient of the summed task losses).

    The baseline every other transform is compared with; stateless.

    Args:
      num_tasks: K, checked against the gradients' task axis.
      total_steps: the run's length, which the plain sum does not depend on (every multi-task
        transform is built from the same two run-level arguments).
    """
    del total_steps

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        del params
        k = task_count(updates)
        if k != num_tasks:
            raise ValueError(f"naive_sum was built for {num_tasks} tasks, got gradients with K={k}")
        return jax.tree_util.tree_map(sum_tasks, updates), state

    return optax.GradientTransformation(init_fn, update_fn)
