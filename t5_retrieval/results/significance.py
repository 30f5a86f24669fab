"""Seeds and intervals: paired bootstrap differences between rows.

A method's difference to a baseline is measured on the same dev queries: each query's R-precision
(or recall@20) is averaged over the method's seeds, the baseline's likewise, and the per-query
differences are resampled with replacement 100,000 times *within each task* (so every resample keeps
the task sizes), each resample giving the unweighted mean over tasks, as the table reports. The 95%
interval is the 2.5th and 97.5th percentiles of those means. A difference is called a difference
only when its interval excludes 0 ("no detectable difference" otherwise, never "equal").

With m intervals on one page, about 0.05 m of them exclude 0 by chance alone. The tables also say
which still exclude 0 at the Bonferroni level 1 - 0.05 / m, m counting every interval the page's
tables print (`page.refreshed` adds them up), from the same resamples: the percentiles
100 * 0.05 / (2 m) and 100 * (1 - 0.05 / (2 m)).

Monte-Carlo error: the percentile of B resamples moves with the bootstrap's seed, because the
number of resamples below the true q-quantile is binomial(B, q): its rank moves by
s = sqrt(B q (1 - q)). Measured on docs/RESULTS.md when it printed m = 67 intervals (B = 100,000,
20 seeds), the endpoints' standard deviation is at most 0.0001 at 95% and 0.0005 at the Bonferroni
level (about 37 resamples beyond it). An interval is on the edge (`≈0`) when 0 lies between the
resampled means EDGE_SIGMAS * s ranks either side of an endpoint: another seed could decide it the
other way, so it decides nothing.
The resamples are drawn CHUNK at a time (memory CHUNK x queries of a task, whatever B is), one
generator per task, so the result does not depend on the chunking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.data.records import DataError
from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, RunRecord

RESAMPLES = 100_000
CHUNK = 2_000  # resamples drawn at a time: memory is CHUNK x (a task's queries), whatever RESAMPLES is
BOOTSTRAP_SEED = 0
ALPHA = 0.05
# An endpoint is on the edge when 0 lies within this many binomial standard deviations of its rank.
EDGE_SIGMAS = 3.0

PerQuery = dict[str, dict[str, np.ndarray]]  # task -> metric -> one value per dev query, in file order


def seed_mean(runs: Sequence[RunRecord]) -> PerQuery:
    """Each query's score averaged over runs (seeds) of one method; the runs must score the same queries."""
    for run in runs[1:]:
        check_same_queries(run, runs[0])
    return {task: {key: np.mean([run.per_query[task][key] for run in runs], axis=0) for key, _ in METRICS}
            for task in TASKS}


def check_same_queries(a: RunRecord, b: RunRecord) -> None:
    for task in TASKS:
        if a.query_ids[task] != b.query_ids[task]:
            raise DataError(f"{a.file_name} and {b.file_name} score different {task} dev queries "
                            f"({len(a.query_ids[task])} and {len(b.query_ids[task])}): not the same data")


@dataclasses.dataclass(frozen=True)
class Difference:
    """A method minus a baseline on the unweighted mean over tasks, with its bootstrap interval;
    `edge`: an endpoint lies within the Monte-Carlo error of 0, so another bootstrap seed could
    decide the other way, and the interval decides nothing."""

    mean: float
    low: float
    high: float
    edge: bool = False

    @property
    def significant(self) -> bool:
        return not self.edge and (self.low > 0 or self.high < 0)

    @property
    def decision(self) -> str:
        return "≈0" if self.edge else "yes" if self.significant else "no"

    def __str__(self) -> str:
        mark = " ≈0" if self.edge else " *" if self.significant else ""
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]{mark}"


def resampled_means(diffs: Mapping[str, np.ndarray], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED,
                    chunk: int = CHUNK) -> np.ndarray:
    """(resamples, K): the unweighted task mean of each of the K columns of `diffs[task]` (queries x K)
    under each resample of queries within each task. The K columns share the resamples (one draw for
    a whole table), and each task draws from a generator of its own, so resample i is the same
    whatever `chunk` and K are."""
    means = np.zeros((resamples, next(iter(diffs.values())).shape[1]))
    for index, (task, diff) in enumerate(diffs.items()):
        if diff.shape[0] == 0:
            raise ValueError(f"{task}: no queries to compare")
        rng = np.random.default_rng([seed, index])
        for start in range(0, resamples, chunk):
            counts = _draw_counts(rng, min(chunk, resamples - start), diff.shape[0])
            means[start:start + chunk] += counts @ diff / diff.shape[0]
    return means / len(diffs)


