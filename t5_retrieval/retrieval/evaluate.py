"""Evaluation: retrieve top passages per query (`search.dense_searcher`), map them to pages
(`search.pages`), score with the KILT metrics.

Per task this reports page-level R-precision, precision@k, recall@k and success_rate@k exactly as
the official KILT scorer (`metrics.kilt_scores`), plus passage-level R-precision (examples with
gold passages) and answer-in-passage recall@k (examples with answer strings, for tasks whose
answers are strings to find: not FEVER labels nor WoW replies). Every example of a task counts in
its means, one without gold provenance scoring 0, as in the official scorer (the examples carry
the gold sets `data.kilt` read by its rules). It also writes the predictions in
the official KILT format, so `kilt/eval_retrieval.py` can re-score them independently, and the
ranked passages with the model's scores as a TREC run (`trec_eval`, pyserini, ranx read it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.kilt import answers
from t5_retrieval.data.records import DataError, Example, write_json_atomic, write_jsonl_atomic, write_text_atomic
from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval import metrics, search
from t5_retrieval.retrieval.encoder import Encoder
from t5_retrieval.retrieval.index import Index


def kilt_prediction(example: Example, pages: Sequence[str]) -> dict[str, Any]:
    """One official KILT-format prediction row: the ranked pages as provenance of one output."""
    return {"id": example.id, "input": example.query,
            "output": [{"provenance": [{"wikipedia_id": page} for page in pages]}]}


RUN_TAG = "t5r"  # the last column of every TREC run line


@dataclasses.dataclass(frozen=True)
class Ranking:
    """One query's retrieved passages, best first, with the scores that ranked them."""

    query_id: str
    passage_ids: tuple[str, ...]
    scores: tuple[float, ...]


@dataclasses.dataclass
class EvalResult:
    """Per-task mean metrics (plus counts), per-task KILT prediction rows and, where the rankings
    came with scores, per-task TREC runs."""

    tables: dict[str, dict[str, float]]
    predictions: dict[str, list[dict[str, Any]]]
    runs: dict[str, list[Ranking]] = dataclasses.field(default_factory=dict)


@gin.configurable(denylist=["encoder", "index", "examples_by_task", "passages", "datasets"])
def evaluate(
    encoder: Encoder | None,
    index: Index,
    examples_by_task: Mapping[str, Sequence[Example]],
    passages: PassageLookup,
    ks: Sequence[int] = (1, 5, 20, 100),
    depth: int = 100,
    batch_size: int = 128,
    skip_answer_recall: Sequence[str] = ("fever", "wow"),
    datasets: Mapping[str, str] | None = None,
) -> EvalResult:
    """Scores every task's examples; `depth` passages are retrieved per query before page dedup.

    `encoder` None searches a BM25 index with the query texts (`search.bm25_searcher`). `datasets`
    maps each task to its dataset, which decides whether answer recall applies (a registered
    `demo_fever` is scored as `fever`); by default the model's record of it, or without a model the
    task's own name."""
    if depth < 1:
        raise ConfigError(f"evaluate.depth must be >= 1, got {depth}")
    scorer = RankingScorer(passages, ks, skip_answer_recall)
    for task, examples in examples_by_task.items():
        found = search.searcher_for(encoder, index, task, batch_size).search([e.query for e in examples], depth)
        scorer.add_task(task, examples, [r.passage_ids for r in found], [r.scores for r in found],
                        dataset=_dataset_of(task, encoder, datasets))
    return scorer.result()


def _dataset_of(task: str, encoder: Encoder | None, datasets: Mapping[str, str] | None) -> str:
    if datasets is not None:
        return datasets[task]
    return task if encoder is None else encoder.tasks.dataset_of(task)


