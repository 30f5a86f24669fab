"""`t5r results`: the mini-KILT results table, one resumable row at a time (docs/RESULTS.md).

    t5r results --data=../shared/data/mini_kilt --work_dir=/runs/results [--rows bm25,minilm_zeroshot]

Every row reads the same prepared data (KB = mini-KILT's `kb/passages.jsonl`, one passage per
paragraph, as the reference numbers use; the six tasks' train/dev examples; BM25 negatives) and
writes `<work_dir>/<row>/eval/results.json` with the KILT table of `t5r eval`. A finished stage is
marked DONE and skipped when the command is run again, so an interrupted run resumes. At the end
the page-level R-precision and recall@20 of every finished row, per task and their mean, are
printed as a Markdown table (and written to `--markdown`).

Rows:
- ``bm25``: BM25 (k1 0.9, b 0.4) over "title text", passages max-pooled to pages.
- ``minilm_zeroshot``: the installed all-MiniLM-L6-v2, no training: mean pooling + L2 norm,
  passages "{title}: {text}" truncated to 256 tokens, queries to 128, exact search (the setting of
  mini-KILT's `minilm_zeroshot_reference_dev.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from t5_retrieval import logs
from t5_retrieval.stages import DONE

log = logging.getLogger(__name__)
TASKS = ("fever", "wow", "hotpotqa", "trex", "entityquestions", "entity_linking")
COLUMNS = (("Rprec", "R-prec"), ("recall@20", "R@20"))


def prepare_data(raw_dir: str, data_dir: str) -> None:
    """KB from the paragraph passages, examples of every task, BM25 negatives (each step resumable)."""
    from t5_retrieval.data.prepare import prepare_missing

    prepare_missing(os.path.join(raw_dir, "kb", "passages.jsonl"), raw_dir, data_dir, TASKS)


def bm25_row(row_dir: str, data_dir: str) -> None:
    """BM25's top-100 passages per dev query, scored like `t5r eval`."""
    from t5_retrieval.stages import stage
    from t5_retrieval.data import layout
    from t5_retrieval.data.bm25 import BM25Index
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.negatives import bm25_query
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.retrieval.evaluate import RankingScorer, write_results

    def run() -> dict[str, Any]:
        store = PassageStore.open(layout.kb_dir(data_dir))
        index = BM25Index(store)
        scorer = RankingScorer(store)
        for task in TASKS:
            examples = read_examples(layout.examples_path(data_dir, task, "dev"))
            rankings = [[index.ids[i] for i in index.search(bm25_query(e.query), 100)[0]] for e in examples]
            scorer.add_task(task, examples, rankings)
        result = scorer.result()
        write_results(result, os.path.join(row_dir, "eval"))
        return {"tables": result.tables}

    stage(os.path.join(row_dir, "eval"), "bm25 evaluate", run)


def minilm_zeroshot_row(row_dir: str, data_dir: str) -> None:
    """The pretrained MiniLM written as a t5r model directory, then encode -> exact index -> eval."""
    from t5_retrieval.stages import index_and_evaluate, stage

    model_dir = os.path.join(row_dir, "model")
    stage(model_dir, "minilm model directory", lambda: write_minilm_model_dir(model_dir))
    index_and_evaluate(row_dir, model_dir, data_dir)


def write_minilm_model_dir(model_dir: str) -> dict[str, Any]:
    """A model directory holding all-MiniLM-L6-v2 as `t5r train --init_from` would start from it."""
    import gin
    import jax

    from t5_retrieval import checkpoint, gin_utils, sharding
    from t5_retrieval.models.pretrained import minilm_l6_dir
    from t5_retrieval.train import build_model, init_params, initial_params, model_config

    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/minilm_l6.gin"], [])
        config = model_config()
    finally:
        gin.clear_config()
    config["features"] = {"vocabulary": minilm_l6_dir(), "query_len": 128, "passage_len": 256,
                          "passage_template": "{title}: {text}",
                          "tasks": {t: {"dataset": t, "prefix": None, "index": i} for i, t in enumerate(TASKS)}}
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(0), sharding.make_mesh(), sharding.logical_axis_rules())
    params = initial_params(minilm_l6_dir(), params)
    checkpoint.write_config(model_dir, config)
    checkpoint.save(checkpoint.manager(model_dir), 0, {"params": params}, {})
    return {"init_from": minilm_l6_dir()}


ROWS: dict[str, tuple[str, Callable[[str, str], None]]] = {
    "bm25": ("BM25", bm25_row),
    "minilm_zeroshot": ("MiniLM-L6 zero-shot", minilm_zeroshot_row),
}


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
        values = {t: [tables[t][k] for k, _ in COLUMNS] for t in TASKS}
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r results", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the mini-KILT directory (../shared/data/mini_kilt)")
    parser.add_argument("--work_dir", required=True, help="where every row writes (resumed if it exists)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        print(f"t5r results: error: unknown rows {unknown}; known: {', '.join(ROWS)}", file=sys.stderr)
        return 2
    logs.setup()
    data_dir = os.path.join(args.work_dir, "data")
    prepare_data(os.path.abspath(args.data), data_dir)
    for name in rows:
        start = time.time()
        ROWS[name][1](os.path.join(args.work_dir, name), data_dir)
        log.info("results: row %s done in %.0f s", name, time.time() - start)
    table = markdown_table(args.work_dir)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(table, end="")
    return 0
