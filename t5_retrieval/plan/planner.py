"""Compile the train and KB encode steps for a TPU topology and judge them per device.

Memory per device: what XLA's buffer assignment reports for the compiled program (arguments,
outputs not aliased to donated arguments, temporaries, code), with the arguments split
analytically by their shardings into parameters, optimiser state, multi-task state and batch. It
is compared with the chip's HBM (`chips.py`). Times are the TPU compiler's own cost-model estimate
(`optimal_seconds`), never a measurement, plus what that model leaves out of custom kernels
(`kernel_costs`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import importlib.metadata
import importlib.util
import math
import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from t5_retrieval import sharding
from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.models.attention import PALLAS_KERNEL_MATMULS
from t5_retrieval.models.build import build_model
from t5_retrieval.models.families import family_of
from t5_retrieval.plan import gpu, hlo, peak
from t5_retrieval.plan.chips import MIB, PINNED_LIBTPU, Chip, parse_topology
from t5_retrieval.plan.parts import memory_from_parts
from t5_retrieval.plan.programs import CompiledProgram, Result, compiled_once, kept_in
from t5_retrieval.plan.steps import (
    LoweredStep,
    TaskShape,
    TrainSettings,
    abstract_batch,
    abstract_params,
    encode_batch_rows,
    lower_encode_step,
    lower_gradient_update,
    lower_param_gather,
    lower_task_gradient,
    lower_train_step,
    task_shapes,
)
from t5_retrieval.plan.text import problems
from t5_retrieval.sharding import param_path
from t5_retrieval.train_step import task_groups

# The layout that replicates parameters by design; under any other a large replicated one is a problem.
REPLICATING_LAYOUT = "data_parallel"
# The most batches `fit_advice` compiles (the line's guess, then halfway to one query per task each time)
# before it settles for one query per task, which it has compiled already.
ADVICE_COMPILES = 3


# The chip configuration a plan describes its topology with, as the report names it: libtpu's
# "default" (one device per chip, for every generation but v4), "megacore" (a v4 chip as one device,
# as JAX runs v4 by default) or, for v4 with `--per_tensorcore`, libtpu's default configuration of
# v4 (one device per TensorCore).
PER_TENSORCORE = "per_tensorcore"


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices of one or more slices of a topology, and what each device has: a chip's HBM and
    peak FLOP/s, or half of them where a chip is two devices (v4 per TensorCore)."""

    chip: Chip
    devices: list[Any]
    chips: int  # in all slices
    chip_config: str = "default"  # "default", the chip's megacore configuration or PER_TENSORCORE

    @property
    def devices_per_chip(self) -> float:
        return len(self.devices) / self.chips

    @property
    def hbm_per_device(self) -> int:
        return int(self.chip.hbm_bytes / self.devices_per_chip)

    @property
    def peak_flops_per_device(self) -> float:
        return self.chip.peak_bf16_flops / self.devices_per_chip

    @property
    def hbm_bandwidth_per_device(self) -> float | None:
        """HBM bytes/s of a device (None: the chip's is not known here)."""
        bandwidth = self.chip.hbm_bytes_per_second
        return None if bandwidth is None else bandwidth / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        """Peak bf16 FLOP/s of all devices: what a step's MFU divides by."""
        return self.chip.peak_bf16_flops * self.chips


def describe_topology(name: str, num_slices: int, per_tensorcore: bool = False) -> Target:
    """The devices of `num_slices` slices of topology `name` ('v5e:4x4'), described by libtpu: one
    per chip, as JAX runs them (a v4 chip in libtpu's megacore configuration), or with
    `per_tensorcore` (v4 only) one per TensorCore, as libtpu's default configuration describes v4."""
    if gpu.is_gpu_topology(name):  # a GPU slice, described by jax's CUDA plugin
        return Target(*gpu.describe(name, num_slices, per_tensorcore))
    chip, chips_per_slice = parse_topology(name)
    if num_slices < 1:
        raise ConfigError(f"--num_slices={num_slices}: must be >= 1")
    if per_tensorcore and chip.megacore_config is None:
        raise ConfigError(f"--per_tensorcore: only v4 chips can be planned per TensorCore (libtpu describes a "
                          f"{chip.name} chip as one device); drop the flag for --topology={name}")
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(f"libtpu is not installed, and only it compiles for TPUs: pip install libtpu=={PINNED_LIBTPU} "
                        "(the version this project's `tpu` extra pins)")
    # Several processes may describe topologies at once (libtpu otherwise takes an exclusive lock
    # on /tmp/libtpu_lockfile). On a host without TPUs libtpu's start-up looks for this host's own
    # TPU and workers and prints warnings when it finds none; naming them keeps them quiet, and the
    # program is compiled for the described topology either way.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", chip.accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from jax.experimental import topologies
    megacore = chip.megacore_config if not per_tensorcore else None
    try:
        topology = topologies.get_topology_desc(topology_name=name, platform="tpu", num_slices=num_slices,
                                                **({"chip_config_name": megacore} if megacore else {}))
    except Exception as e:  # libtpu's error for a shape it does not know
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(f"--topology={name!r}: libtpu cannot describe it ({reason})") from None
    return Target(chip, list(topology.devices), chips_per_slice * num_slices,
                  PER_TENSORCORE if per_tensorcore else megacore or "default")


