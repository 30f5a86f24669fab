"""Shared helpers for benchmarks: a clean BLAS environment, interleaved timing, results JSON.

The machine is shared, so load changes during a run. Candidates are therefore timed round-robin
(one call of each per round) and compared by ratios from the same run, never against a number
measured at another time.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Set on some machines for numpy; they can push OpenBLAS onto slow kernels, so a baseline library
# that reads them would be handicapped. Benchmarks drop them (recording the values) before importing it.
BLAS_ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_SAVED_ENV = "T5R_BENCH_ORIGINAL_ENV"


def reexec_without_env(names: Sequence[str] = BLAS_ENV_VARS) -> dict[str, str | None]:
    """Restarts this process without the variables `names` (if any is set); returns their values.

    Must run before numpy/torch are imported: BLAS libraries read these variables when loaded.
    """
    if _SAVED_ENV in os.environ:
        return json.loads(os.environ[_SAVED_ENV])
    original = {name: os.environ.get(name) for name in names}
    if any(value is not None for value in original.values()):
        env = {k: v for k, v in os.environ.items() if k not in names}
        env[_SAVED_ENV] = json.dumps(original)
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return original


def call_seconds(fn: Callable[[], Any]) -> float:
    """Wall time of one call; `fn` must block until its result exists (e.g. jax.block_until_ready)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_times(candidates: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Times every candidate once per round for `repeats` rounds, so load changes hit all alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            times[name].append(call_seconds(fn))
    return times


def speedup(times: dict[str, list[float]], ours: str, reference: str) -> dict[str, float]:
    """How many times faster `ours` is than `reference`: ratio of medians and median of per-round ratios."""
    per_round = [r / o for o, r in zip(times[ours], times[reference])]
    return {"ratio_of_medians": statistics.median(times[reference]) / statistics.median(times[ours]),
            "median_of_round_ratios": statistics.median(per_round),
            "min_round_ratio": min(per_round), "max_round_ratio": max(per_round)}


def summarize(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "repeats": len(times)}


# CPU features that decide which GEMM kernels XLA and torch can use.
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and its GEMM-relevant feature flags (Linux /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "flags": None}
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return {"model": model, "flags": [f for f in CPU_FLAGS if f in flags]}


def machine_info(**extra: Any) -> dict[str, Any]:
    """Where and under what load the numbers were taken."""
    return {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "load_average_1m": os.getloadavg()[0], "python": platform.python_version(),
            "xla_flags": os.environ.get("XLA_FLAGS"), **extra}


def _plain(value: Any) -> Any:
    """numpy/jax scalars (e.g. np.bool_, np.float32) as plain Python values for JSON."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"results JSON: cannot serialise {type(value).__name__}: {value!r}")


def write_results(name: str, result: dict[str, Any], summary: str, out: str | None = None) -> str:
    """Writes `result` as JSON (default benchmarks/results/<name>.json) and prints one summary line."""
    path = out or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=_plain)
        f.write("\n")
    print(f"bench_{name}: {summary}")
    return path


def demo_slice() -> str:
    """The shipped real-data slice (t5_retrieval/demo_data), unpacked once under benchmarks/results;
    its KILT-format directory. The default input of the benchmarks that read real passages."""
    from t5_retrieval.data.kilt.demo_slice import SHIPPED, extract

    return extract(SHIPPED, os.path.join(RESULTS_DIR, "data"))