def _draw_counts(rng: np.random.Generator, resamples: int, n: int) -> np.ndarray:
    """(resamples, n): how often each of n queries is drawn in each resample of n draws with replacement."""
    picks = rng.integers(0, n, size=(resamples, n), dtype=np.int32) + n * np.arange(resamples, dtype=np.int32)[:, None]
    return np.bincount(picks.ravel(), minlength=resamples * n).reshape(resamples, n).astype(np.float64)


def _order_statistic(ranked: np.ndarray, position: float) -> float:
    """The value at fractional `position` of the sorted `ranked`, interpolated as `np.percentile` does."""
    below = int(np.floor(position))
    above = min(below + 1, ranked.size - 1)
    return float(ranked[below] + (position - below) * (ranked[above] - ranked[below]))


def _endpoint(ranked: np.ndarray, q: float) -> tuple[float, float, float]:
    """The q-quantile of the resampled means and the band that holds it across bootstrap seeds: the
    number of resamples below the true quantile is binomial(B, q), so the estimate's rank moves by
    about sqrt(B q (1 - q)); the band is EDGE_SIGMAS of those either side."""
    last = ranked.size - 1
    spread = EDGE_SIGMAS * np.sqrt(ranked.size * q * (1 - q))
    estimate, low, high = (_order_statistic(ranked, float(np.clip(q * last + shift, 0, last)))
                           for shift in (0, -spread, spread))
    return estimate, low, high


def interval(ranked: np.ndarray, observed: float, alpha: float) -> Difference:
    """The 1 - `alpha` percentile interval from the sorted resampled means `ranked`, marked `edge` when
    0 lies in an endpoint's band so that the decision could flip with the bootstrap seed."""
    low, low_min, low_max = _endpoint(ranked, alpha / 2)
    high, high_min, high_max = _endpoint(ranked, 1 - alpha / 2)
    edge = low_min <= 0 < low_max or high_min < 0 <= high_max
    return Difference(observed, low, high, edge)


def intervals(diffs: Mapping[str, np.ndarray], alphas: Sequence[float], resamples: int = RESAMPLES,
              seed: int = BOOTSTRAP_SEED, chunk: int = CHUNK) -> list[list[Difference]]:
    """For each column of `diffs[task]` (queries x K), its interval at each level 1 - alpha."""
    ranked = np.sort(resampled_means(diffs, resamples, seed, chunk), axis=0)
    observed = np.mean([diff.mean(axis=0) for diff in diffs.values()], axis=0)
    return [[interval(ranked[:, k], float(observed[k]), alpha) for alpha in alphas] for k in range(ranked.shape[1])]


def paired_bootstrap(method: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray],
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED, alpha: float = ALPHA) -> Difference:
    """The task-mean of per-query differences and its 1 - `alpha` percentile interval, resampling
    queries within each task (`method[task]` and `baseline[task]` score the same queries in the same
    order)."""
    diffs = {task: _column(method[task]) - _column(baseline[task]) for task in method}
    return intervals(diffs, [alpha], resamples, seed)[0][0]


def _column(scores: np.ndarray) -> np.ndarray:
    return np.asarray(scores, dtype=np.float64).reshape(-1, 1)