def bytes_per_device(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` (abstract arrays) laid out by `shardings`."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))):
        total += math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def replicated_params(params: Any, shardings: Any, threshold_bytes: int) -> list[dict[str, Any]]:
    """Parameters of at least `threshold_bytes` that every device holds whole."""
    found = []
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, x), s in zip(flat, jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))):
        size = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        if size >= threshold_bytes and s.is_fully_replicated and len(s.device_set) > 1:
            found.append({"param": param_path(path), "shape": list(x.shape), "bytes": size})
    return sorted(found, key=lambda p: -p["bytes"])


def forward_matmul_flops(config: dict[str, Any], rows: int, length: int) -> float:
    """Matmul FLOPs of one encoder forward over [rows, length] tokens, padding included (the family's count)."""
    return family_of(config).forward_flops(config, rows, length)


def train_matmul_flops(config: dict[str, Any], settings: TrainSettings, tasks: Sequence[TaskShape],
                       data_shards: int) -> float:
    """One global step: forward + backward (3x forward) over every query and passage (passages
    forward only under a stopped gradient; none when the batch carries stored embeddings)."""
    flops = 0.0
    for task in tasks:
        rows = task.rows * data_shards
        flops += 3 * forward_matmul_flops(config, rows, task.query_len)
        if not settings.stored_passage_embeddings:
            passages = forward_matmul_flops(config, rows * (1 + settings.num_negatives), settings.passage_len)
            flops += passages * (1 if settings.stop_passage_gradient else 3)
    return flops


# The TPU compiler refuses a program whose buffers exceed the chip's HBM, saying how much it needed
# in one of two forms (the second when it got as far as placing the buffers).
_OUT_OF_HBM = (re.compile(r"memory required for HLO temporaries \((?P<need>[0-9.]+)(?P<unit>[KMGT])\)"),
               re.compile(r"Ran out of memory in memory space hbm\. Used (?P<need>[0-9.]+)(?P<unit>[KMGT]) of "))


def compile_timed(lowered: jax.stages.Lowered, *, peak_breakdown: bool = False) -> Result:
    """Compiles `lowered` for its devices and reads what the plan needs of it (`programs.CompiledProgram`),
    or reads that back from the store `t5r plan --cache_dir` names (`programs.kept_in`).

    `peak_breakdown` has the compiler dump the program to read its peak from; only the steps a plan
    reports ask, since the dump is large and written inside the timing (T5-XXL: 210 MB of program
    text and buffer assignment)."""
    return compiled_once(lowered, peak_breakdown, _compile)


def _compile(lowered: jax.stages.Lowered, peak_breakdown: bool) -> Result:
    """The compile itself. First returns what earlier compiles left in the allocator
    (`release_host_memory`); the compiled program is dropped once read."""
    release_host_memory()
    dump = tempfile.TemporaryDirectory(prefix="t5r-plan-") if peak_breakdown else contextlib.nullcontext("")
    with dump as dump_dir, _not_cached():
        options = peak.compile_options(dump_dir) if peak_breakdown else None
        start = time.perf_counter()
        try:
            compiled, refusal = lowered.compile(compiler_options=options), None
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            compiled, refusal = None, " ".join(str(e).split())
        seconds = time.perf_counter() - start
        program = None if compiled is None else CompiledProgram.read(compiled)
        return Result(program, seconds, refusal, peak.read(dump_dir) if peak_breakdown else [])


@contextlib.contextmanager
def _not_cached() -> Iterator[None]:
    """Keeps what is compiled inside out of JAX's persistent cache: a TPU program compiled for a
    described topology cannot be loaded back without a TPU client (a later plan would only warn and
    recompile). JAX decides once per process whether it uses the cache, so where it already does
    (JAX_COMPILATION_CACHE_DIR set, a CPU program compiled first) disabling it is not enough:
    no compile is then slow enough to be written."""
    flags = {"jax_enable_compilation_cache": False, "jax_persistent_cache_min_compile_time_secs": math.inf}
    was = {name: getattr(jax.config, name) for name in flags}
    try:
        for name, value in flags.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in was.items():
            jax.config.update(name, value)


def refused_total(message: str) -> int:
    """The bytes an out-of-HBM refusal names (XLA prints binary units), else 0: the total of the
    program's buffers in HBM, its arguments included, although one form calls it "HLO temporaries"
    (T5-XXL on v5e:4x4: 16.51 GiB = 8.82 GiB of temporaries + 7.69 GiB of parameters and AdamW
    moments); the other says so ("Used 15.86G ... program 8.17G arguments 7.69G")."""
    for form in _OUT_OF_HBM:
        found = form.search(message)
        if found:
            return int(float(found["need"]) * 1024 ** "KMGT".index(found["unit"]) * 1024)
    return 0


def compiled_memory(program: CompiledProgram | None, refusal: str | None, parts: dict[str, int]) -> dict[str, int]:
    """Per-device buffers of the compiled program; for one the compiler refused, the arguments
    counted from their shardings and the rest of the total its message named as temporaries."""
    if program is None:
        arguments = sum(parts.values())
        total = refused_total(refusal or "")
        return {"arguments": arguments, "outputs_not_donated": 0, "temporaries": max(total - arguments, 0), "code": 0}
    memory = program.memory
    return {"arguments": memory["arguments"], "outputs_not_donated": memory["outputs"] - memory["aliased"],
            "temporaries": memory["temporaries"], "code": memory["code"]}


def memory_per_device(program: CompiledProgram | None, refusal: str | None, parts: dict[str, int], hbm: int
                      ) -> dict[str, int]:
    """`parts` (the arguments by what they are) and the compiled program's buffers, their sum (`peak`)
    against the device's `hbm` and the margin left."""
    buffers = compiled_memory(program, refusal, parts)
    peak = sum(buffers.values())
    return {**parts, **buffers, "peak": peak, "hbm": hbm, "margin": hbm - peak}


def fits(program: CompiledProgram | None, memory: dict[str, int]) -> bool:
    """A step fits when the compiler took it and its peak (`memory_per_device`) is within the HBM."""
    return program is not None and memory["margin"] >= 0


# A TPU custom call libtpu's cost model does not price: each one adds -1 s to `optimal_seconds`
# (a sentinel, not a time). Seen on T5-base: an encode step of -1.998 s with 2 of them, of -13.999 s
# with 14; the count added back gives estimates affine in depth, as identical layers must be.
UNPRICED_CUSTOM_CALL = 'custom_call_target="ConcatBitcast"'


def _priced_seconds(analysis: dict[str, Any], hlo_text: str | None) -> float:
    """`optimal_seconds` of a program's cost analysis with each unpriced custom call of its HLO text
    counted free, not -1 s; 0 when it gives none, or when the text is unreadable (None), since the
    calls then cannot be counted and the raw value may be off by whole seconds."""
    if hlo_text is None:
        return 0.0
    return float(analysis.get("optimal_seconds", 0.0)) + hlo_text.count(UNPRICED_CUSTOM_CALL)


def kernel_costs(hlo_text: str | None, target: Target) -> dict[str, Any]:
    """The custom TPU kernels of a compiled program as written (`hlo.tpu_kernels`; one in a loop
    body once), by kind: count, FLOPs, HBM bytes (operands and results), roofline seconds on one
    device (FLOPs at peak or bytes at HBM bandwidth, whichever is larger) and how many carry a cost
    estimate; and `unpriced_seconds`, what the program's estimate lacks.

    libtpu's cost model prices a kernel from the cost estimate it carries (Pallas flash attention's
    forward kernel has one), and one without (its backward `dkv` and `dq` kernels) by its bytes
    alone, at zero FLOPs: a flash-attention gradient of [1, 8, 2048, 128] on one v5e device
    reads 224.6 us, its forward's FLOPs at peak plus the backward kernels' bytes at 819 GB/s. So
    each kernel without an estimate adds its roofline less its bytes' time. A kernel of unknown
    kind gives no FLOPs (`flops` None) and adds nothing: the report says so."""
    kinds: dict[str, dict[str, Any]] = {}
    unpriced = 0.0
    peak, bandwidth = target.peak_flops_per_device, target.hbm_bandwidth_per_device
    for kernel in hlo.tpu_kernels(hlo_text or ""):
        matmuls = PALLAS_KERNEL_MATMULS.get(str(kernel["kind"]))
        q, k = cast(list[int], kernel["q"]), cast(list[int], kernel["k"])
        flops = (matmuls * 2.0 * math.prod(q) * k[-2]) if matmuls and len(q) == 4 and len(k) == 4 else None
        size = float(cast(int, kernel["bytes"]))
        memory_s = size / bandwidth if bandwidth else 0.0
        entry = kinds.setdefault(str(kernel["kind"]), {"count": 0, "flops": 0.0, "bytes": 0.0, "roofline_seconds": 0.0,
                                                       "with_cost_estimate": 0})
        entry["count"] += 1
        entry["bytes"] += size
        entry["with_cost_estimate"] += bool(kernel["cost_estimate"])
        if flops is None or entry["flops"] is None:
            entry["flops"] = None
            entry["roofline_seconds"] += memory_s
            continue
        entry["flops"] += flops
        entry["roofline_seconds"] += max(flops / peak, memory_s)
        if not kernel["cost_estimate"]:
            unpriced += max(flops / peak - memory_s, 0.0)
    return {"kinds": kinds, "unpriced_seconds": unpriced}


def compiler_seconds(program: CompiledProgram | None, target: Target | None = None) -> tuple[float, float]:
    """(the compiler's cost-model step time of `program` (`_priced_seconds`; 0 when it gives none) and,
    given the `target` it was compiled for, the time its custom kernels' FLOPs add where that model
    leaves them unpriced (`kernel_costs`), which the first includes; (0, 0) for no program."""
    if program is None:
        return 0.0, 0.0
    own = _priced_seconds(program.cost, program.text)
    added = kernel_costs(program.text, target)["unpriced_seconds"] if target is not None and own > 0 else 0.0
    return own + added, added


def timed_program(lowered: jax.stages.Lowered, target: Target | None = None) -> tuple[float | None, float, float]:
    """(the usable step-time estimate of `lowered`, compile seconds, the part of the estimate that is
    its kernels' unpriced FLOPs, `kernel_costs`, given the `target`)."""
    result = compile_timed(lowered)
    seconds, added = compiler_seconds(result.program, target)
    return usable_estimate(seconds), result.seconds, added


def usable_estimate(seconds: float) -> float | None:
    """A step-time estimate, or None when it is no time (0, negative or not finite), from which no
    rate or MFU can be computed."""
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def scanned_depth(config: dict[str, Any]) -> int | None:
    """Layers per stack when the model runs them as a `lax.scan` loop (T5: encoder and decoder alike),
    else None. A model with stacks of two depths would need a third point: None, and no extrapolation."""
    family = family_of(config)
    arch = config[family.name]
    if not arch.get("scan_layers"):
        return None
    depths = {int(arch[key]) for key in family.depth_keys}
    return depths.pop() if len(depths) == 1 else None


def timing_config(config: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """`config` as the plan compiles it to read a step time: `layers` layers per stack, unrolled
    (None: the config's own depth), and no dropout. Dropout's random bits made T5-base's
    programs several times larger to compile (the naive step unrolled at 12 layers passed 20 GiB
    of host memory with them, 4.5 GiB without) while moving the compiler's estimate by at most
    1.1% (NQ's gradient pass at 1, 2 and 12 layers). Memory is always read from the real program."""
    family = family_of(config)
    arch = {**config[family.name], **dict.fromkeys(family.dropout_keys, 0.0)}
    if layers is not None:
        arch.update({"scan_layers": False, **dict.fromkeys(family.depth_keys, layers)})
    return {**config, family.name: arch}


Lower = Callable[[dict[str, Any]], jax.stages.Lowered]


def loop_free_estimate(lower: Lower, config: dict[str, Any], depth: int | None, full_depth: bool = False,
                       target: Target | None = None) -> dict[str, Any]:
    """The step time from loop-free programs. libtpu's cost model prices a loop's body once, not once
    per iteration, so a program with its layers in a `lax.scan` is underestimated. `lower(config)`
    lowers the program for a model config without loops of ours.

    With scanned layers (`depth`): the step unrolled at all its layers (`full_depth`), or, for
    programs too large to compile unrolled, at 1 and 2 layers, extrapolated as if the time were affine
    in depth, t(L) = t(1) + (L - 1) (t(2) - t(1)). The cost model is not affine for gradient
    programs: deeper programs overlap more, and T5-base's NQ gradient pass reads 106 ms extrapolated,
    78 ms unrolled at 12 layers. Without scanned layers: the step at its own depth. Each program's
    time includes its kernels' unpriced FLOPs given the `target` (`timed_program`), whose part of
    the estimate is extrapolated alike (`kernel_seconds`)."""
    if not depth:
        depths: tuple[int | None, ...] = (None,)
        method = "its own depth"
    elif full_depth or depth == 1:
        depths, method = (depth,), f"unrolled at {depth} layer{'s' * (depth > 1)}"
    else:
        depths, method = (1, 2), f"extrapolated to {depth} layers"
    points: dict[str, float | None] = {}
    kernels: list[float] = []
    spent = 0.0
    for layers in depths:
        label = "own depth" if layers is None else f"{layers} layer" + "s" * (layers > 1)
        points[label], compile_s, added = timed_program(lower(timing_config(config, layers)), target)
        kernels.append(added)
        spent += compile_s
    if len(points) == 2:
        one, two = points["1 layer"], points["2 layers"]
        estimate = one + (depth - 1) * (two - one) if depth and one and two else None
        kernel_s = kernels[0] + (depth - 1) * (kernels[1] - kernels[0]) if depth else 0.0
    else:
        (estimate,), kernel_s = points.values(), kernels[0]
    return {"method": method, "seconds": points, "compile_seconds": round(spent, 2),
            "estimated_step_seconds": usable_estimate(estimate or 0.0), "kernel_seconds": kernel_s}


def per_task_estimate(passes: Sequence[tuple[str, int, Lower]], once: Sequence[tuple[str, Lower]],
                      config: dict[str, Any], depth: int | None, target: Target | None = None) -> dict[str, Any]:
    """The time of a per-task step (TACO, PCGrad, ...) from its parts, each compiled alone: every
    distinct task pass (`label`, how many tasks share it, `lower(config)` of one task's gradient),
    unrolled at full depth by `loop_free_estimate`, times its tasks; plus the parts that run once
    per step (`label`, `lower(config)`): the update from the K gradients to the next state, and the
    parameters' gather with `gather_params_once`. The step runs its passes one after another (each
    group behind an optimisation barrier) and its same-shaped tasks in a `lax.scan`, which the cost
    model would price once; and the passes compiled alone keep the programs small: the step's own
    loop-free program, all K passes unrolled, outgrew this host's memory for T5-base, while one
    task's pass unrolled at 12 layers compiles in minutes."""
    seconds: dict[str, float | None] = {}
    counted: list[tuple[int, float | None]] = []  # (runs per step, seconds) of each part
    spent = kernel_s = 0.0
    method = ""
    for label, count, lower in passes:
        part = loop_free_estimate(lower, config, depth, full_depth=True, target=target)
        spent += part["compile_seconds"]
        kernel_s += count * part["kernel_seconds"]
        seconds[f"{label} (x{count})"] = part["estimated_step_seconds"]
        counted.append((count, part["estimated_step_seconds"]))
        method = part["method"]
    for label, lower in once:
        seconds[label], compile_s, added = timed_program(lower(config), target)
        spent += compile_s
        kernel_s += added
        counted.append((1, seconds[label]))
    total = None if any(t is None for _, t in counted) else sum(c * (t or 0.0) for c, t in counted)
    depth_note = f", each {method}" if depth else ""
    return {"method": f"sum of {sum(c for _, c, _ in passes)} task passes{depth_note}, and "
                      + " and ".join(f"the {label}" for label, _ in once),
            "seconds": seconds, "compile_seconds": round(spent, 2),
            "estimated_step_seconds": usable_estimate(total or 0.0), "kernel_seconds": kernel_s}


def step_report(step: LoweredStep, compiled: Result, lower_s: float, parts: dict[str, int], target: Target,
                model_flops: float, items: dict[str, int]) -> dict[str, Any]:
    """Memory, time estimate and collectives of one compiled step, per device, from its compile's
    `Result` (its peak breakdown included, refused programs too). The time is the compiler's
    estimate for this program; `with_loop_free` replaces it for a program with loops of ours."""
    program, refusal = compiled.program, compiled.refusal
    memory = memory_per_device(program, refusal, parts, target.hbm_per_device)
    analysis = {} if program is None else program.cost
    text, unreadable = ("", None) if program is None else (program.text, program.unreadable)
    own_seconds = _priced_seconds(analysis, text)
    kernels = kernel_costs(text, target)
    added = kernels["unpriced_seconds"] if own_seconds > 0 else 0.0
    report: dict[str, Any] = {
        "lower_seconds": round(lower_s, 2), "compile_seconds": round(compiled.seconds, 2),
        "hlo_bytes": len(step.lowered.as_text()),
        "memory_per_device": memory,
        "memory_source": "program",  # or "parts": `with_memory_from_parts`
        "peak_breakdown": compiled.peak,
        "fits": fits(program, memory),
        "compiler_refused": refusal,
        "compiler_flops_per_device": float(analysis.get("flops", 0.0)),
        "model_matmul_flops": model_flops,
        "peak_bf16_flops": target.peak_flops,
        "compiler_optimal_seconds": float(analysis.get("optimal_seconds", 0.0)),
        "compiler_seconds": own_seconds,
        "custom_kernels": kernels["kinds"],
        "kernel_seconds": added,
        "loop_free_estimate": None,
        "hlo_unreadable": unreadable,
        "collectives": hlo.collectives(text) if text else {},
        "program": hlo.program_size(text) if text else {},
        "items_per_step": items,
    }
    return _with_estimate(report, usable_estimate(own_seconds + added), "compiler")


def with_loop_free(report: dict[str, Any], loop_free: dict[str, Any]) -> dict[str, Any]:
    """`report` with its time from the loop-free programs (`loop_free_estimate`, `per_task_estimate`)."""
    return _with_estimate({**report, "loop_free_estimate": loop_free, "kernel_seconds": loop_free["kernel_seconds"]},
                          loop_free["estimated_step_seconds"], loop_free["method"])


def _with_estimate(report: dict[str, Any], seconds: float | None, source: str) -> dict[str, Any]:
    """`report` with step time `seconds` (None: none) from `source`, and the rates and MFU it implies."""
    report = {k: v for k, v in report.items() if k not in ("estimated_per_second", "estimated_mfu")}
    report.update(estimated_step_seconds=seconds, estimate_source=source if seconds else None)
    if seconds:
        report["estimated_per_second"] = {name: n / seconds for name, n in report["items_per_step"].items()}
        report["estimated_mfu"] = report["model_matmul_flops"] / seconds / report["peak_bf16_flops"]
    return report


def release_host_memory() -> None:
    """Returns what a finished compile left in the allocator to the system. The TPU compiler allocates
    with glibc's malloc, which keeps freed memory: T5-base TACO's plan (without remat) held 17.9 GiB
    after compiling its train step and passed the host's 21 GiB on the first timing program after it;
    with the compiled step dropped and the heap trimmed it fell to 5.4 GiB and finished."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # a libc without malloc_trim (musl): nothing to return
            pass


def gathered_copy_bytes(config: dict[str, Any], params: Any, mesh: Mesh) -> int:
    """Per-device bytes of the parameters gathered whole as the network reads them (bfloat16 where
    it computes in it): the copy `train.gather_params_once` holds through a step's task passes."""
    read = jax.eval_shape(lambda p: family_of(config).as_read(config, p), params)
    return bytes_per_device(read, jax.tree.map(lambda _: sharding.replicated(mesh), params))


def per_task_memory(model: Any, config: dict[str, Any], settings: TrainSettings, batch: Any,
                    task_names: Sequence[str], groups: Sequence[Sequence[int]], mesh: Mesh, rules: sharding.Rules,
                    train: LoweredStep, arguments: dict[str, int], hbm: int) -> dict[str, Any]:
    """A per-task step's memory per device from its parts, each compiled alone as the step runs it
    (layers scanned, dropout on): one task pass per group of same-shaped tasks and the update
    (`memory_from_parts`), with the step's `arguments` by what they are (`train_state_bytes`). Also
    the seconds the compiles took and each part's temporaries."""
    spent = 0.0
    passes = []
    for group in groups:
        k = group[0]
        part = compile_timed(lower_task_gradient(model, config, settings, batch[task_names[k]], k, mesh, rules))
        passes.append(compiled_memory(part.program, part.refusal, {}))
        spent += part.seconds
    part = compile_timed(lower_gradient_update(model, settings, len(task_names), mesh, rules))
    update = compiled_memory(part.program, part.refusal, {})
    spent += part.seconds
    gathered = gathered_copy_bytes(config, train.state.params, mesh) if settings.gather_params_once else 0
    gradient = bytes_per_device(train.state.params, train.state_shardings.params)
    memory = memory_from_parts(arguments, gradient, len(task_names), passes, update, gathered, hbm)
    return {"memory": memory, "compile_seconds": round(spent, 2),
            "passes": [p["temporaries"] for p in passes], "update": update["temporaries"]}


# What to try when a step's memory from its parts does not fit: no compile checks it (that would
# compile the whole step, which --from_parts is there to avoid).
PARTS_ADVICE = ("its memory from its parts is an estimate, so no smaller batch was compiled to check: try "
                "--gin.PER_DEVICE_BATCH={batch}, more or larger chips, or plan the whole step without --from_parts "
                "on a host with the memory")


def with_memory_from_parts(report: dict[str, Any], from_parts: dict[str, Any]) -> dict[str, Any]:
    """The train step's `report` with the memory of its parts in place of the whole program's."""
    memory = from_parts["memory"]
    return {**report, "memory_per_device": memory, "fits": memory["margin"] >= 0,
            "memory_source": "parts", "parts_memory": {k: v for k, v in from_parts.items() if k != "memory"}}


def train_step_memory(model: Any, config: dict[str, Any], settings: TrainSettings, mesh: Mesh,
                      rules: sharding.Rules, hbm: int) -> tuple[bool, dict[str, int]]:
    """Compiles the train step alone for `settings` and `rules`; (fits, its memory per device)."""
    tasks = task_shapes(settings)
    batch = abstract_batch(tasks, settings, mesh.shape["data"], model.embedding_dim)
    train, multitask_state = lower_train_step(model, config, settings, [t.name for t in tasks], batch, mesh, rules)
    result = compile_timed(train.lowered)
    memory = memory_per_device(result.program, result.refusal, train_state_bytes(train, multitask_state), hbm)
    return fits(result.program, memory), memory


def fit_advice(model: Any, config: dict[str, Any], settings: TrainSettings, mesh: Mesh, layout: str,
               report: dict[str, Any], num_tasks: int) -> str:
    """What fits when the train step does not, checked by compiling it.

    Another layout of this mesh is tried when its state and temporaries, scaled by how much smaller
    it makes each device's parameters, would fit. Else a smaller per-device batch: temporaries are
    not proportional to the batch (T5-XXL fsdp on v5e:4x4, float32 stacks: 20,924 MiB at 64
    queries per device, 16,193 at 18), so the step is compiled at one query per task too, and the
    batch is read off the line through the two."""
    mem = report["memory_per_device"]
    hbm = mem["hbm"]
    state = mem["params"] + mem["optimizer"] + mem["multitask"]
    fixed = mem["batch"] + mem["outputs_not_donated"] + mem["code"]
    for name, rules in sharding.LAYOUTS.items():
        if name == layout:
            continue
        ratio = bytes_per_device(*abstract_params(model, mesh, rules)) / max(mem["params"], 1)
        if (state + mem["temporaries"]) * ratio + fixed <= hbm:
            ok, other = train_step_memory(model, config, settings, mesh, rules, hbm)
            if ok:
                return f"layout {name} fits ({_compiled_peak(other)}; --gin_file=sharding/{name}.gin)"
    rules = sharding.LAYOUTS[layout]
    largest = settings.per_device_batch
    ok, least = train_step_memory(model, config, dataclasses.replace(settings, per_device_batch=num_tasks), mesh,
                                  rules, hbm)
    if not ok:
        within = (f" of the {hbm / MIB:,.0f}, more than the compiler leaves a program" if least["peak"] <= hbm
                  else "")
        return (f"no batch of one query per task fits either (PER_DEVICE_BATCH={num_tasks} needs "
                f"{least['peak'] / MIB:,.0f} MiB{within}), nor another layout of this mesh: use more or larger chips")
    per_query = (mem["temporaries"] - least["temporaries"]) / max(largest - num_tasks, 1)
    room = least["margin"]
    batch = largest - 1 if per_query <= 0 else min(largest - 1, num_tasks + int(room / per_query))
    for _ in range(ADVICE_COMPILES):  # each a full compile of the step: minutes for the largest models
        if batch <= num_tasks:
            break
        ok, found = train_step_memory(model, config, dataclasses.replace(settings, per_device_batch=batch), mesh,
                                      rules, hbm)
        if ok:
            return f"--gin.PER_DEVICE_BATCH={batch} fits ({_compiled_peak(found)})"
        batch = num_tasks + (batch - num_tasks) // 2
    return f"--gin.PER_DEVICE_BATCH={num_tasks} fits ({_compiled_peak(least)})"


def _compiled_peak(memory: dict[str, int]) -> str:
    return f"compiled: {memory['peak'] / MIB:,.0f} of {memory['hbm'] / MIB:,.0f} MiB per device"


def train_state_bytes(train: LoweredStep, multitask_state: tuple[Any, Any] | None) -> dict[str, int]:
    """Per-device bytes of the train step's arguments by what they are: parameters, optimiser state
    (the multi-task transform's own state, e.g. TACO's K x params EMA, counted apart) and batch."""
    opt_b = bytes_per_device(train.state.opt_state, train.state_shardings.opt_state)
    mt_b = 0 if multitask_state is None else bytes_per_device(*multitask_state)
    return {"params": bytes_per_device(train.state.params, train.state_shardings.params),
            "optimizer": opt_b - mt_b, "multitask": mt_b, "batch": bytes_per_device(train.batch, train.batch_shardings)}


def steps_per_epoch(tasks: Sequence[TaskShape], data_shards: int) -> int | None:
    """Steps of one epoch, a pass over the task with the most training examples (the others cycle),
    or None when a task declares no size."""
    if any(t.train_examples is None for t in tasks):
        return None
    largest = max(tasks, key=lambda t: t.train_examples or 0)
    return math.ceil((largest.train_examples or 0) / (largest.rows * data_shards))


def plan(topology: str, num_slices: int, layout: str, rules: sharding.Rules, config: dict[str, Any],
         settings: TrainSettings, replicated_threshold_bytes: int, make_mesh: Any = sharding.make_mesh,
         per_tensorcore: bool = False, from_parts: bool = False, cache_dir: str | None = None) -> dict[str, Any]:
    """Compiles the train and KB encode steps for the topology (`describe_topology`); returns the
    JSON-able report. `from_parts`: a per-task step is not compiled whole; its memory per device is
    estimated from its parts (`memory_from_parts`), as its time always is. `cache_dir`: each
    compile's result is kept there and read back by a later plan (`programs.kept_in`)."""
    target = describe_topology(topology, num_slices, per_tensorcore)
    versions = gpu.compiler_versions() if gpu.is_gpu_topology(topology) else compiler_versions()
    with kept_in(cache_dir, versions) as store:
        report = _plan(target, versions, topology, num_slices, layout, rules, config, settings,
                       replicated_threshold_bytes, make_mesh, from_parts)
    if store is not None:
        report["programs"] = {"cache_dir": cache_dir, **store.counts}
    report["host_peak_bytes"] = host_peak_bytes()  # after the advice's compiles: T5-XXL's needed the most
    return report


def _plan(target: Target, versions: dict[str, str], topology: str, num_slices: int, layout: str,
          rules: sharding.Rules, config: dict[str, Any], settings: TrainSettings, replicated_threshold_bytes: int,
          make_mesh: Any, from_parts: bool) -> dict[str, Any]:
    mesh = make_mesh(devices=target.devices)
    data_shards = mesh.shape["data"]
    model = build_model(config)
    tasks = task_shapes(settings)
    task_names = [t.name for t in tasks]
    batch = abstract_batch(tasks, settings, data_shards, model.embedding_dim)
    # per-task gradient passes, same-shaped tasks in one `lax.scan` (task_groups reads only shapes
    # and dtypes, which the abstract batch has)
    per_task = settings.multitask is not None and not model.config.query_generation
    if from_parts and not per_task:
        raise UserError("--from_parts plans a per-task step (train.multitask, as runs/taco.gin binds it) from its "
                        "parts; this run's train step is one program: plan it without --from_parts")
    groups = task_groups(model, cast(Any, batch), task_names) if per_task else []

    start = time.perf_counter()
    train, multitask_state = lower_train_step(model, config, settings, task_names, batch, mesh, rules)
    lower_s = time.perf_counter() - start
    parts = train_state_bytes(train, multitask_state)
    train_compile = Result(None, 0.0, None, []) if from_parts else compile_timed(train.lowered, peak_breakdown=True)
    refusal = train_compile.refusal
    params_b = parts["params"]
    queries = sum(t.rows for t in tasks) * data_shards
    train_report = step_report(train, train_compile, lower_s, parts, target,
                               train_matmul_flops(config, settings, tasks, data_shards), {"queries": queries})
    if from_parts:
        train_report = with_memory_from_parts(train_report, per_task_memory(
            model, config, settings, batch, task_names, groups, mesh, rules, train, parts, target.hbm_per_device))
    depth = scanned_depth(config)
    if refusal is None and per_task and (from_parts or depth or any(len(g) > 1 for g in groups)):
        passes = [(task_names[g[0]] if len(g) == 1 else f"{task_names[g[0]]} and {len(g) - 1} alike", len(g),
                   lambda c, k=g[0]: lower_task_gradient(build_model(c), c, settings, batch[task_names[k]], k,
                                                         mesh, rules))
                  for g in groups]
        once = [("update", lambda c: lower_gradient_update(build_model(c), settings, len(task_names), mesh, rules))]
        if settings.gather_params_once:
            once.append(("parameter gather", lambda c: lower_param_gather(build_model(c), c, mesh, rules)))
        train_report = with_loop_free(train_report, per_task_estimate(passes, once, config, depth, target))
    elif refusal is None and depth:
        train_report = with_loop_free(train_report, loop_free_estimate(
            lambda c: lower_train_step(build_model(c), c, settings, task_names, batch, mesh, rules)[0].lowered,
            config, depth, target=target))

    start = time.perf_counter()
    encode = lower_encode_step(model, config, settings.passage_len, mesh, rules)
    lower_s = time.perf_counter() - start
    encode_compile = compile_timed(encode.lowered, peak_breakdown=True)
    rows = encode_batch_rows(data_shards)
    encode_parts = {"params": bytes_per_device(encode.state, encode.state_shardings), "optimizer": 0, "multitask": 0,
                    "batch": bytes_per_device(encode.batch, encode.batch_shardings)}
    encode_report = step_report(encode, encode_compile, lower_s, encode_parts, target,
                                forward_matmul_flops(config, rows, settings.passage_len), {"passages": rows})
    if encode_compile.refusal is None and depth:
        encode_report = with_loop_free(encode_report, loop_free_estimate(
            lambda c: lower_encode_step(build_model(c), c, settings.passage_len, mesh, rules).lowered, config, depth,
            target=target))

    report = {
        "topology": topology, "num_slices": num_slices, "devices": len(target.devices),
        "mesh": {k: int(v) for k, v in mesh.shape.items()}, "layout": layout,
        "chip": {"name": target.chip.name, "chip_config": target.chip_config,
                 "devices_per_chip": target.devices_per_chip, "hbm_bytes_per_device": target.hbm_per_device,
                 "peak_bf16_flops_per_device": target.peak_flops_per_device, "source": target.chip.source},
        "tasks": [{"name": t.name, "per_device_rows": t.rows, "query_len": t.query_len,
                   "train_examples": t.train_examples} for t in tasks],
        "steps_per_epoch": steps_per_epoch(tasks, data_shards),
        "per_device_batch": settings.per_device_batch, "passage_len": settings.passage_len,
        "num_negatives": settings.num_negatives,
        "multitask": None if settings.multitask is None else getattr(settings.multitask, "__name__", "multitask"),
        "steps": {"train": train_report, "encode": encode_report},
        "replicated_params": ([] if layout == REPLICATING_LAYOUT else
                              replicated_params(train.state.params, train.state_shardings.params,
                                                replicated_threshold_bytes)),
    }
    epoch_steps, step_seconds = report["steps_per_epoch"], train_report["estimated_step_seconds"]
    report["estimated_epoch_seconds"] = epoch_steps * step_seconds if epoch_steps and step_seconds else None
    report["gathered_copy_bytes"] = None  # the copy `train.gather_params_once` would add, where it helps
    whole = jax.tree.map(lambda _: sharding.replicated(mesh), train.state.params)
    if per_task and not settings.gather_params_once and params_b < bytes_per_device(train.state.params, whole):
        report["gathered_copy_bytes"] = gathered_copy_bytes(config, train.state.params, mesh)
    report["compiler"] = versions
    report["problems"] = problems(report) + (gpu.problems(report) if gpu.is_gpu_report(report) else [])
    if not train_report["fits"]:
        report["advice"] = (PARTS_ADVICE.format(batch=max(settings.per_device_batch // 2, len(tasks))) if from_parts
                            else fit_advice(model, config, settings, mesh, layout, train_report, len(tasks)))
    return report


def compiler_versions() -> dict[str, str]:
    """The jax and libtpu that compiled the plan: libtpu's compiler and cost model change between
    releases (the same step's temporaries and time), and a libtpu newer than jax's XLA may compile
    programs jax cannot read back."""
    return {"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu")}


def host_peak_bytes() -> int:
    """The most host memory this process has held: for `t5r plan`, its compiles' peak, which decides
    the host a plan needs (T5-base on `v4:2x2x1`: 18 GiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
