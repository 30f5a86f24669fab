"""The planning table (docs/pods_table.md): `t5r plan` over T5 sizes x sharding layouts x TPU slices, naive and TACO.

Each cell is one `t5r plan --json` process (the paper's recipe: runs/naive_multitask.gin or
runs/taco.gin over the KILT mixture, 64 queries per device split over the tasks by the mixture's
rates, each task's own query length, 2 negatives, 160-token passages as in the paper (`--gin`'s
default; runs/base.gin reads 256); or `single`, NQ alone with runs/single_task.gin) with a time
limit; a cell that does not compile in it is recorded as such. Every time and rate in the table is
an estimate of the TPU compiler's cost model, not a measurement. `--gin NAME=value ...` binds the
same values in every cell. Cells already in the results file are kept (an interrupted run resumes;
runs over different grids add up to one table). `--table PATH` writes the table of every cell in
the results file as a markdown page (docs/pods_table.md); with `--no_compile`, from the results
file alone.

    .venv/bin/python benchmarks/bench_plan.py [--sizes small base] [--topologies v5e:4x4 v4:2x2x1]
        [--layouts fsdp data_parallel] [--methods naive taco single] [--timeout 1800] [--gin NAME=value ...]
        [--out docs/pods_table.json] [--table docs/pods_table.md] [--no_compile]
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
        # TACO not compiled whole (`t5r plan --from_parts`): T5-base's whole step outgrows a 23 GiB host
        "taco_parts": ["--gin_file=runs/taco.gin", "--from_parts"],
        "single": ["--gin_file=runs/single_task.gin", "--gin.MIXTURE_OR_TASK_NAME='kilt_nq_noprefix'"]}
MIB = 1024 ** 2
# Every planned cell's `t5r plan --json` report, from which docs/pods_table.md is written.
TABLE_CELLS = os.path.join(REPO, "docs", "pods_table.json")


def plan_cell(size: str, topology: str, layout: str, method: str, timeout: float, gin: list[str],
              done: set[tuple[Any, ...]], cache_dir: str | None = None) -> dict[str, Any] | None:
    """One `t5r plan --json` run; its report, or why there is none (None: already in the results).
    `cache_dir`: the plan's `--cache_dir`, so a cell stopped part way resumes its compiles."""
    cell = {"size": size, "topology": topology, "layout": layout, "method": method, "gin": list(gin)}
    if cell_key(cell) in done:
        return None
    command = [sys.executable, "-m", "t5_retrieval.cli", "plan", f"--topology={topology}", "--json",
               f"--gin_file=models/t5_{size}.gin", *RUNS[method],
               f"--gin_file=sharding/{layout}.gin", *[f"--gin.{b}" for b in gin],
               *([f"--cache_dir={cache_dir}"] if cache_dir else [])]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {**cell, "status": f"not compiled within {timeout:.0f} s"}
    cell["wall_seconds"] = round(time.perf_counter() - start, 1)
    if proc.stdout.strip().startswith("{"):
        return {**cell, "status": "fits" if proc.returncode == 0 else "does not fit", "report": json.loads(proc.stdout)}
    return {**cell, "status": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}


KILT_PASSAGES = 36_000_000  # KILT's Wikipedia in 100-word passages, as DPR-style retrievers index it


def _estimate(step: dict[str, Any]) -> str:
    """An estimated step time; `*` marks one from loop-free programs (`loop_free_estimate`)."""
    mark = "*" if step["estimate_source"] != "compiler" else ""
    return f"{step['estimated_step_seconds'] * 1e3:,.3g} ms{mark}"


def _compiler(versions: dict[str, str]) -> str:
    """What compiled a row: the libtpu (its cost model and memory figures change between releases),
    or XLA's GPU compiler, whose times are the plan's roofline (`t5r plan` for GPU slices)."""
    return f"libtpu {versions['libtpu']}" if "libtpu" in versions else f"XLA:GPU {versions['jax']}, roofline"


DEFAULT_GIN = ("PASSAGE_LEN=160",)  # the paper's passages; a row names the bindings its cell adds


def table_row(cell: dict[str, Any]) -> str:
    """A markdown row: per-device memory, the estimates and what they imply, compile times."""
    bindings = "".join(f", `{b}`" for b in cell.get("gin", ()) if b not in DEFAULT_GIN)
    head = f"| {cell['size']} | {cell['topology']} | {cell['layout']} | {cell['method']}{bindings}"
    if "report" not in cell:
        return head + f" | {cell['status']} |" + " |" * 6
    report = cell["report"]
    head += f" ({_compiler(report['compiler'])}) |" if "compiler" in report else " |"
    train, encode = report["steps"]["train"], report["steps"]["encode"]
    mem = train["memory_per_device"]
    state = (mem["params"] + mem["optimizer"] + mem["multitask"]) / MIB
    rate = (f"{_estimate(train)}, {train['estimated_per_second']['queries']:,.0f} q/s, MFU {train['estimated_mfu']:.0%}"
            if train["estimated_step_seconds"] else "none")
    epoch = report["estimated_epoch_seconds"]
    passages = encode["estimated_per_second"]["passages"] if encode["estimated_step_seconds"] else None
    kb = f"{passages:,.0f} p/s, {KILT_PASSAGES / passages / 3600:,.1f} h" if passages else "none"
    compile_s = train["compile_seconds"] + (train["loop_free_estimate"] or {}).get("compile_seconds", 0)
    estimated = ", estimated from its parts" if train.get("memory_source") == "parts" else ""
    return (head + f" {'yes' if train['fits'] else 'NO'} ({mem['peak'] / MIB:,.0f} / {mem['hbm'] / MIB:,.0f} MiB"
            f"{estimated}) |"
            f" {state:,.0f} MiB | {mem['temporaries'] / MIB:,.0f} MiB | {rate} |"
            f" {f'{epoch / 3600:,.1f} h' if epoch else 'none'} | {kb} |"
            f" {compile_s:.0f} s / {encode['compile_seconds']:.0f} s{_host_memory(report)} |")


