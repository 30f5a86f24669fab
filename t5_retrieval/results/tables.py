"""The main results table: page-level R-precision and recall@20 per task, one line per finished row."""

from __future__ import annotations

import json
import os

from t5_retrieval.results.common import TASKS, dataset_table
from t5_retrieval.results.rows import ROWS
from t5_retrieval.stages import DONE


COLUMNS = (("Rprec", "R-prec"), ("recall@20", "R@20"))


def markdown_table(work_dir: str) -> str:
    """Page-level R-precision / recall@20 per task and their unweighted mean, one line per finished row."""
    header = "| row | " + " | ".join(f"{t} {c}" for t in (*TASKS, "mean") for _, c in COLUMNS) + " | wall time |"
    lines = [header, "|" + "---|" * (2 + 2 * (len(TASKS) + 1))]
    for name, (title, _) in ROWS.items():
        path = os.path.join(work_dir, name, "eval", "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            tables = json.load(f)
        values = {t: [dataset_table(tables, t)[k] for k, _ in COLUMNS] for t in TASKS}
        values["mean"] = [sum(values[t][i] for t in TASKS) / len(TASKS) for i in range(len(COLUMNS))]
        cells = [f"{v:.3f}" for t in (*TASKS, "mean") for v in values[t]]
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {row_seconds(os.path.join(work_dir, name)):.0f} s |")
    return "\n".join(lines) + "\n"


def row_seconds(row_dir: str) -> float:
    """Wall time of a row: the sum of its stages' recorded durations."""
    total = 0.0
    for root, _, files in os.walk(row_dir):
        if DONE in files:
            with open(os.path.join(root, DONE)) as f:
                total += float(json.load(f).get("seconds", 0.0))
    return total
