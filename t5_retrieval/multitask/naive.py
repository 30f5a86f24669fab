"""The naive multi-task gradient: the plain sum over tasks."""

from __future__ import annotations

from typing import Any

import jax
import optax

from t5_retrieval.multitask.task_axis import sum_tasks


def naive_sum() -> optax.GradientTransformation:
    """The naive multi-task gradient: sum_k g_k (the gradient of the summed task losses).

    The baseline every other transform is compared with; stateless.
    """

    def init_fn(params: Any) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        del params
        return jax.tree_util.tree_map(sum_tasks, updates), state

    return optax.GradientTransformation(init_fn, update_fn)
