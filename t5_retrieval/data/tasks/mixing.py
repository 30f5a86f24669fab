"""Temperature-scaled task mixing and per-task sub-batch sizes (TACO / T5 "examples-proportional").

Every training step holds one sub-batch per task. Task t gets rate r_t = n_t^(1/T) / sum_s n_s^(1/T);
with per-device batch B >= K tasks, each task first gets one example and the remaining B - K are
split by the largest remainder of B * r_t - 1 (Hamilton apportionment), so sizes always sum to B.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gin

from t5_retrieval.data.records import DataError
from t5_retrieval.errors import ConfigError


def temperature_rates(num_examples: Sequence[int], temperature: float = 4.0) -> list[float]:
    """r_t = n_t^(1/T), normalised to sum to 1."""
    if not num_examples:
        raise ConfigError("temperature_rates: no tasks given (an empty mixture?)")
    if any(n <= 0 for n in num_examples):
        raise DataError(f"temperature_rates: every task needs >= 1 example, got {list(num_examples)}")
    if temperature <= 0:
        raise ConfigError(f"temperature_rates: temperature must be > 0, got {temperature}")
    raw = [float(n) ** (1.0 / temperature) for n in num_examples]
    total = sum(raw)
    return [r / total for r in raw]


def sizes_from_rates(rates: Sequence[float], per_device_batch: int) -> list[int]:
    """One example per task, then B - K apportioned by the largest remainder of B * r_t - 1.

    Ties in the remainder go to the earlier task, so the result is deterministic.
    """
    k = len(rates)
    if per_device_batch < k:
        raise ConfigError(f"per-device batch {per_device_batch} is smaller than the number of tasks {k}; "
                          "every task needs at least one example per step")
    total = sum(rates)
    if total <= 0 or any(r < 0 for r in rates):
        raise ConfigError(f"mixing rates must be non-negative with a positive sum, got {list(rates)}")
    quotas = [max(per_device_batch * r / total - 1.0, 0.0) for r in rates]
    # Scale quotas so they sum to exactly B - K before taking floors (the max(.,0) can shrink the sum).
    extra = per_device_batch - k
    quota_sum = sum(quotas)
    if quota_sum > 0:
        quotas = [q * extra / quota_sum for q in quotas]
    else:
        quotas = [extra / k] * k
    floors = [math.floor(q) for q in quotas]
    left = extra - sum(floors)
    order = sorted(range(k), key=lambda t: (-(quotas[t] - floors[t]), t))
    for t in order[:left]:
        floors[t] += 1
    return [1 + f for f in floors]


@gin.configurable
def subbatch_sizes(num_examples: Sequence[int], per_device_batch: int, temperature: float = 4.0) -> list[int]:
    """Per-device sub-batch size of each task from its number of training examples."""
    return sizes_from_rates(temperature_rates(num_examples, temperature), per_device_batch)