def _stacked(columns: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per task, the per-query differences of each comparison side by side (queries x comparisons)."""
    return {task: np.hstack([_column(column[task]) for column in columns]) for task in columns[0]}


def bonferroni_alpha(m: int) -> float:
    """Each of m intervals at level 1 - ALPHA / m keeps the chance of any false exclusion of 0 below ALPHA."""
    return ALPHA / max(m, 1)


def bonferroni_sentence(m: int) -> str:
    """The page's multiple-comparison count, stated once: every Bonferroni column is corrected for it."""
    tail = 100 * bonferroni_alpha(m) / 2
    return (f"The tables print m = {m} bootstrap intervals; the Bonferroni columns test each at level "
            f"1 - 0.05/{m} (percentiles {tail:.3f} and {100 - tail:.3f}), "
            "so that by chance alone any of them excludes 0 with probability at most 0.05.\n")


def _pairs(records: Mapping[str, Sequence[RunRecord]], controls: Mapping[str, str]) -> list[tuple[str, str]]:
    return [(row, control) for row, control in controls.items() if records.get(row) and records.get(control)]


def differences_count(records: Mapping[str, Sequence[RunRecord]], controls: Mapping[str, str]) -> int:
    """How many intervals `differences_table` prints for these records."""
    return len(_pairs(records, controls)) * len(METRICS)


def differences_table(records: Mapping[str, Sequence[RunRecord]], titles: Mapping[str, str],
                      controls: Mapping[str, str], m: int) -> str:
    """Markdown: each recorded row's difference to its recorded control (`controls`: row -> control
    row) on mean R-precision and mean recall@20, over each side's seeds, with its 95% paired bootstrap
    interval (`*`: the interval excludes 0; `≈0`: an endpoint is within Monte-Carlo error of 0), and
    whether it still excludes 0 at the Bonferroni level over the `m` intervals of the page.
    `titles` names the rows."""
    pairs = _pairs(records, controls)
    if not pairs:
        return ""
    lines = ["| row | seeds | minus | seeds | " + " | ".join(f"mean {label}" for _, label in METRICS)
             + f" | mean {METRICS[0][1]}, seed by seed | excludes 0 after the Bonferroni correction |",
             "|---|---|---|---|" + "---|" * (len(METRICS) + 2)]
    columns = []
    for row, control in pairs:
        check_same_queries(records[row][0], records[control][0])
        method, base = seed_mean(records[row]), seed_mean(records[control])
        columns += [{task: method[task][key] - base[task][key] for task in TASKS} for key, _ in METRICS]
    found = iter(intervals(_stacked(columns), [ALPHA, bonferroni_alpha(m)]))
    for row, control in pairs:
        found_row = [next(found) for _ in METRICS]
        cells = [str(at_95) for at_95, _ in found_row]
        cells.append(" / ".join(f"{d:+.3f}" for d in seed_differences(records[row], records[control], METRICS[0][0]))
                     or "-")
        cells.append(", ".join(f"{label} {corrected.decision}"
                               for (_, label), (_, corrected) in zip(METRICS, found_row)))
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


def inputs_count(new: Mapping[str, Sequence[RunRecord]], old: Mapping[str, Sequence[RunRecord]],
                 titles: Mapping[str, str]) -> int:
    """How many intervals `inputs_table` prints for these records."""
    return len(_rows_under_both(new, old, titles))


def _rows_under_both(new: Mapping[str, Sequence[RunRecord]], old: Mapping[str, Sequence[RunRecord]],
                     titles: Mapping[str, str]) -> list[str]:
    return [row for row in titles if new.get(row) and old.get(row)]


def inputs_table(new: Mapping[str, Sequence[RunRecord]], old: Mapping[str, Sequence[RunRecord]],
                 titles: Mapping[str, str], m: int) -> str:
    """Markdown: each row recorded under both inputs, its R-precision per task and on the mean over
    tasks with the old and the new inputs (seed means), and new minus old on the mean with its paired
    95% bootstrap interval (the same dev queries, so the pairing is exact) and whether it still
    excludes 0 at the Bonferroni level over the `m` intervals of the page."""
    rows = _rows_under_both(new, old, titles)
    if not rows:
        return ""
    key, label = METRICS[0]
    lines = ["| row | inputs | seeds | " + " | ".join(f"{t} {label}" for t in TASKS)
             + f" | mean {label} | new - old, mean {label} | excludes 0 after the Bonferroni correction |",
             "|---|---|---|" + "---|" * (len(TASKS) + 3)]
    before, after = {}, {}
    for row in rows:
        check_same_queries(new[row][0], old[row][0])
        before[row], after[row] = seed_mean(old[row]), seed_mean(new[row])
    columns = [{t: after[row][t][key] - before[row][t][key] for t in TASKS} for row in rows]
    for row, (at_95, corrected) in zip(rows, intervals(_stacked(columns), [ALPHA, bonferroni_alpha(m)])):
        for name, runs, scores, cells in (("old", old[row], before[row], " | "),
                                          ("new", new[row], after[row], f"{at_95} | {corrected.decision}")):
            per_task = [float(scores[t][key].mean()) for t in TASKS]
            lines.append(f"| {titles[row]} | {name} | {len(runs)} | " + " | ".join(f"{v:.3f}" for v in per_task)
                         + f" | {np.mean(per_task):.3f} | {cells} |")
    return "\n".join(lines) + "\n"
