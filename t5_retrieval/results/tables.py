"""The main results table: page-level R-precision and recall@20 per task, one line per finished row."""

from __future__ import annotations

import json
import os

import numpy as np

from t5_retrieval.results.common import TASKS, dataset_table
from t5_retrieval.results.rows import ROWS
from t5_retrieval.results.significance import finished_seeds, seed_dir
from t5_retrieval.stages import DONE


COLUMNS = (("Rprec", "R-prec"), ("recall@20", "R@20"))


def markdown_table(work_dir: str) -> str:
    """Page-level R-precision / recall@20 per task and their unweighted mean, one line per finished row.

    When a row ran with several seeds, a seeds column appears and that row's cells show mean +-
    standard deviation (ddof 1) over its finished seeds, and the wall time of one seed on average.
    """
    finished = {name: finished_seeds(work_dir, name) for name in ROWS}
    with_seeds = any(len(seeds) > 1 for seeds in finished.values())
    header = ("| row | " + " | ".join(f"{t} {c}" for t in (*TASKS, "mean") for _, c in COLUMNS)
              + (" | seeds" if with_seeds else "") + " | wall time |")
    lines = [header, "|" + "---|" * (2 + with_seeds + 2 * (len(TASKS) + 1))]
    for name, (title, _) in ROWS.items():
        seeds = finished[name]
        if not seeds:
            continue
        runs = []
        for seed in seeds:
            with open(os.path.join(seed_dir(work_dir, name, seed), "eval", "results.json")) as f:
                tables = json.load(f)
            values = {t: [dataset_table(tables, t)[k] for k, _ in COLUMNS] for t in TASKS}
            values["mean"] = [sum(values[t][i] for t in TASKS) / len(TASKS) for i in range(len(COLUMNS))]
            runs.append(values)
        cells = [cell([run[t][i] for run in runs]) for t in (*TASKS, "mean") for i in range(len(COLUMNS))]
        if with_seeds:
            cells.append(str(len(seeds)))
        seconds = np.mean([row_seconds(seed_dir(work_dir, name, s)) for s in seeds])
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {seconds:.0f} s |")
    return "\n".join(lines) + "\n"


def cell(values: list[float]) -> str:
    """One value as 0.123, several as their mean +- sample standard deviation."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"


def row_seconds(row_dir: str) -> float:
    """Wall time of a row: the sum of its stages' recorded durations."""
    total = 0.0
    for root, _, files in os.walk(row_dir):
        if DONE in files:
            with open(os.path.join(root, DONE)) as f:
                total += float(json.load(f).get("seconds", 0.0))
    return total
