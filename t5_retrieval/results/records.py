"""Run records: what one finished run of a row contributes to the tables, small enough to keep.

A record holds a run's KILT table (R-precision and recall@20 per task, as `t5r eval` wrote it), its
wall time, how it was trained (every model's gin config, its multi-task method's statistics and
final specialisation: `provenance`), and every dev query's R-precision and recall@20 (what the paired
bootstrap resamples). `t5r results` writes one per finished run, `<records_dir>/<row>-seed<k>.json.gz`
(~20 KB for mini-KILT's 2,041 dev queries), and builds its tables from a directory of them, so runs
made at different times or on different machines add up to one table. docs/run_records/mini_kilt/
holds the records behind docs/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from typing import Any

import numpy as np

from t5_retrieval.artefact_io import open_replaced_on_success
from t5_retrieval.data.records import DataError
from t5_retrieval.results.common import TASKS, dataset_name, dataset_table
from t5_retrieval.results.provenance import training_record
from t5_retrieval.stages import DONE

FORMAT = 2  # 2: `training` holds every model of the run (`provenance`); 1 held the top model's DONE fields
READABLE_FORMATS = (1, FORMAT)
METRICS = (("Rprec", "R-prec"), ("recall@20", "R@20"))  # key in the KILT table, column label


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One run (`row` trained with `seed`) scored on the dev queries of the six tasks."""

    row: str
    seed: int
    seconds: float  # the sum of the run's recorded stage durations
    table: dict[str, dict[str, float]]  # task -> metric -> value over the task's dev queries
    query_ids: dict[str, list[str]]  # task -> dev query ids, in dev file order
    per_query: dict[str, dict[str, np.ndarray]]  # task -> metric -> one value per query of query_ids
    # Format 2: {model directory in the run: what it trained} (`provenance.training_record`); format 1:
    # the top model's steps, gin files and bindings. {} for untrained rows.
    training: dict[str, Any]

    @property
    def file_name(self) -> str:
        return f"{self.row}-seed{self.seed}.json.gz"

    def mean(self, metric: str) -> float:
        """The unweighted mean over tasks of the table's `metric`, as the results table reports it."""
        return float(np.mean([self.table[t][metric] for t in TASKS]))


def seed_dir(work_dir: str, row: str, seed: int) -> str:
    """Where a row's run with `seed` writes: `<row>` for seed 0, `<row>-seed<k>` beside it otherwise."""
    return os.path.join(work_dir, row if seed == 0 else f"{row}-seed{seed}")


def record_run(run_dir: str, data_dir: str, row: str, seed: int) -> RunRecord:
    """The record of a finished run: its `eval/results.json`, its stage times, and every dev query's
    scores recomputed from its KILT predictions against the gold pages of `data_dir`'s dev examples."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.retrieval import metrics

    results = os.path.join(run_dir, "eval", "results.json")
    if not os.path.exists(results):
        raise FileNotFoundError(f"{run_dir}: not finished (no eval/results.json)")
    with open(results) as f:
        tables = json.load(f)
    table = {t: {key: float(dataset_table(tables, t)[key]) for key, _ in METRICS} for t in TASKS}
    query_ids, per_query = {}, {}
    for task in TASKS:
        predictions = _predictions_file(run_dir, task)
        pages_by_id = {}
        with open(predictions, encoding="utf-8") as f:
            for line in f:
                prediction = json.loads(line)
                pages_by_id[str(prediction["id"])] = [p["wikipedia_id"] for p in prediction["output"][0]["provenance"]]
        examples = read_examples(layout.examples_path(data_dir, task, "dev"))
        missing = [e.id for e in examples if e.id not in pages_by_id]
        if missing:
            raise DataError(f"{predictions}: no prediction for {len(missing)} dev queries (first: {missing[0]!r})")
        scores = [metrics.kilt_scores(e.gold_pages, pages_by_id[e.id], ks=(20,)) for e in examples]
        query_ids[task] = [e.id for e in examples]
        per_query[task] = {key: np.array([s[key] for s in scores], dtype=np.float64) for key, _ in METRICS}
    return RunRecord(row, seed, run_seconds(run_dir), table, query_ids, per_query, training_record(run_dir))


def _predictions_file(run_dir: str, task: str) -> str:
    """`<run>/eval/predictions/<task>.jsonl`, or `<run>/<task>/eval/predictions/` for one model per task."""
    for directory in (os.path.join(run_dir, "eval", "predictions"), os.path.join(run_dir, task, "eval", "predictions")):
        names = [os.path.basename(p)[:-len(".jsonl")] for p in glob.glob(os.path.join(directory, "*.jsonl"))]
        if names:
            try:
                return os.path.join(directory, dataset_name(names, task) + ".jsonl")
            except KeyError:
                continue
    raise FileNotFoundError(f"{run_dir}: no KILT predictions for {task} (eval/predictions/<task>.jsonl)")


def run_seconds(run_dir: str) -> float:
    """Wall time of a run: the sum of its stages' recorded durations (stages it shares with another
    row through a link, as the recipe pairs do, count in both)."""
    total = 0.0
    for root, _, files in os.walk(run_dir, followlinks=True):
        if DONE in files:
            with open(os.path.join(root, DONE)) as f:
                total += float(json.load(f).get("seconds", 0.0))
    return total


def write_record(record: RunRecord, records_dir: str) -> str:
    """Writes `<records_dir>/<row>-seed<k>.json.gz` atomically (replacing an older record of the run)."""
    os.makedirs(records_dir, exist_ok=True)
    doc = {"format": FORMAT, "row": record.row, "seed": record.seed, "seconds": round(record.seconds, 1),
           "training": record.training, "table": record.table,
           "queries": {t: {"id": record.query_ids[t], **{k: record.per_query[t][k].tolist() for k, _ in METRICS}}
                       for t in TASKS}}
    path = os.path.join(records_dir, record.file_name)
    # mtime=0 and sorted keys: the same run always gives the same bytes.
    with open_replaced_on_success(path, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
            f.write(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    return path


def read_record(path: str) -> RunRecord:
    """A record written by `write_record`; a clear error names the file when it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a run record ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") not in READABLE_FORMATS:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise DataError(f"{path}: run record format {found!r}, this version reads {READABLE_FORMATS}")
    try:
        queries = doc["queries"]
        return RunRecord(doc["row"], int(doc["seed"]), float(doc["seconds"]),
                         {t: {k: float(doc["table"][t][k]) for k, _ in METRICS} for t in TASKS},
                         {t: [str(i) for i in queries[t]["id"]] for t in TASKS},
                         {t: {k: np.asarray(queries[t][k], dtype=np.float64) for k, _ in METRICS} for t in TASKS},
                         dict(doc.get("training", {})))
    except KeyError as e:
        raise DataError(f"{path}: run record without field {e}") from e


def read_records(records_dir: str) -> dict[str, list[RunRecord]]:
    """Every record in `records_dir`, by row, each row's runs in increasing seed order."""
    records: dict[str, list[RunRecord]] = {}
    for path in sorted(glob.glob(os.path.join(records_dir, "*-seed*.json.gz"))):
        record = read_record(path)
        records.setdefault(record.row, []).append(record)
    return {row: sorted(runs, key=lambda r: r.seed) for row, runs in records.items()}
