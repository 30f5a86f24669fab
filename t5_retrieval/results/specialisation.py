"""The specialisation table: for every recorded run whose training kept a multi-task state, whether
TACO ran as defined and how task-specific its parameters became, printed from the records alone.

A run "ran as defined" when every logged step after its first TACO update divided each task's
sensitivities by a positive median (`taco/median/<k>` > 0; a median of 0 turns the weights into a
per-parameter argmax). The specialisation numbers are the paper's Fig. 2 (entropy < 0.3 nats:
task specific; all sensitivities ~0: not activated), from the final state of the run's last
multi-task model (`provenance.final_specialisation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from t5_retrieval.results.records import RunRecord
from t5_retrieval.results.rows import ROWS
from t5_retrieval.results.tables import cell


class Specialisation(NamedTuple):
    """One run's multi-task state as its record keeps it."""

    model: str  # the model directory in the run whose state this is (the last one that kept a state)
    summary: dict[str, Any]  # `provenance.final_specialisation`
    medians: np.ndarray | None  # [logged steps after the first update, tasks]: TACO's normalisers; None if not TACO
    zero_fractions: np.ndarray | None  # the same shape: each task's fraction of exactly-zero sensitivities


def run_specialisation(record: RunRecord) -> Specialisation | None:
    """The last model of `record` that kept a multi-task state, or None (untrained rows, format-1 records)."""
    kept = [(name, model) for name, model in sorted(record.training.items())
            if isinstance(model, dict) and "specialisation" in model]
    if not kept:
        return None
    name, model = kept[-1]
    values = model.get("method_statistics", {}).get("values", {})
    medians = _taco_columns(values, "taco/median/")
    zeros = _taco_columns(values, "taco/zero_fraction/")
    if medians is not None and zeros is not None:
        updated = np.asarray(values["taco/step"]) > 0  # before the first update nothing was divided
        medians, zeros = medians[updated], zeros[updated]
    return Specialisation(name, model["specialisation"], medians, zeros)


def _taco_columns(values: Mapping[str, Sequence[float]], prefix: str) -> np.ndarray | None:
    """[steps, tasks] of the logged `<prefix><k>` columns, or None when TACO logged none."""
    names = sorted((n for n in values if n.startswith(prefix)), key=lambda n: int(n[len(prefix):]))
    if not names or "taco/step" not in values:
        return None
    return np.stack([np.asarray(values[n], dtype=np.float64) for n in names], axis=1)


def ran_as_defined(spec: Specialisation) -> bool | None:
    """Whether every task's median was positive at every logged step after the first update; None
    when the state is not TACO's or nothing was logged after an update."""
    if spec.medians is None or spec.medians.size == 0:
        return None
    return bool(np.all(spec.medians > 0))


def specialisation_table(records: Mapping[str, Sequence[RunRecord]]) -> str:
    """Markdown: one line per recorded row that kept a multi-task state, in catalogue order; cells are
    the mean +- standard deviation over its seeds."""
    lines = []
    for name in [n for n in ROWS if n in records]:
        specs = [s for s in (run_specialisation(r) for r in records[name]) if s is not None]
        if not specs:
            continue
        defined = [ran_as_defined(s) for s in specs]
        if all(d is None for d in defined):
            medians = "not TACO's"
        else:
            medians = (f"{sum(bool(d) for d in defined)} of {len(specs)} runs; smallest "
                       f"{min(float(s.medians.min()) for s in specs if s.medians is not None and s.medians.size):.1e}")
        zeros = max((float(s.zero_fractions.max()) for s in specs if s.zero_fractions is not None
                     and s.zero_fractions.size), default=float("nan"))
        tau = sorted({s.summary["tau"] for s in specs})
        lines.append(
            f"| {ROWS[name][0]} | {len(specs)} | {', '.join(f'{t:g}' for t in tau)} | {medians} | "
            + (f"{zeros:.1e}" if np.isfinite(zeros) else "—") + " | "
            + cell([100 * s.summary["task_specific_fraction"] for s in specs]) + "% | "
            + cell([100 * s.summary["not_activated_fraction"] for s in specs]) + "% | "
            + cell([s.summary["mean_entropy"] for s in specs]) + f" ({specs[0].summary['max_entropy']:.3f}) |")
    if not lines:
        return ""
    header = ("| row | seeds | tau | median > 0 at every logged step | largest zero fraction | "
              "task specific (entropy < 0.3) | not activated | mean entropy (max) |")
    return "\n".join([header, "|---|---|---|---|---|---|---|---|", *lines]) + "\n"