class RankingScorer:
    """KILT metrics and prediction rows for precomputed passage rankings (best first), task by task.

    `evaluate` feeds it an index's top passages; fusion (`t5r fuse`) feeds it fused rankings, so both
    report the same columns from the same page mapping.
    """

    def __init__(self, passages: PassageLookup, ks: Sequence[int] = (1, 5, 20, 100),
                 skip_answer_recall: Sequence[str] = ("fever", "wow")):
        if any(k < 1 for k in ks):
            raise ConfigError(f"ks must be >= 1, got ks={ks}")
        self.passages = passages
        self.ks = sorted(set(ks))
        self.skip_answer_recall = tuple(skip_answer_recall)
        self.tables: dict[str, dict[str, float]] = {}
        self.predictions: dict[str, list[dict[str, Any]]] = {}
        self.runs: dict[str, list[Ranking]] = {}
        self._tokens: dict[str, list[str]] = {}  # Normalised passage tokens, shared by every query and task.

    def _tokens_of(self, pid: str) -> list[str]:
        if pid not in self._tokens:
            self._tokens[pid] = answers.dpr_answer_tokens(self.passages.get(pid).text)
        return self._tokens[pid]

    def add_task(self, task: str, examples: Sequence[Example], rankings: Sequence[Sequence[str]],
                 scores: Sequence[Sequence[float] | np.ndarray] | None = None, dataset: str | None = None) -> None:
        """Scores one task: `rankings[i]` is the ranked passage ids of `examples[i]`; `scores[i]`, when
        given, their retrieval scores (kept for the TREC run only: no metric reads them). `dataset`
        (default: `task`) decides whether answer recall means anything: `skip_answer_recall` names
        datasets, so `demo_fever` and `fever` are scored alike."""
        if len(rankings) != len(examples):
            raise ValueError(f"{task}: {len(rankings)} rankings for {len(examples)} examples")
        if scores is not None:
            if [len(s) for s in scores] != [len(r) for r in rankings]:
                raise ValueError(f"{task}: scores do not match the rankings one for one")
            self.runs[task] = [Ranking(e.id, tuple(r), tuple(float(x) for x in s))
                               for e, r, s in zip(examples, rankings, scores)]
        ks = self.ks
        page_scores, passage_scores, answer_scores, rows = [], [], [], []
        for example, pids in zip(examples, rankings):
            pages = search.pages(pids, self.passages)
            rows.append(kilt_prediction(example, pages))
            page_scores.append(metrics.kilt_scores(example.gold_pages, pages, ks))
            if example.positive_passages:
                passage_scores.append({"passage_Rprec": metrics.passage_r_precision(example.positive_passages, pids)})
            if example.answers and (dataset or task) not in self.skip_answer_recall:
                rank = answers.first_answer_rank((self._tokens_of(pid) for pid in pids[:max(ks)]), example.answers)
                answer_scores.append(answers.recall_at_ks(rank, ks))
        table: dict[str, float] = {"n": len(examples), **metrics.mean_scores(page_scores)}
        table.update(metrics.mean_scores(passage_scores))
        table["n_passage_gold"] = len(passage_scores)
        if answer_scores:
            table.update(metrics.mean_scores(answer_scores))
            table["n_answers"] = len(answer_scores)
        self.tables[task] = table
        self.predictions[task] = rows

    def result(self) -> EvalResult:
        return EvalResult(dict(self.tables), dict(self.predictions), dict(self.runs))


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


def trec_run(rankings: Sequence[Ranking], run_tag: str = RUN_TAG) -> str:
    """TREC run lines `qid Q0 docid rank score run_tag`, ranks from 1, passage ids as docids."""
    lines = []
    for ranking in rankings:
        if not ranking.query_id or any(c.isspace() for c in ranking.query_id):
            raise DataError(f"query id {ranking.query_id!r} is empty or has whitespace: a TREC run cannot hold it")
        lines += [f"{ranking.query_id} Q0 {pid} {rank} {score:.9g} {run_tag}\n"
                  for rank, (pid, score) in enumerate(zip(ranking.passage_ids, ranking.scores), start=1)]
    return "".join(lines)


def write_results(result: EvalResult, output_dir: str) -> None:
    """results.json, results.txt, predictions/{task}.jsonl (official KILT format) and, for rankings
    with scores, predictions/{task}.trec (a TREC run).

    Every file is written to a temporary name and renamed; results.json goes last, so its presence
    means the predictions next to it are complete (an older one is removed before they are rewritten).
    """
    os.makedirs(os.path.join(output_dir, "predictions"), exist_ok=True)
    if os.path.exists(os.path.join(output_dir, "results.json")):
        os.remove(os.path.join(output_dir, "results.json"))
    for task, rows in result.predictions.items():
        write_jsonl_atomic(os.path.join(output_dir, "predictions", f"{task}.jsonl"), rows)
    for task, rankings in result.runs.items():
        write_text_atomic(os.path.join(output_dir, "predictions", f"{task}.trec"), trec_run(rankings))
    write_text_atomic(os.path.join(output_dir, "results.txt"), format_table(result.tables))
    write_json_atomic(os.path.join(output_dir, "results.json"), result.tables)

