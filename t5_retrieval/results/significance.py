"""Seeds and intervals: paired bootstrap differences between rows.

A method's difference to a baseline is measured on the same dev queries: each query's R-precision
(or recall@20) is averaged over the method's seeds, the baseline's likewise, and the per-query
differences are resampled with replacement 1,000 times *within each task* (so every resample keeps
the task sizes), each resample giving the unweighted mean over tasks, as the table reports. The 95%
interval is the 2.5th and 97.5th percentiles of those means. A difference is called a difference
only when its interval excludes 0 ("no detectable difference" otherwise, never "equal").

With m intervals on one page, about 0.05 m of them exclude 0 by chance alone. The table also says
which still exclude 0 at the Bonferroni level 1 - 0.05 / m (each interval from its own 10,000
resamples, between the percentiles 100 * 0.05 / (2 m) and 100 * (1 - 0.05 / (2 m))).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.data.records import DataError
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, RunRecord

RESAMPLES = 1000
BOOTSTRAP_SEED = 0
ALPHA = 0.05
# A Bonferroni interval sits at alpha / (2 m) in each tail, the 0.1st percentile for ~26 intervals:
# 10,000 resamples put about ten of them beyond it.
CORRECTED_RESAMPLES = 10_000

PerQuery = dict[str, dict[str, np.ndarray]]  # task -> metric -> one value per dev query, in file order


def seed_mean(runs: Sequence[RunRecord]) -> PerQuery:
    """Each query's score averaged over runs (seeds) of one method; the runs must score the same queries."""
    for run in runs[1:]:
        _check_same_queries(run, runs[0])
    return {task: {key: np.mean([run.per_query[task][key] for run in runs], axis=0) for key, _ in METRICS}
            for task in TASKS}


def _check_same_queries(a: RunRecord, b: RunRecord) -> None:
    for task in TASKS:
        if a.query_ids[task] != b.query_ids[task]:
            raise DataError(f"{a.file_name} and {b.file_name} score different {task} dev queries "
                            f"({len(a.query_ids[task])} and {len(b.query_ids[task])}): not the same data")


@dataclasses.dataclass(frozen=True)
class Difference:
    """A method minus a baseline on the unweighted mean over tasks, with its bootstrap interval."""

    mean: float
    low: float
    high: float

    @property
    def significant(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]" + (" *" if self.significant else "")


def paired_bootstrap(method: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray],
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, alpha: float = ALPHA) -> Difference:
    """The task-mean of per-query differences and its 1 - `alpha` percentile interval, resampling
    queries within each task (`method[task]` and `baseline[task]` score the same queries in the same
    order)."""
    rng = np.random.default_rng(seed)
    task_means = np.zeros((resamples, len(method)))
    observed = []
    for column, task in enumerate(method):
        diff = np.asarray(method[task], dtype=np.float64) - np.asarray(baseline[task], dtype=np.float64)
        if diff.size == 0:
            raise ValueError(f"{task}: no queries to compare")
        observed.append(diff.mean())
        task_means[:, column] = diff[rng.integers(0, diff.size, size=(resamples, diff.size))].mean(axis=1)
    means = task_means.mean(axis=1)
    low, high = np.percentile(means, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return Difference(float(np.mean(observed)), float(low), float(high))


def differences_table(records: Mapping[str, Sequence[RunRecord]], titles: Mapping[str, str],
                      controls: Mapping[str, str]) -> str:
    """Markdown: each recorded row's difference to its recorded control (`controls`: row -> control
    row) on mean R-precision and mean recall@20, over each side's seeds, with its 95% paired bootstrap
    interval (`*`: the interval excludes 0), and whether it still excludes 0 after a Bonferroni
    correction over the page's intervals. `titles` names the rows."""
    pairs = [(row, control) for row, control in controls.items() if records.get(row) and records.get(control)]
    if not pairs:
        return ""
    m = len(pairs) * len(METRICS)  # the intervals on the page
    lines = ["| row | seeds | minus | seeds | " + " | ".join(f"mean {label}" for _, label in METRICS)
             + f" | mean {METRICS[0][1]}, seed by seed | excludes 0 at 1 - 0.05/{m} (Bonferroni) |",
             "|---|---|---|---|" + "---|" * (len(METRICS) + 2)]
    for row, control in pairs:
        _check_same_queries(records[row][0], records[control][0])
        method, base = seed_mean(records[row]), seed_mean(records[control])
        cells, corrected = [], []
        for key, label in METRICS:
            ours, theirs = {t: method[t][key] for t in TASKS}, {t: base[t][key] for t in TASKS}
            cells.append(str(paired_bootstrap(ours, theirs)))
            strict = paired_bootstrap(ours, theirs, CORRECTED_RESAMPLES, alpha=ALPHA / m)
            corrected.append(f"{label} {'yes' if strict.significant else 'no'}")
        cells.append(" / ".join(f"{d:+.3f}" for d in seed_differences(records[row], records[control], METRICS[0][0]))
                     or "-")
        cells.append(", ".join(corrected))
        lines.append(f"| {titles[row]} | {len(records[row])} | {titles[control]} | {len(records[control])} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seed_differences(runs: Sequence[RunRecord], controls: Sequence[RunRecord], metric: str) -> list[float]:
    """The method's mean over tasks minus its control's, for each seed both ran (in seed order).

    A seed fixes the data order and the new parameters' initialisation for the method and its control
    alike, so seed k of one is paired with seed k of the other. The bootstrap interval averages the
    seeds away and measures only which dev queries were drawn; these differences show the spread that
    training noise adds, and whether the sign holds from seed to seed."""
    control_by_seed = {run.seed: run for run in controls}
    return [run.mean(metric) - control_by_seed[run.seed].mean(metric) for run in runs if run.seed in control_by_seed]


def inputs_table(new: Mapping[str, Sequence[RunRecord]], old: Mapping[str, Sequence[RunRecord]],
                 titles: Mapping[str, str]) -> str:
    """Markdown: each row recorded under both inputs, its R-precision per task and on the mean over
    tasks with the old and the new inputs (seed means), and new minus old on the mean with its paired
    95% bootstrap interval (the same dev queries, so the pairing is exact)."""
    rows = [row for row in titles if new.get(row) and old.get(row)]
    if not rows:
        return ""
    key, label = METRICS[0]
    lines = ["| row | inputs | seeds | " + " | ".join(f"{t} {label}" for t in TASKS)
             + f" | mean {label} | new - old, mean {label} |",
             "|---|---|---|" + "---|" * (len(TASKS) + 2)]
    for row in rows:
        _check_same_queries(new[row][0], old[row][0])
        before, after = seed_mean(old[row]), seed_mean(new[row])
        difference = paired_bootstrap({t: after[t][key] for t in TASKS}, {t: before[t][key] for t in TASKS})
        for name, runs, scores, cell in (("old", old[row], before, ""), ("new", new[row], after, str(difference))):
            per_task = [float(scores[t][key].mean()) for t in TASKS]
            lines.append(f"| {titles[row]} | {name} | {len(runs)} | " + " | ".join(f"{v:.3f}" for v in per_task)
                         + f" | {np.mean(per_task):.3f} | {cell} |")
    return "\n".join(lines) + "\n"
