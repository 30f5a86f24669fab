"""The main results table: page-level R-precision and recall@20 per task, one line per recorded row."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, RunRecord
from t5_retrieval.results.rows import ROWS


def markdown_table(records: Mapping[str, Sequence[RunRecord]]) -> str:
    """Page-level R-precision / recall@20 per task and their unweighted mean, one line per recorded
    row, in the order of the row catalogue.

    When a row ran with several seeds, a seeds column appears and that row's cells show mean +-
    standard deviation (ddof 1) over its seeds, and the wall time of one seed on average.
    """
    with_seeds = any(len(runs) > 1 for runs in records.values())
    header = ("| row | " + " | ".join(f"{t} {c}" for t in (*TASKS, "mean") for _, c in METRICS)
              + (" | seeds" if with_seeds else "") + " | wall time |")
    lines = [header, "|" + "---|" * (2 + with_seeds + 2 * (len(TASKS) + 1))]
    for name in [n for n in ROWS if n in records] + sorted(n for n in records if n not in ROWS):
        runs = records[name]
        if not runs:
            continue
        cells = [cell([run.table[t][key] for run in runs]) for t in TASKS for key, _ in METRICS]
        cells += [cell([run.mean(key) for run in runs]) for key, _ in METRICS]
        if with_seeds:
            cells.append(str(len(runs)))
        seconds = np.mean([run.seconds for run in runs])
        title = ROWS[name][0] if name in ROWS else name
        lines.append(f"| {title} | " + " | ".join(cells) + f" | {seconds:.0f} s |")
    return "\n".join(lines) + "\n"


def cell(values: list[float]) -> str:
    """One value as 0.123, several as their mean +- sample standard deviation."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}"
