"""`t5r plan --cache_dir`: a plan run again reads back what it compiled, and reports the same.

Its own module: tests/test_plan.py compiles each program once per module behind the planner's back,
which would hide whether the store was read.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from conftest import run_plan

# A tiny T5 of one unscanned layer: the plan compiles its train and encode steps, nothing else.
TINY = ["--topology=v5e:2x2", "--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin",
        "--gin_file=sharding/fsdp.gin", "--gin.MIXTURE_OR_TASK_NAME=['demo_fever', 'demo_trex']",
        "--gin.QUERY_LEN=16", "--gin.PASSAGE_LEN=32", "--gin.VOCAB_SIZE=512", "--gin.D_MODEL=32", "--gin.D_FF=64",
        "--gin.NUM_LAYERS=1", "--gin.NUM_NEGATIVES=1", "--gin.PER_DEVICE_BATCH=2", "--gin.T5Config.scan_layers=False",
        "--gin.DROPOUT=0.0"]
# What a rerun may change: the host's peak and the store's own counts; and in each step, how long
# lowering took (a program read back keeps the seconds of its first compile).
VARIES = {"host_peak_bytes", "programs"}


def _plan(cache_dir: str) -> dict:
    code, out, err = run_plan(*TINY, "--json", f"--cache_dir={cache_dir}")
    assert code == 0, err
    return json.loads(out)


def _comparable(report: dict, times: tuple[str, ...] = ("lower_seconds",)) -> dict:
    """`report` without what may vary, and without each step's `times`."""
    steps = {name: {k: v for k, v in step.items() if k not in times} for name, step in report["steps"].items()}
    return {**{k: v for k, v in report.items() if k not in VARIES}, "steps": steps}


@pytest.fixture(scope="module")
def first_plan(tmp_path_factory) -> tuple[str, dict]:
    """(the store, the report) of a plan that compiled every program into a new store."""
    cache = str(tmp_path_factory.mktemp("plan_store") / "programs")
    return cache, _plan(cache)


def test_a_plan_keeps_each_program_it_compiled(first_plan):
    cache, first = first_plan
    assert first["programs"] == {"cache_dir": cache, "compiled": 2, "reused": 0}  # the train and encode steps
    assert len(glob.glob(os.path.join(cache, "*.json.gz"))) == first["programs"]["compiled"]


def test_a_plan_run_again_reads_back_every_program_and_reports_the_same(first_plan):
    cache, first = first_plan
    again = _plan(cache)
    assert again["programs"] == {"cache_dir": cache, "compiled": 0, "reused": first["programs"]["compiled"]}
    assert _comparable(again) == _comparable(first)


def test_a_damaged_program_file_is_compiled_again_and_the_rest_read_back(first_plan):
    cache, first = first_plan
    damaged = sorted(glob.glob(os.path.join(cache, "*.json.gz")))[0]
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    mended = _plan(cache)
    assert mended["programs"] == {"cache_dir": cache, "compiled": 1, "reused": first["programs"]["compiled"] - 1}
    times = ("lower_seconds", "compile_seconds")  # the mended program's is its new compile's
    assert _comparable(mended, times) == _comparable(first, times)


def test_the_text_report_says_how_many_programs_were_read_back(first_plan):
    cache, first = first_plan
    code, out, err = run_plan(*TINY, f"--cache_dir={cache}")
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("programs: ")]
    assert line.startswith(f"programs: 0 compiled, {first['programs']['compiled']:,} read back from {cache} "), line
