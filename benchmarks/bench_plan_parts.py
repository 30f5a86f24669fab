"""A per-task step (TACO) timed from its parts, each compiled in a process of its own, against
the naive step of the same bindings: the TACO rows of docs/pods.md.

`t5r plan` compiles the whole train step (for its memory) and then the parts of a per-task step in
one process; with remat, T5-base TACO's whole step alone passes a 23 GiB host's memory. This
script gives the step-time estimate without the whole step: every distinct task pass (unrolled at
full depth, without dropout, as `planner.per_task_estimate` times it), the update and, with
`train.gather_params_once`, the parameters' gather, each in a subprocess, summed as
`per_task_estimate` sums them. The naive reference is the naive step of the same bindings (the run
file's multi-task transform dropped) unrolled at `--naive_depths` layers and projected linearly to
the model's depth: unrolled at 12 layers T5-base's naive step does not fit the compiler's HBM, and
a line through 1 and 2 layers reads gradient programs high. Every time is an estimate of libtpu's
cost model, not a measurement.

    .venv/bin/python benchmarks/bench_plan_parts.py --topology=v4:2x2x1 --gin_file=models/t5_base.gin \\
        --gin_file=runs/taco.gin --gin_file=sharding/fsdp.gin --gin.PASSAGE_LEN=160 \\
        --gin.train.gather_params_once=True --naive_depths 4 6 8 [--whole] [--timeout 1800] [--out results.json]

`--whole` also compiles the real train step (its layers scanned, as `t5r train` runs it) in a process
of its own, for its memory per device: what `t5r plan` reports first, and the compile that outgrows
small hosts with remat (T5-base TACO passed 21 GiB; without remat it took 17.9 GiB).
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

PART_FLAG = "--part"  # a child process: one part, printed as one JSON line


@dataclasses.dataclass
class Planned:
    """What the parts are computed from: the plan's settings, model config, mesh and task shapes."""
    settings: Any
    config: dict[str, Any]
    mesh: Any
    rules: Any
    tasks: list[Any]
    target: Any  # planner.Target


def planned(plan_argv: list[str]) -> Planned:
    """Parses `t5r plan`'s flags (gin files, bindings, --topology) as `t5r plan` does."""
    from t5_retrieval import sharding, train  # noqa: F401  (train: the configurables the run files bind)
    from t5_retrieval.commands import plan as plan_command
    from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
    from t5_retrieval.models.build import model_config
    from t5_retrieval.plan import planner, steps

    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", required=True)
    parser.add_argument("--per_tensorcore", action="store_true")
    args = parse_args(parser, [*(f"--gin.{b.replace(' = ', '=')}" for b in plan_command.UNREAD_MACROS),
                               *plan_argv], reads=TASK_MODULE)
    settings = plan_command.train_settings()
    target = planner.describe_topology(args.topology, 1, args.per_tensorcore)
    rules = sharding.logical_axis_rules()
    return Planned(settings, model_config(), sharding.make_mesh(devices=target.devices), rules,
                   steps.task_shapes(settings), target)


def whole_step_memory(plan: Planned) -> dict[str, Any]:
    """The memory per device of the real train step (scanned layers, dropout), as `t5r plan` reads it:
    the program the parts stand in for, whose compile is the one that outgrows small hosts."""
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan import planner, steps

    model = build_model(plan.config)
    batch = steps.abstract_batch(plan.tasks, plan.settings, plan.mesh.shape["data"], model.embedding_dim)
    train, multitask_state = steps.lower_train_step(model, plan.config, plan.settings, [t.name for t in plan.tasks],
                                                    batch, plan.mesh, plan.rules)
    result = planner.compile_timed(train.lowered)
    compile_s, refusal = result.seconds, result.refusal
    memory = planner.memory_per_device(result.program, refusal, planner.train_state_bytes(train, multitask_state),
                                       plan.target.hbm_per_device)
    return {"seconds": None, "compile_seconds": round(compile_s, 1), "refused": refusal,
            "memory_per_device": memory, "fits": planner.fits(result.program, memory)}


def part_estimate(plan: Planned, part: str) -> dict[str, Any]:
    """One part's estimate: `pass:<k>` (task k's gradient pass), `update`, `gather`, `naive:<layers>`;
    or `whole`, the real step's memory (`whole_step_memory`)."""
    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan import planner, steps

    kind, _, arg = part.partition(":")
    if kind == "whole":
        return whole_step_memory(plan)
    names = [t.name for t in plan.tasks]
    depth = planner.scanned_depth(plan.config)
    data_shards = plan.mesh.shape["data"]
    if kind == "pass":
        k = int(arg)
        batch = steps.abstract_batch(plan.tasks, plan.settings, data_shards, build_model(plan.config).embedding_dim)
        estimate = planner.loop_free_estimate(
            lambda c: steps.lower_task_gradient(build_model(c), c, plan.settings, batch[names[k]], k, plan.mesh,
                                                plan.rules), plan.config, depth, full_depth=True, target=plan.target)
        return {"seconds": estimate["estimated_step_seconds"], "compile_seconds": estimate["compile_seconds"],
                "method": estimate["method"]}
    if kind == "naive":
        config = planner.timing_config(plan.config, int(arg))
        settings = dataclasses.replace(plan.settings, multitask=None, gather_params_once=False)
        model = build_model(config)
        batch = steps.abstract_batch(plan.tasks, settings, data_shards, model.embedding_dim)
        lowered = steps.lower_train_step(model, config, settings, names, batch, plan.mesh, plan.rules)[0].lowered
    elif kind == "update":
        lowered = steps.lower_gradient_update(build_model(plan.config), plan.settings, len(names), plan.mesh,
                                              plan.rules)
    elif kind == "gather":
        lowered = steps.lower_param_gather(build_model(plan.config), plan.config, plan.mesh, plan.rules)
    else:
        raise ValueError(f"unknown part {part!r}")
    result = planner.compile_timed(lowered)
    seconds = planner.usable_estimate(planner.compiler_seconds(result.program, plan.target)[0])
    return {"seconds": seconds, "compile_seconds": round(result.seconds, 1), "refused": result.refusal}


