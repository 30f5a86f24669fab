"""Dev queries that are also training queries, and every row's mean without them.

mini-KILT's dev files hold a few queries whose text is a training query's too (63 of 2,041: FEVER
claims, templated entity questions, entity-linking documents). A trained row may have seen their
gold pages; the zero-shot row and BM25 cannot have. This is measured on the files (the text as
`data.text.normalize_query` reads it), recorded beside the run records, and the table shows each
row's mean with and without those queries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

from t5_retrieval.results.common import TASKS
from t5_retrieval.results.records import METRICS, RunRecord

OVERLAP_FILE = "dev_train_overlap.json"  # in the records directory: {task: [dev ids]}


def dev_train_overlap(data_dir: str) -> dict[str, list[str]]:
    """Per task, the dev example ids whose normalised query text is also a training query's."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.text import normalize_query

    overlap = {}
    for task in TASKS:
        train = {normalize_query(e.query) for e in read_examples(layout.examples_path(data_dir, task, "train"))}
        overlap[task] = [e.id for e in read_examples(layout.examples_path(data_dir, task, "dev"))
                         if normalize_query(e.query) in train]
    return overlap


def write_overlap(data_dir: str, records_dir: str) -> None:
    os.makedirs(records_dir, exist_ok=True)
    with open(os.path.join(records_dir, OVERLAP_FILE), "w", encoding="utf-8") as f:
        json.dump(dev_train_overlap(data_dir), f, indent=1, sort_keys=True)


def read_overlap(records_dir: str) -> dict[str, list[str]] | None:
    path = os.path.join(records_dir, OVERLAP_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def mean_without(run: RunRecord, dropped: Mapping[str, Sequence[str]], metric: str) -> float:
    """The unweighted mean over tasks of `metric`, each task's mean over its dev queries not dropped."""
    means = []
    for task in TASKS:
        drop = set(dropped.get(task, ()))
        keep = np.array([qid not in drop for qid in run.query_ids[task]])
        means.append(float(run.per_query[task][metric][keep].mean()))
    return float(np.mean(means))


def overlap_table(records: Mapping[str, Sequence[RunRecord]], titles: Mapping[str, str],
                  overlap: Mapping[str, Sequence[str]]) -> str:
    """Markdown: every recorded row's mean R-precision and recall@20 over all dev queries and over
    those whose text is no training query's (seed means, as the main table)."""
    counts = ", ".join(f"{task} {len(overlap.get(task, ()))}" for task in TASKS if overlap.get(task))
    total = sum(len(v) for v in overlap.values())
    lines = [f"Dev queries that are also training queries: {total} ({counts}).", "",
             "| row | " + " | ".join(f"mean {label}, all | without them" for _, label in METRICS) + " |",
             "|---|" + "---|---|" * len(METRICS)]
    for row in [r for r in titles if records.get(r)] + sorted(r for r in records if r not in titles and records[r]):
        runs = records[row]
        cells = [f"{np.mean([run.mean(key) for run in runs]):.3f} | "
                 f"{np.mean([mean_without(run, overlap, key) for run in runs]):.3f}" for key, _ in METRICS]
        lines.append(f"| {titles.get(row, row)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
