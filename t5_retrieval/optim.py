"""The optimiser chain: [multi-task combine] -> clip by global norm -> AdamW, with warm-up/decay.

The multi-task transform (TACO, PCGrad, ...) consumes per-task gradients with a leading task axis
and emits one ordinary gradient, so everything after it is the standard single-task chain.
"""

from __future__ import annotations

from typing import Callable

import gin
import optax


@gin.configurable
def linear_warmup_decay(peak_value: float, total_steps: int, warmup_fraction: float = 0.1) -> optax.Schedule:
    """0 -> peak over the first warmup_fraction of steps, then linearly back to 0 at total_steps."""
    warmup_steps = max(1, int(round(total_steps * warmup_fraction)))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak_value, warmup_steps),
         optax.linear_schedule(peak_value, 0.0, max(1, total_steps - warmup_steps))],
        boundaries=[warmup_steps])


@gin.configurable(denylist=["total_steps", "num_tasks", "multitask"])
def make_optimizer(total_steps: int,
                   num_tasks: int,
                   learning_rate: float = 1e-5,
                   warmup_fraction: float = 0.1,
                   weight_decay: float = 0.0,
                   clip_norm: float = 1.0,
                   multitask: Callable[..., optax.GradientTransformation] | None = None,
                   ) -> optax.GradientTransformationExtraArgs:
    """Builds the chain; `multitask` is a factory called as multitask(num_tasks=..., total_steps=...).

    With `multitask=None` the train step sums the task losses and no per-task gradients are formed.
    """
    schedule = linear_warmup_decay(learning_rate, total_steps, warmup_fraction)
    tail = [optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay)]
    if multitask is None:
        return optax.chain(*tail)
    return optax.chain(multitask(num_tasks=num_tasks, total_steps=total_steps), *tail)
