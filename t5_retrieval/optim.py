"""The optimiser chain: [multi-task combine] -> clip by global norm -> AdamW, with warm-up/decay.

The multi-task transform (any `t5_retrieval.multitask` factory) consumes per-task gradients with a
leading task axis and emits one ordinary gradient, so everything after it is the standard
single-task chain. Every factory is built from the same two run-level arguments, `num_tasks` and
`total_steps`; whatever else it takes comes from gin.

`make_optimizer.frozen` (regular expressions over parameter paths such as
`bert/embeddings/word/embedding`) keeps parameters at their initial values for any method: the
whole chain, the multi-task transform included, sees only the trained parameters, so whatever a
transform computes over the parameters (a global median, say) and the clipping norm are taken over
those alone.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax

from t5_retrieval.errors import ConfigError
from t5_retrieval.sharding import param_path

log = logging.getLogger(__name__)


def _warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    return max(1, int(round(total_steps * warmup_fraction)))


@gin.configurable
def linear_warmup_decay(peak_value: float, total_steps: int, warmup_fraction: float = 0.1) -> optax.Schedule:
    """0 -> peak over the first warmup_fraction of steps, then linearly back to 0 at total_steps."""
    warmup_steps = _warmup_steps(total_steps, warmup_fraction)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_value, warmup_steps),
         optax.linear_schedule(peak_value, 0.0, max(1, total_steps - warmup_steps))],
        boundaries=[warmup_steps])


def frozen_labels(patterns: Sequence[str]) -> Callable[[Any], Any]:
    """Labels every leaf "frozen" whose path fully matches one of `patterns`, else "trained"."""
    compiled = [re.compile(p) for p in patterns]

    def labels(tree: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if any(c.fullmatch(param_path(path)) for c in compiled) else "trained", tree)

    return labels


def check_frozen_patterns(patterns: Sequence[str], params: Any) -> list[str]:
    """The frozen parameter paths; raises ValueError naming a pattern that matches no parameter
    (a typo would otherwise silently train everything)."""
    paths = [param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    if not paths:  # a structure-only call (`optax.tree_map_params` passes leafless placeholders)
        return []
    for pattern in patterns:
        if not any(re.fullmatch(pattern, path) for path in paths):
            raise ConfigError(f"make_optimizer.frozen: {pattern!r} matches no parameter (e.g. {paths[0]!r})")
    return [path for path in paths if any(re.fullmatch(p, path) for p in patterns)]


def zero_updates() -> optax.GradientTransformationExtraArgs:
    """Updates of zero shaped like the parameters (the gradients may carry a leading task axis)."""

    def update(updates, state, params=None, **extra_args):
        del updates, extra_args
        if params is None:
            raise ValueError("zero_updates needs the parameters passed to update()")
        return jax.tree.map(jnp.zeros_like, params), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def freeze(transform: optax.GradientTransformation, patterns: Sequence[str]) -> optax.GradientTransformation:
    """`transform` on the parameters no pattern matches, zero updates on the others; `init` raises
    ValueError for a pattern that matches no parameter."""
    if not patterns:
        return transform
    partitioned = optax.multi_transform({"trained": transform, "frozen": zero_updates()}, frozen_labels(patterns))

    def init(params: Any) -> optax.OptState:
        frozen = check_frozen_patterns(patterns, params)
        if frozen:
            log.info("optimiser: %d parameter arrays frozen: %s", len(frozen), ", ".join(frozen))
        return partitioned.init(params)

    return optax.GradientTransformationExtraArgs(init, partitioned.update)


@gin.configurable(denylist=["total_steps", "num_tasks", "multitask"])
def make_optimizer(total_steps: int,
                   num_tasks: int,
                   learning_rate: float = 1e-5,
                   warmup_fraction: float = 0.1,
                   weight_decay: float = 0.0,
                   clip_norm: float = 1.0,
                   multitask: Callable[..., optax.GradientTransformation] | None = None,
                   frozen: Sequence[str] = (),
                   ) -> optax.GradientTransformationExtraArgs:
    """[multitask] -> clip_by_global_norm -> AdamW with linear warm-up then linear decay to 0.

    `multitask(num_tasks=num_tasks, total_steps=total_steps)` builds the multi-task transform (the
    number of tasks comes from the data, the steps from this run or episode, so one run file serves
    episodes of any length); with `multitask=None` the train step sums the task losses and no
    per-task gradients are formed.
    `frozen`: regular expressions over parameter paths whose parameters never change (`freeze`).
    """
    log.info("optimiser: %sAdamW, peak learning rate %g after %d warm-up steps, linear decay to 0 at step %d, "
             "clip %g, weight decay %g", "" if multitask is None else f"{getattr(multitask, '__name__', multitask)} -> ",
             learning_rate, _warmup_steps(total_steps, warmup_fraction), total_steps, clip_norm, weight_decay)
    schedule = linear_warmup_decay(learning_rate, total_steps, warmup_fraction)
    tail = [optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay)]
    if multitask is None:
        return freeze(optax.chain(*tail), frozen)
    return freeze(optax.chain(multitask(num_tasks=num_tasks, total_steps=total_steps), *tail), frozen)
