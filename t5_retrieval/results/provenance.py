"""What a run trained, as its record keeps it: enough to check, without the run's files, that each
model ran as its row says.

For every model directory of a run (one for most rows; the warm-up and each ANCE episode for the
recipe rows; one per task for `task_specific`) the record keeps:

- ``steps``, ``gin_files``, ``bindings``: how the row configured it (the model's DONE);
- ``operative_config``: every gin binding the run used (its `config.gin`), machine paths replaced
  by ``<work_dir>`` and ``<python>``;
- ``method_statistics``: the multi-task method's own statistics at each logged step
  (`metrics.jsonl`; for TACO each task's median and fraction of zero sensitivities, whether the
  weights were applied, their mean entropy), as ``{"steps": [...], "values": {name: [...]}}``;
- ``specialisation``: the paper's Fig. 2 numbers from the final multi-task state, when the run kept
  one (TACO, or a naive control that tracks TACO's EMA): the fraction of task-specific and of
  not-activated parameters, the mean entropy of the weights, and per task its share of the
  task-specific parameters and its mean weight.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from t5_retrieval.stages import DONE

MODEL_DIR = "model"
CONFIG_FILE = "config.gin"
METRICS_FILE = "metrics.jsonl"
# The prefixes under which the multi-task transforms log their state (`MultitaskState.metrics` and
# `.statistics`); the trainer's own scalars (losses, learning rate, norms) are not kept.
METHOD_PREFIXES = ("taco/", "cgd/", "gradnorm/", "uncertainty/")


def trained_models(run_dir: str) -> list[str]:
    """Every finished model directory under `run_dir` (following the links a recipe row shares its
    warm-up through), as paths relative to it, sorted."""
    found = []
    for root, dirs, files in os.walk(run_dir, followlinks=True):
        if os.path.basename(root) == MODEL_DIR and DONE in files:
            found.append(os.path.relpath(root, run_dir))
            dirs.clear()  # a model directory holds no other model
    return sorted(found)


def training_record(run_dir: str) -> dict[str, Any]:
    """{model directory relative to the run: what it trained}, for every finished model of the run."""
    work_dir = os.path.dirname(os.path.abspath(run_dir))
    return {rel: model_record(os.path.join(run_dir, rel), work_dir) for rel in trained_models(run_dir)}


def model_record(model_dir: str, work_dir: str) -> dict[str, Any]:
    """One model's entry of `training_record` (see the module docstring)."""
    with open(os.path.join(model_dir, DONE)) as f:
        done = json.load(f)
    record: dict[str, Any] = {k: _portable(done[k], work_dir) for k in ("steps", "gin_files", "bindings") if k in done}
    config = os.path.join(model_dir, CONFIG_FILE)
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            record["operative_config"] = _portable(f.read(), work_dir)
    statistics = method_statistics(os.path.join(model_dir, METRICS_FILE))
    if statistics["steps"]:
        record["method_statistics"] = statistics
    specialisation = final_specialisation(model_dir)
    if specialisation is not None:
        record["specialisation"] = specialisation
    return record


def method_statistics(metrics_path: str) -> dict[str, Any]:
    """The multi-task method's scalars of every logged step of `metrics.jsonl`, column by column."""
    steps: list[int] = []
    values: dict[str, list[float]] = {}
    if not os.path.exists(metrics_path):
        return {"steps": steps, "values": values}
    with open(metrics_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if any(k.startswith(METHOD_PREFIXES) for k in r)]
    names = sorted({k for r in rows for k in r if k.startswith(METHOD_PREFIXES)})
    for r in rows:
        steps.append(int(r["step"]))
        for name in names:
            values.setdefault(name, []).append(float(r[name]) if name in r else float("nan"))
    return {"steps": steps, "values": values}


def final_specialisation(model_dir: str) -> dict[str, Any] | None:
    """The specialisation of the model's final multi-task state with the tau it trained with, or None
    when the run kept no state."""
    from t5_retrieval.multitask.analysis import load_state_npz, saved_tau, state_file, summarize

    path = state_file(model_dir)
    if path is None:
        return None
    saved = load_state_npz(path)
    summary = summarize(saved.arrays, saved.task_names, saved_tau(path, saved))
    return {
        **{k: summary[k] for k in ("num_params", "tau", "entropy_threshold", "task_specific_fraction",
                                   "not_activated_fraction", "mean_entropy", "max_entropy")},
        "task_names": list(saved.task_names),
        "tasks": {name: {k: task[k] for k in ("task_specific_fraction", "mean_weight")}
                  for name, task in summary["tasks"].items()},
    }


def _portable(value: Any, work_dir: str) -> Any:
    """`value` with this machine's paths (the work directory, the Python installation) replaced by
    placeholders, in strings and lists of them."""
    if isinstance(value, str):
        return value.replace(work_dir, "<work_dir>").replace(sys.prefix, "<python>")
    if isinstance(value, list):
        return [_portable(v, work_dir) for v in value]
    return value
