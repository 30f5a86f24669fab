"""The optimiser chain: [multi-task combine] -> clip by global norm -> AdamW, with warm-up/decay.

The multi-task transform (TACO, PCGrad, ...) consumes per-task gradients with a leading task axis
and emits one ordinary gradient, so everything after it is the standard single-task chain.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import gin
import optax

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


def build_multitask(factory: Callable[..., optax.GradientTransformation], num_tasks: int, total_steps: int,
                    burn_in_fraction: float) -> optax.GradientTransformation:
    """Calls a multi-task transform factory with the run-level arguments it declares.

    `num_tasks` comes from the data; TACO's `burn_in_steps` is `burn_in_fraction` of this run's
    (episode's) steps, so one run file serves episodes of any length.
    """
    accepted = inspect.signature(factory).parameters
    kwargs = {}
    if "num_tasks" in accepted:
        kwargs["num_tasks"] = num_tasks
    if "burn_in_steps" in accepted:
        kwargs["burn_in_steps"] = int(round(burn_in_fraction * total_steps))
    return factory(**kwargs)


@gin.configurable(denylist=["total_steps", "num_tasks", "multitask"])
def make_optimizer(total_steps: int,
                   num_tasks: int,
                   learning_rate: float = 1e-5,
                   warmup_fraction: float = 0.1,
                   weight_decay: float = 0.0,
                   clip_norm: float = 1.0,
                   burn_in_fraction: float = 0.1,
                   multitask: Callable[..., optax.GradientTransformation] | None = None,
                   ) -> optax.GradientTransformationExtraArgs:
    """[multitask] -> clip_by_global_norm -> AdamW with linear warm-up then linear decay to 0.

    With `multitask=None` the train step sums the task losses and no per-task gradients are formed.
    """
    log.info("optimiser: %sAdamW, peak learning rate %g after %d warm-up steps, linear decay to 0 at step %d, "
             "clip %g, weight decay %g", "" if multitask is None else f"{getattr(multitask, '__name__', multitask)} -> ",
             learning_rate, _warmup_steps(total_steps, warmup_fraction), total_steps, clip_norm, weight_decay)
    schedule = linear_warmup_decay(learning_rate, total_steps, warmup_fraction)
    tail = [optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay)]
    if multitask is None:
        return optax.chain(*tail)
    return optax.chain(build_multitask(multitask, num_tasks, total_steps, burn_in_fraction), *tail)
