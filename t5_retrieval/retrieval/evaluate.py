"""Evaluation: retrieve top passages per query, map them to pages, score with the KILT metrics.

Per task this reports page-level R-precision, precision@k, recall@k and success_rate@k exactly as
the official KILT scorer (`metrics.kilt_scores`), plus passage-level R-precision (examples with
gold passages) and answer-in-passage recall@k (examples with answer strings, for tasks whose
answers are strings to find: not FEVER labels nor WoW replies). Every example of a task counts in
its means, one without gold provenance scoring 0, as in the official scorer (the examples carry
the gold sets `data.kilt` read by its rules). It also writes the predictions in
the official KILT format, so `kilt/eval_retrieval.py` can re-score them independently.

`t5r eval --index_dir=... --data_dir=... --output_dir=... (--checkpoint_dir=... | --lexical_baseline_dim=N)`
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.records import Example, write_json_atomic, write_jsonl_atomic, write_text_atomic
from t5_retrieval.retrieval import metrics
from t5_retrieval.retrieval.encoder import Encoder, add_encoder_flags, encoder_from_flags
from t5_retrieval.retrieval.index import Index, IndexMismatchError
from t5_retrieval.retrieval.passages import PassageLookup


def retrieve(encoder: Encoder, index: Index, queries: Sequence[str], task: str, k: int,
             batch_size: int = 128) -> list[tuple[list[str], np.ndarray]]:
    """Top-k (passage ids, scores) per query, best first, encoding queries in batches."""
    out: list[tuple[list[str], np.ndarray]] = []
    for start in range(0, len(queries), batch_size):
        vectors = encoder.encode_queries(list(queries[start:start + batch_size]), task)
        rows, scores = index.search(np.asarray(vectors, np.float32), k)
        out += [([index.passage_ids[r] for r in row], score) for row, score in zip(rows, scores)]
    return out


def kilt_prediction(example: Example, pages: Sequence[str]) -> dict[str, Any]:
    """One official KILT-format prediction row: the ranked pages as provenance of one output."""
    return {"id": example.id, "input": example.query,
            "output": [{"provenance": [{"wikipedia_id": page} for page in pages]}]}


@dataclasses.dataclass
class EvalResult:
    """Per-task mean metrics (plus counts) and per-task KILT prediction rows."""

    tables: dict[str, dict[str, float]]
    predictions: dict[str, list[dict[str, Any]]]


@gin.configurable(denylist=["encoder", "index", "examples_by_task", "passages"])
def evaluate(
    encoder: Encoder,
    index: Index,
    examples_by_task: Mapping[str, Sequence[Example]],
    passages: PassageLookup,
    ks: Sequence[int] = (1, 5, 20, 100),
    depth: int = 100,
    batch_size: int = 128,
    skip_answer_recall: Sequence[str] = ("fever", "wow"),
) -> EvalResult:
    """Scores every task's examples; `depth` passages are retrieved per query before page dedup."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    scorer = RankingScorer(passages, ks, skip_answer_recall)
    for task, examples in examples_by_task.items():
        hits = retrieve(encoder, index, [e.query for e in examples], task, depth, batch_size)
        scorer.add_task(task, examples, [pids for pids, _ in hits])
    return scorer.result()


class RankingScorer:
    """KILT metrics and prediction rows for precomputed passage rankings (best first), task by task.

    `evaluate` feeds it an index's top passages; fusion (`t5r fuse`) feeds it fused rankings, so both
    report the same columns from the same page mapping.
    """

    def __init__(self, passages: PassageLookup, ks: Sequence[int] = (1, 5, 20, 100),
                 skip_answer_recall: Sequence[str] = ("fever", "wow")):
        if any(k < 1 for k in ks):
            raise ValueError(f"ks must be >= 1, got ks={ks}")
        self.passages = passages
        self.ks = sorted(set(ks))
        self.skip_answer_recall = tuple(skip_answer_recall)
        self.tables: dict[str, dict[str, float]] = {}
        self.predictions: dict[str, list[dict[str, Any]]] = {}
        self._tokens: dict[str, list[str]] = {}  # Normalised passage tokens, shared by every query and task.

    def _tokens_of(self, pid: str) -> list[str]:
        if pid not in self._tokens:
            self._tokens[pid] = metrics.normalize_answer_tokens(self.passages.get(pid).text)
        return self._tokens[pid]

    def add_task(self, task: str, examples: Sequence[Example], rankings: Sequence[Sequence[str]]) -> None:
        """Scores one task: `rankings[i]` is the ranked passage ids of `examples[i]`."""
        if len(rankings) != len(examples):
            raise ValueError(f"{task}: {len(rankings)} rankings for {len(examples)} examples")
        ks = self.ks
        page_scores, passage_scores, answer_scores, rows = [], [], [], []
        for example, pids in zip(examples, rankings):
            pages = metrics.dedup_keep_first(self.passages.page_of(pid) for pid in pids)
            rows.append(kilt_prediction(example, pages))
            page_scores.append(metrics.kilt_scores(example.gold_pages, pages, ks))
            if example.positive_passages:
                passage_scores.append({"passage_Rprec": metrics.passage_r_precision(example.positive_passages, pids)})
            if example.answers and task not in self.skip_answer_recall:
                rank = metrics.first_answer_rank((self._tokens_of(pid) for pid in pids[:max(ks)]), example.answers)
                answer_scores.append({f"answer_recall@{k}": float(rank is not None and rank <= k) for k in ks})
        table: dict[str, float] = {"n": len(examples), **metrics.mean_scores(page_scores)}
        table.update(metrics.mean_scores(passage_scores))
        table["n_passage_gold"] = len(passage_scores)
        if answer_scores:
            table.update(metrics.mean_scores(answer_scores))
            table["n_answers"] = len(answer_scores)
        self.tables[task] = table
        self.predictions[task] = rows

    def result(self) -> EvalResult:
        return EvalResult(dict(self.tables), dict(self.predictions))


