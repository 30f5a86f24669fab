"""How close `t5r plan --from_parts` comes to the whole step: a per-task (TACO) step planned twice, once
compiled whole (the compiler's buffer assignment of the program `t5r train` runs) and once from its
parts (each task pass and the update compiled alone), on a model small enough to compile whole here
but large enough that its activations, not its code, decide the peak.

    .venv/bin/python benchmarks/bench_plan_from_parts.py [--topology v5e:2x2] [--gin NAME=value ...]

The default model: the tiny T5 at 2 scanned layers of width 256 (feed-forward 1024), 64 queries per
device over the two demo tasks, 160-token passages, fsdp; it compiles whole in minutes and 2 GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common

MODEL = ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/taco.gin", "--gin_file=sharding/fsdp.gin",
         "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']", "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=256",
         "--gin.D_FF=1024", "--gin.NUM_LAYERS=2", "--gin.T5Config.scan_layers=True", "--gin.QUERY_LEN=32",
         "--gin.PASSAGE_LEN=160", "--gin.NUM_NEGATIVES=1", "--gin.PER_DEVICE_BATCH=64", "--gin.DROPOUT=0.0"]
MIB = 1024 ** 2


def plan_report(argv: list[str]) -> dict:
    """`t5r plan --json` in this process: its train step's report."""
    import gin

    from t5_retrieval import cli

    out = io.StringIO()
    gin.clear_config()
    with contextlib.redirect_stdout(out):
        code = cli.main(["plan", *argv, "--json"])
    gin.clear_config()
    if code != 0:
        raise SystemExit(f"t5r plan {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())["steps"]["train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--gin", nargs="*", default=[], help="more --gin. bindings, NAME=value")
    args = parser.parse_args()
    argv = ["--topology", args.topology, *MODEL, *(f"--gin.{b}" for b in args.gin)]
    whole, parts = plan_report(argv), plan_report([*argv, "--from_parts"])
    peaks = {name: step["memory_per_device"]["peak"] for name, step in (("whole", whole), ("parts", parts))}
    result = {"topology": args.topology, "bindings": argv[2:],
              "whole_memory_per_device": whole["memory_per_device"],
              "parts_memory_per_device": parts["memory_per_device"], "parts": parts["parts_memory"],
              "peak_ratio_parts_over_whole": peaks["parts"] / peaks["whole"],
              "step_seconds": {"whole": whole["estimated_step_seconds"], "parts": parts["estimated_step_seconds"]}}
    summary = (f"--from_parts peak {peaks['parts'] / MIB:,.1f} MiB against the whole program's "
               f"{peaks['whole'] / MIB:,.1f} MiB ({result['peak_ratio_parts_over_whole']:.4f}x), {args.topology}")
    common.write_results("plan_from_parts", {**result, **common.machine_info()}, summary)


if __name__ == "__main__":
    main()