def run_part(script_argv: list[str], part: str, timeout: float) -> dict[str, Any]:
    """`part_estimate` in a child process (the compiler's memory goes with it)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), PART_FLAG, part, *script_argv],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"part": part, "seconds": None, "status": f"not compiled within {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"part": part, "seconds": None, "status": f"failed (exit {proc.returncode}): "
                                                          f"{proc.stderr.strip().splitlines()[-1:]}"}
    return {"part": part, **json.loads(lines[-1]), "wall_seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> int:
    if argv[:1] == [PART_FLAG]:
        print(json.dumps(part_estimate(planned(split_args(argv[2:])[0]), argv[1])), flush=True)
        return 0
    plan_argv, options = split_args(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--naive_depths", nargs="*", type=int, default=[4, 6, 8],
                        help="depths the naive step is unrolled at and projected from (none: no reference)")
    parser.add_argument("--whole", action="store_true",
                        help="also compile the real (scanned) train step for its memory per device")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per part")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/plan_parts.json)")
    args = parser.parse_args(options)

    from t5_retrieval.models.build import build_model
    from t5_retrieval.plan import planner, steps
    from t5_retrieval.train_step import task_groups

    plan = planned(plan_argv)
    if plan.settings.multitask is None:
        raise SystemExit("bench_plan_parts: the run has no per-task step (bind train.multitask, e.g. runs/taco.gin)")
    names = [t.name for t in plan.tasks]
    data_shards = plan.mesh.shape["data"]
    model = build_model(plan.config)
    batch = steps.abstract_batch(plan.tasks, plan.settings, data_shards, model.embedding_dim)
    groups = task_groups(model, batch, names)
    parts = [(f"pass:{g[0]}", len(g), names[g[0]] if len(g) == 1 else f"{names[g[0]]} and {len(g) - 1} alike")
             for g in groups] + [("update", 1, "update")]
    if plan.settings.gather_params_once:
        parts.append(("gather", 1, "parameter gather"))
    timed = {}
    for part, count, label in parts:
        timed[label] = {**run_part(plan_argv, part, args.timeout), "runs_per_step": count}
        print(f"{label}: {timed[label]}", file=sys.stderr, flush=True)
    complete = all(p["seconds"] for p in timed.values())
    step = sum(p["runs_per_step"] * p["seconds"] for p in timed.values()) if complete else None
    peak = plan.target.peak_flops
    flops = planner.train_matmul_flops(plan.config, plan.settings, plan.tasks, data_shards)
    queries = sum(t.rows for t in plan.tasks) * data_shards
    whole = run_part(plan_argv, "whole", args.timeout) if args.whole else None
    if whole:
        print(f"whole step: {whole}", file=sys.stderr, flush=True)
    naive = {}
    for d in args.naive_depths:  # each printed as it lands: an interrupted run keeps what it has
        naive[d] = run_part(plan_argv, f"naive:{d}", args.timeout)
        print(f"naive at {d} layers: {naive[d]}", file=sys.stderr, flush=True)
    depth = planner.scanned_depth(plan.config)
    naive_points = [(d, p["seconds"]) for d, p in naive.items() if p["seconds"]]
    projected = None
    if depth and len(naive_points) >= 2:
        slope, intercept = np.polyfit(*zip(*naive_points), 1)
        projected = float(slope * depth + intercept)
    result = {
        "machine": common.machine_info(blas_env=ORIGINAL_BLAS_ENV), "plan_args": plan_argv,
        "parts": timed, "whole_step": whole, "step_seconds": step, "queries_per_step": queries,
        "queries_per_second": queries / step if step else None, "mfu": flops / step / peak if step else None,
        "naive": {"unrolled": naive, "projected_to_layers": depth, "projected_seconds": projected},
        "ratio_to_naive": step / projected if step and projected else None,
        "note": "estimates of libtpu's cost model, not measurements",
    }
    summary = (f"per-task step {step * 1e3:,.1f} ms from {len(timed)} parts ({queries / step:,.0f} q/s, "
               f"MFU {flops / step / peak:.0%})" if step else "per-task step: a part has no estimate")
    if result["ratio_to_naive"]:
        summary += f"; naive {projected * 1e3:,.1f} ms projected from {args.naive_depths} layers: {result['ratio_to_naive']:.2f}x"
    if whole and "memory_per_device" in whole:
        mem = whole["memory_per_device"]
        summary += (f"; the whole step {'fits' if whole['fits'] else 'does NOT fit'} "
                    f"({mem['peak'] / 2 ** 20:,.0f} / {mem['hbm'] / 2 ** 20:,.0f} MiB per device)")
    elif whole:
        summary += f"; the whole step: {whole['status']}"
    common.write_results("plan_parts", result, summary, args.out)
    return 0


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(`t5r plan` flags: --topology, --per_tensorcore, --gin_file, --gin.*; this script's own options)."""
    plan_flags = ("--topology", "--per_tensorcore", "--gin_file", "--gin.")
    plan, own = [], []
    for arg in argv:
        (plan if arg.startswith(plan_flags) else own).append(arg)
    return plan, own


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