def format_table(tables: Mapping[str, Mapping[str, float]]) -> str:
    """A fixed-width text table, one row per task, metrics as columns (missing values as '-')."""
    columns: list[str] = []
    for table in tables.values():
        columns += [c for c in table if c not in columns]
    width = max([len(t) for t in tables] + [4])
    head = f"{'task':<{width}} " + " ".join(f"{c:>{max(len(c), 6)}}" for c in columns)
    lines = [head]
    for task, table in tables.items():
        cells = []
        for c in columns:
            value = table.get(c)
            text = "-" if value is None else (f"{int(value)}" if c.startswith("n") else f"{value:.4f}")
            cells.append(f"{text:>{max(len(c), 6)}}")
        lines.append(f"{task:<{width}} " + " ".join(cells))
    return "\n".join(lines) + "\n"


def write_results(result: EvalResult, output_dir: str) -> None:
    """results.json, results.txt and predictions/{task}.jsonl (official KILT format).

    Every file is written to a temporary name and renamed; results.json goes last, so its presence
    means the predictions next to it are complete (an older one is removed before they are rewritten).
    """
    os.makedirs(os.path.join(output_dir, "predictions"), exist_ok=True)
    if os.path.exists(os.path.join(output_dir, "results.json")):
        os.remove(os.path.join(output_dir, "results.json"))
    for task, rows in result.predictions.items():
        write_jsonl_atomic(os.path.join(output_dir, "predictions", f"{task}.jsonl"), rows)
    write_text_atomic(os.path.join(output_dir, "results.txt"), format_table(result.tables))
    write_json_atomic(os.path.join(output_dir, "results.json"), result.tables)


def load_task_examples(data_dir: str, split: str, tasks: Sequence[str] | None) -> dict[str, list[Example]]:
    """Examples per task from `<data_dir>/examples/{task}-{split}.jsonl` (all tasks when None)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import DataError, read_examples

    if not tasks:
        suffix = f"-{split}.jsonl"
        found = sorted(glob.glob(layout.examples_path(data_dir, "*", split)))
        tasks = [os.path.basename(p)[:-len(suffix)] for p in found]
        if not tasks:
            raise DataError(f"{os.path.dirname(layout.examples_path(data_dir, 'x', split))}: no *{suffix} "
                            "files (run `t5r data tasks`)")
    out = {}
    for task in tasks:
        path = layout.examples_path(data_dir, task, split)
        if not os.path.exists(path):
            raise DataError(f"{path}: no examples for task {task!r}, split {split!r}")
        out[task] = read_examples(path)
    return out


@dataclasses.dataclass
class SearchInputs:
    """What `t5r eval` and `t5r mine` both start from, checked against each other."""

    store: Any  # data.kb.PassageStore
    examples: dict[str, list[Any]]
    index: Index
    encoder: Encoder


def add_search_flags(parser: argparse.ArgumentParser, default_split: str) -> None:
    """Flags shared by the CLIs that search an index with a query encoder over task examples."""
    add_encoder_flags(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--data_dir", required=True, help="processed data (examples/, kb/, negatives/)")
    parser.add_argument("--kb_dir", default=None, help="passage store (default: <data_dir>/kb)")
    parser.add_argument("--tasks", default="", help="comma-separated tasks (default: all found)")
    parser.add_argument("--split", default=default_split)


def load_search_inputs(args: argparse.Namespace) -> SearchInputs:
    """Opens the KB, examples, index and encoder of `add_search_flags`; refuses a mismatched index.

    Raises DataError or IndexMismatchError naming the file or field at fault.
    """
    from t5_retrieval.data import layout
    from t5_retrieval.data.kb import PassageStore

    store = PassageStore.open(args.kb_dir or layout.kb_dir(args.data_dir))
    examples = load_task_examples(args.data_dir, args.split, [t for t in args.tasks.split(",") if t])
    index = Index.load(args.index_dir)
    encoder = encoder_from_flags(args)
    index.check(encoder, store.ids())
    return SearchInputs(store, examples, index, encoder)


def main(argv: list[str]) -> int:
    """`t5r eval`: KILT metrics per task for an index and a query encoder."""
    from t5_retrieval import gin_utils
    from t5_retrieval.checkpoint import CheckpointError
    from t5_retrieval.data.records import DataError

    parser = argparse.ArgumentParser(prog="t5r eval", description=__doc__.splitlines()[0])
    add_search_flags(parser, default_split="dev")
    parser.add_argument("--output_dir", required=True)
    args = gin_utils.parse_args(parser, argv)
    try:
        inputs = load_search_inputs(args)
    except (DataError, IndexMismatchError, CheckpointError) as e:
        print(f"t5r eval: error: {e}", file=sys.stderr)
        return 2
    result = evaluate(inputs.encoder, inputs.index, inputs.examples, inputs.store)
    write_results(result, args.output_dir)
    print(format_table(result.tables), end="")
    return 0