def _host_memory(report: dict[str, Any]) -> str:
    """The planning host's peak memory, which decides the host a plan needs (older reports lack it)."""
    return f", {report['host_peak_bytes'] / 1024 ** 3:,.1f} GiB host" if "host_peak_bytes" in report else ""


TABLE_HEAD = ("| T5 | slice | layout | method | train step fits (peak / HBM per device) | params + optimiser + "
              "multi-task state | temporaries | est. train step (queries/s, MFU) | est. epoch | est. encode "
              "(36M passages) | compile train / encode, host memory |\n|---|---|---|---|---|---|---|---|---|---|---|")


# The page `--table` writes: what the command was and how to read its columns, then the table.
PAGE_HEAD = """# The planning table

Written by `.venv/bin/python benchmarks/bench_plan.py ... --table docs/pods_table.md` (the grid's
cells, each one `t5r plan --json` process, kept in `docs/pods_table.json`); how to read a
plan and what its estimates are and are not: [pods.md](pods.md). Per device: the train step's peak
memory against the HBM (a refused step's peak is the total the compiler's message names, its
arguments included), the parameters, optimiser and multi-task state, the temporaries; then the
compiler's estimates. **Every time, rate, MFU and epoch here is an estimate of libtpu's cost model
(`*`: from programs with their layers unrolled, at 1 and 2 layers and extrapolated), or on a GPU
slice (rows marked "XLA:GPU, roofline") the program's FLOPs at peak or its bytes at HBM bandwidth,
collectives unpriced; not a measurement: read it as a lower bound on the step time.** An encode
rate marked "% of peak" implies the model's matmuls at that share of the chips' peak FLOP/s: above
100% the cost model under-prices the program. The compiler of a row is named in it. Method
`taco_parts`: TACO planned with `t5r plan --from_parts`, its memory estimated from its task passes
and update.
"""


def table_page(cells: list[dict[str, Any]]) -> str:
    """The markdown page of `--table`: PAGE_HEAD, then the table of every cell."""
    return "\n".join([PAGE_HEAD, TABLE_HEAD, *map(table_row, cells)]) + "\n"


def cell_key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return cell["size"], cell["topology"], cell["layout"], cell["method"], tuple(cell.get("gin", ()))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "base"])
    parser.add_argument("--topologies", nargs="+", default=["v5e:4x4", "v4:2x2x1", "v5p:2x2x1"])
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "data_parallel"])
    parser.add_argument("--methods", nargs="+", default=["naive", "taco"], choices=sorted(RUNS))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per cell")
    parser.add_argument("--cache_dir", default=None, help="t5r plan --cache_dir for every cell: what a cell stopped "
                        "part way (its timeout, a stopped machine) compiled is read back when it is run again")
    parser.add_argument("--gin", nargs="*", default=list(DEFAULT_GIN), help="--gin. bindings for every cell")
    parser.add_argument("--out", default=TABLE_CELLS, help="the cells' JSON, committed beside the table so a later "
                        "run resumes and adds to it")
    parser.add_argument("--table", default=None, help="also write the table of every cell as a markdown page here")
    parser.add_argument("--no_compile", action="store_true", help="plan no cell: only write --table from --out")
    args = parser.parse_args(argv)
    out = args.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    # Cells already in the results file (same size, slice, layout, method and bindings) are kept, so
    # an interrupted run resumes and several runs add up to one table.
    cells = json.load(open(out))["cells"] if os.path.exists(out) else []
    done = {cell_key(c) for c in cells if "report" in c}
    result = {"machine": common.machine_info(blas_env=ORIGINAL_BLAS_ENV), "cells": cells}
    grid = [] if args.no_compile else itertools.product(args.sizes, args.topologies, args.layouts, args.methods)
    for size, topology, layout, method in grid:
        cell = plan_cell(size, topology, layout, method, args.timeout, args.gin, done, args.cache_dir)
        if cell is None:
            continue
        cells[:] = [c for c in cells if cell_key(c) != cell_key(cell)] + [cell]
        result["table"] = "\n".join([TABLE_HEAD, *map(table_row, cells)])
        print(table_row(cell), file=sys.stderr, flush=True)
        with open(out, "w") as f:  # what has compiled so far survives an interrupted run
            json.dump(result, f, indent=1)
    compiled = [c for c in cells if "report" in c]
    if args.table:
        with open(args.table, "w", encoding="utf-8") as f:
            f.write(table_page(cells))
    if args.no_compile:
        return 0
    common.write_results("plan", result, f"{len(compiled)} of {len(cells)} cells compiled; "
                         f"{sum(c['status'] == 'fits' for c in compiled)} fit", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
