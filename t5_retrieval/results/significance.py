"""Seeds and intervals: per-query scores of a row's runs, and paired bootstrap differences between rows.

A method's difference to a baseline is measured on the same dev queries: each query's R-precision
(or recall@20) is averaged over the method's seeds, the baseline's likewise, and the per-query
differences are resampled with replacement 1,000 times *within each task* (so every resample keeps
the task sizes), each resample giving the unweighted mean over tasks, as the table reports. The 95%
interval is the 2.5th and 97.5th percentiles of those means. A difference is called a difference
only when its interval excludes 0.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.results.common import TASKS, dataset_name

METRICS = (("Rprec", "R-prec"), ("recall@20", "R@20"))
RESAMPLES = 1000
BOOTSTRAP_SEED = 0

PerQuery = dict[str, dict[str, np.ndarray]]  # task -> metric -> one value per dev query, in file order


def seed_dir(work_dir: str, row: str, seed: int) -> str:
    """Where a row's run with `seed` writes: `<row>` for seed 0, `<row>-seed<k>` beside it otherwise."""
    return os.path.join(work_dir, row if seed == 0 else f"{row}-seed{seed}")


def finished_seeds(work_dir: str, row: str) -> list[int]:
    """The seeds whose run of `row` has a results table, in increasing order."""
    seeds = [0] if os.path.exists(os.path.join(work_dir, row, "eval", "results.json")) else []
    for path in glob.glob(os.path.join(work_dir, f"{glob.escape(row)}-seed*", "eval", "results.json")):
        match = re.fullmatch(rf"{re.escape(row)}-seed(\d+)", os.path.basename(os.path.dirname(os.path.dirname(path))))
        if match:
            seeds.append(int(match.group(1)))
    return sorted(seeds)


def per_query_scores(run_dir: str, data_dir: str) -> PerQuery:
    """Page-level R-precision and recall@20 of every dev query of every task, recomputed from the run's
    KILT prediction files (`<run>/eval/predictions/`, or `<run>/<task>/eval/predictions/` for a row of
    one model per task) against the gold pages of `<data_dir>`'s dev examples."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.retrieval import metrics

    out: PerQuery = {}
    for task in TASKS:
        predictions = _predictions_file(run_dir, task)
        pages_by_id = {}
        with open(predictions, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                pages_by_id[str(row["id"])] = [p["wikipedia_id"] for p in row["output"][0]["provenance"]]
        examples = read_examples(layout.examples_path(data_dir, task, "dev"))
        missing = [e.id for e in examples if e.id not in pages_by_id]
        if missing:
            raise ValueError(f"{predictions}: no prediction for {len(missing)} dev queries (first: {missing[0]!r})")
        scores = [metrics.kilt_scores(e.gold_pages, pages_by_id[e.id], ks=(20,)) for e in examples]
        out[task] = {key: np.array([s[key] for s in scores]) for key, _ in METRICS}
    return out


def _predictions_file(run_dir: str, task: str) -> str:
    for directory in (os.path.join(run_dir, "eval", "predictions"), os.path.join(run_dir, task, "eval", "predictions")):
        if os.path.isdir(directory):
            names = [os.path.basename(p)[:-len(".jsonl")] for p in glob.glob(os.path.join(directory, "*.jsonl"))]
            try:
                return os.path.join(directory, dataset_name(names, task) + ".jsonl")
            except KeyError:
                continue
    raise FileNotFoundError(f"{run_dir}: no KILT predictions for {task} (eval/predictions/<task>.jsonl)")


def seed_mean(runs: Sequence[PerQuery]) -> PerQuery:
    """Each query's score averaged over runs (seeds) of one method."""
    return {task: {key: np.mean([run[task][key] for run in runs], axis=0) for key in runs[0][task]}
            for task in runs[0]}


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
                     resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Difference:
    """The task-mean of per-query differences and its 95% percentile interval, resampling queries
    within each task (`method[task]` and `baseline[task]` score the same queries in the same order)."""
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
    low, high = np.percentile(means, [2.5, 97.5])
    return Difference(float(np.mean(observed)), float(low), float(high))


def differences_table(work_dir: str, data_dir: str, rows: Mapping[str, str], baselines: Sequence[str]) -> str:
    """Markdown: each row's difference to each baseline on mean R-precision and mean recall@20, with
    95% paired bootstrap intervals (`*`: the interval excludes 0). `rows` maps names to titles."""
    scores = {}
    for name in rows:
        seeds = finished_seeds(work_dir, name)
        if seeds:
            scores[name] = (len(seeds), seed_mean([per_query_scores(seed_dir(work_dir, name, s), data_dir)
                                                   for s in seeds]))
    baselines = [b for b in baselines if b in scores]
    if not baselines:
        return ""
    header = "| row | seeds | " + " | ".join(f"{label} - {rows[b]}" for b in baselines for _, label in METRICS) + " |"
    lines = [header, "|---|---|" + "---|" * (len(baselines) * len(METRICS))]
    for name, (num_seeds, per_query) in scores.items():
        cells = []
        for base in baselines:
            for key, _ in METRICS:
                cells.append("-" if name == base else str(paired_bootstrap(
                    {t: per_query[t][key] for t in TASKS}, {t: scores[base][1][t][key] for t in TASKS})))
        lines.append(f"| {rows[name]} | {num_seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
