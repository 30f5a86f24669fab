"""Published per-chip constants of the TPU generations `t5r plan` compiles for, in one table, and
the libtpu release it compiles with.

A JAX device is a chip, or a TensorCore where a chip shows two (v4 planned with
`--per_tensorcore`), so per-device figures divide the chip's by the devices per chip `planner`
observes.
"""

from __future__ import annotations

import dataclasses
import math

from t5_retrieval.errors import ConfigError

MIB = 1024 ** 2
GIB = 1024 ** 3
# The libtpu that the `tpu` extra and requirements-dev.txt pin: of the releases tried, the one that
# compiles every shipped step (0.0.42.1 crashes on T5-base's per-task passes) and works with this
# jax (from 0.0.45 on, libtpu crashes its profiler).
PINNED_LIBTPU = "0.0.43.2"


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int          # per chip
    peak_bf16_flops: float  # per chip, dense bf16 matmul FLOP/s
    source: str
    accelerator_type: str   # a slice name of this generation, as TPU VMs state their own
    # libtpu's chip configuration for one device per chip where its default is one per TensorCore:
    # JAX runs a v4 chip as one "megacore" device (both TensorCores, the chip's 32 GiB), while
    # libtpu's default configuration describes it as two devices of 16 GiB. None: the default is
    # already one device per chip (v5p, whose chips have two TensorCores too) or the chip has one
    # TensorCore (v5e, v6e).
    megacore_config: str | None = None
    # per chip, bytes/s of HBM bandwidth: what prices a kernel the compiler's cost model does not
    # (`planner.kernel_costs`); None where not published here
    hbm_bytes_per_second: float | None = None


# Google Cloud TPU system-architecture pages (the "chip specifications" tables), read 2026.
CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GIB, 275e12, "https://cloud.google.com/tpu/docs/v4", "v4-8", "megacore", 1200e9),
    "v5e": Chip("v5e", 16 * GIB, 197e12, "https://cloud.google.com/tpu/docs/v5e", "v5litepod-4", None, 819e9),
    "v5p": Chip("v5p", 95 * GIB, 459e12, "https://cloud.google.com/tpu/docs/v5p", "v5p-8", None, 2765e9),
    "v6e": Chip("v6e", 32 * GIB, 918e12, "https://cloud.google.com/tpu/docs/v6e", "v6e-4", None, 1640e9),
}


def parse_topology(name: str) -> tuple[Chip, int]:
    """'v5e:4x4' -> (the v5e chip, 16 chips); a ConfigError naming the known forms otherwise."""
    generation, _, dims = name.partition(":")
    sizes = dims.split("x") if dims else []
    if generation not in CHIPS or not sizes or not all(s.isdigit() and int(s) > 0 for s in sizes):
        forms = ", ".join(f"{g}:{'2x2x1' if g in ('v4', 'v5p') else '2x2'}" for g in CHIPS)
        raise ConfigError(f"--topology={name!r}: expected <generation>:<AxB[xC]> with a generation of "
                          f"{sorted(CHIPS)}, e.g. {forms}; or a GPU slice <gpu>:<GPUs per host>[x<hosts>] "
                          "of a100, h100 or h200, e.g. h100:8")
    return CHIPS[generation], math.prod(int(s) for s in sizes)
