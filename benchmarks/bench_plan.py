"""The docs/pods.md table: `t5r plan` over T5 sizes x sharding layouts x TPU slices, naive and TACO.

Each cell is one `t5r plan --json` process (the paper's recipe: runs/naive_multitask.gin or
runs/taco.gin over the KILT mixture, 64 queries per device split over the tasks by the mixture's
rates, each task's own query length, 256-token passages, 2 negatives; or `single`, NQ alone with
runs/single_task.gin) with a time limit; a cell that does not compile in it is recorded as such.
Every time and rate in the table is the TPU compiler's cost-model estimate, not a measurement.
`--gin NAME=value ...` binds the same values in every cell (a smaller model or batch, say).

    .venv/bin/python benchmarks/bench_plan.py [--sizes small base] [--topologies v5e:4x4 v4:2x2x1]
        [--layouts fsdp data_parallel] [--methods naive taco single] [--timeout 900] [--gin NAME=value ...]
        [--out results.json]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method -> its run file and bindings: the KILT mixture naive and with TACO, and one task alone
# (the papers' task-specific rows; one query shape, so the smallest program).
RUNS = {"naive": ["--gin_file=runs/naive_multitask.gin"], "taco": ["--gin_file=runs/taco.gin"],
        "single": ["--gin_file=runs/single_task.gin", "--gin.MIXTURE_OR_TASK_NAME='kilt_nq_noprefix'"]}
MIB = 1024 ** 2


def plan_cell(size: str, topology: str, layout: str, method: str, timeout: float, extra: list[str]) -> dict[str, Any]:
    """One `t5r plan --json` run; its report, or why there is none."""
    command = [sys.executable, "-m", "t5_retrieval.cli", "plan", f"--topology={topology}", "--json",
               f"--gin_file=models/t5_{size}.gin", *RUNS[method],
               f"--gin_file=sharding/{layout}.gin", *extra]
    cell = {"size": size, "topology": topology, "layout": layout, "method": method}
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**cell, "status": f"not compiled within {timeout:.0f} s"}
    cell["wall_seconds"] = round(time.perf_counter() - start, 1)
    if proc.stdout.strip().startswith("{"):
        return {**cell, "status": "fits" if proc.returncode == 0 else "does not fit", "report": json.loads(proc.stdout)}
    return {**cell, "status": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}


def table_row(cell: dict[str, Any]) -> str:
    """A markdown row: per-device memory, the estimate and what it implies, compile times."""
    head = f"| {cell['size']} | {cell['topology']} | {cell['layout']} | {cell['method']} |"
    if "report" not in cell:
        return head + f" {cell['status']} |" + " |" * 6
    train, encode = cell["report"]["steps"]["train"], cell["report"]["steps"]["encode"]
    mem = train["memory_per_device"]
    state = (mem["params"] + mem["optimizer"] + mem["multitask"]) / MIB
    est = train["estimated_step_seconds"]
    rate = (f"{est * 1e3:.3g} ms, {train['estimated_per_second']['queries']:,.0f} q/s, "
            f"MFU {train['estimated_mfu']:.0%}") if est else "none"
    enc = encode["estimated_per_second"]["passages"] if encode["estimated_step_seconds"] else None
    return (head + f" {'yes' if train['fits'] else 'NO'} ({mem['peak'] / MIB:,.0f} / {mem['hbm'] / MIB:,.0f} MiB) |"
            f" {state:,.0f} MiB | {mem['temporaries'] / MIB:,.0f} MiB | {rate} |"
            f" {f'{enc:,.0f} p/s' if enc else 'none'} |"
            f" {train['compile_seconds']:.0f} s / {encode['compile_seconds']:.0f} s |")


TABLE_HEAD = ("| T5 | slice | layout | method | train step fits (peak / HBM per device) | params + optimiser + "
              "multi-task state | temporaries | est. train step (queries/s, MFU) | est. encode | compile train / "
              "encode |\n|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--topologies", nargs="+", default=["v5e:4x4", "v4:2x2x1", "v5p:2x2x1"])
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "data_parallel"])
    parser.add_argument("--methods", nargs="+", default=["naive", "taco"], choices=sorted(RUNS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per cell")
    parser.add_argument("--gin", nargs="*", default=[], help="extra --gin. bindings for every cell")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/plan.json)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(common.RESULTS_DIR, "plan.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    cells = []
    result = {"machine": common.machine_info(blas_env=ORIGINAL_BLAS_ENV), "cells": cells}
    for size, topology, layout, method in itertools.product(args.sizes, args.topologies, args.layouts, args.methods):
        cells.append(plan_cell(size, topology, layout, method, args.timeout, [f"--gin.{b}" for b in args.gin]))
        result["table"] = "\n".join([TABLE_HEAD, *map(table_row, cells)])
        print(table_row(cells[-1]), file=sys.stderr, flush=True)
        with open(out, "w") as f:  # what has compiled so far survives an interrupted run
            json.dump(result, f, indent=1)
    compiled = [c for c in cells if "report" in c]
    common.write_results("plan", result, f"{len(compiled)} of {len(cells)} cells compiled; "
                         f"{sum(c['status'] == 'fits' for c in compiled)} fit", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
