"""The warm-up curve: TACO against naive in the frozen recipe's last episode, one line per warm-up.

Each point is a pair of rows that share their warm-up and first episode and differ in the last
episode's method alone (both track the same EMA of task sensitivities, so both have a
specialisation summary). A line gives each side's mean R-precision, TACO - naive with its paired
bootstrap interval (`significance`), and each side's specialisation (the paper's Fig. 2: task
specific = weight entropy < 0.3 nats), printed from the records alone. A point whose naive run has
no record yet prints TACO's side only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.results.minilm_rows import WARMUP_CURVE_EPOCHS, epochs_in_steps
from t5_retrieval.results.records import METRICS, RunRecord
from t5_retrieval.results.significance import (
    ALPHA,
    bonferroni_alpha,
    check_same_queries,
    intervals,
    seed_differences,
    seed_mean,
)
from t5_retrieval.results.specialisation import run_specialisation
from t5_retrieval.results.tables import cell

# (warm-up label, TACO row, naive row), shortest warm-up first; the recipe rows warm up for 200 steps.
POINTS = (("0.7 (200 steps)", "taco_recipe_frozen", "naive_recipe_frozen"),
          *((f"{epochs} ({epochs_in_steps(epochs)} steps)", f"taco_recipe_frozen_warmup_{epochs}ep",
             f"naive_recipe_frozen_warmup_{epochs}ep") for epochs in WARMUP_CURVE_EPOCHS))
R_PRECISION = METRICS[0][0]


def _paired(records: Mapping[str, Sequence[RunRecord]]) -> list[tuple[str, str]]:
    return [(taco, naive) for _, taco, naive in POINTS if records.get(taco) and records.get(naive)]


def curve_count(records: Mapping[str, Sequence[RunRecord]]) -> int:
    """How many intervals `curve_table` prints: one per point with both sides recorded."""
    return len(_paired(records))


def _specialised(runs: Sequence[RunRecord]) -> str:
    """Task-specific share and mean entropy over the runs' final states, or "—" (records before format 2)."""
    specs = [s for s in map(run_specialisation, runs) if s is not None]
    if not specs:
        return "—"
    return (cell([100 * s.summary["task_specific_fraction"] for s in specs]) + "%, "
            + cell([s.summary["mean_entropy"] for s in specs]))


def _mean(runs: Sequence[RunRecord]) -> str:
    return cell([run.mean(R_PRECISION) for run in runs]) if runs else "—"


def curve_table(records: Mapping[str, Sequence[RunRecord]], m: int) -> str:
    """Markdown: one line per warm-up with a TACO record, shortest first; the interval is 95% (`*`:
    it excludes 0), and whether it still excludes 0 at the Bonferroni level over the page's `m`."""
    pairs = _paired(records)
    diffs = []
    for taco, naive in pairs:
        check_same_queries(records[taco][0], records[naive][0])
        a, b = seed_mean(records[taco]), seed_mean(records[naive])
        diffs.append({task: a[task][R_PRECISION] - b[task][R_PRECISION] for task in a})
    found = {}
    if diffs:  # the points share the bootstrap's resamples, as the differences table's rows do
        stacked = {task: np.stack([d[task] for d in diffs], axis=1) for task in diffs[0]}
        found = dict(zip(pairs, intervals(stacked, [ALPHA, bonferroni_alpha(m)])))
    lines = []
    for label, taco, naive in POINTS:
        if not records.get(taco):
            continue
        runs, controls = records[taco], records.get(naive, [])
        if (taco, naive) in found:
            at_95, corrected = found[taco, naive]
            by_seed = " / ".join(f"{d:+.3f}" for d in seed_differences(runs, controls, R_PRECISION))
            difference = f"{at_95} | {by_seed} | {corrected.decision}"
        else:
            difference = "— | — | —"
        lines.append(f"| {label} | {len(runs)} / {len(controls)} | {_mean(runs)} | {_mean(controls)} | {difference} | "
                     f"{_specialised(runs)} | {_specialised(controls)} |")
    if not lines:
        return ""
    header = ("| warm-up (epochs) | seeds (TACO / naive) | TACO mean R-prec | naive mean R-prec | "
              "TACO - naive, 95% interval | seed by seed | excludes 0 after the Bonferroni correction | "
              "TACO: task specific, mean entropy | naive: task specific, mean entropy |")
    return "\n".join([header, "|---|---|---|---|---|---|---|---|---|", *lines]) + "\n"
