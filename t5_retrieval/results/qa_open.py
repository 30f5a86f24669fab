"""The query-side row and its own scale: answer-in-passage recall on the qa_open dev sets."""

from __future__ import annotations

import json
import os
from typing import Any

from t5_retrieval.results.common import TASKS, configured
from t5_retrieval.results.minilm_rows import minilm_zeroshot_row
from t5_retrieval.stages import DONE

QA_OPEN_TASKS = ("nq_open", "triviaqa_open", "webq", "curatedtrec")


QA_OPEN_KS = (5, 20, 100)


# runs/query_side.gin's 2 rounds, with 1 pass over the questions per round instead of 3: ~840 steps
# of 16 questions, about what a trained row's 200 x 32 queries cost here.
QUERY_SIDE_GIN = ("runs/query_side.gin",)
QUERY_SIDE_BINDINGS = ("QuerySideConfig.epochs_per_round = 1",)


def query_side_row(row_dir: str, data_dir: str) -> None:
    """The thesis' query-side fine-tuning (`t5r query-side --gin_file=runs/query_side.gin`): MiniLM's
    query side adapted to the four qa_open question sets over the zero-shot index, positives = the
    passages of its top-100 that hold an answer. Scored on the mini-KILT dev sets like every row, and
    on the qa_open dev sets by answer-in-passage recall, next to BM25's (`qa_open_table`)."""
    from t5_retrieval.data import layout
    from t5_retrieval.query_side import fine_tune_query_side
    from t5_retrieval.stages import index_and_evaluate, stage

    base_dir = os.path.join(os.path.dirname(row_dir), "minilm_zeroshot")
    minilm_zeroshot_row(base_dir, data_dir)
    model_dir, qa_dir = os.path.join(row_dir, "model"), qa_open_dir(data_dir)
    base_model, base_index, base_embeddings = (os.path.join(base_dir, d) for d in ("model", "index", "embeddings"))

    def fine_tune() -> dict[str, Any]:
        configured(QUERY_SIDE_GIN, QUERY_SIDE_BINDINGS, lambda: fine_tune_query_side(
            base_model, base_index, base_embeddings, layout.kb_dir(data_dir), qa_dir, QA_OPEN_TASKS, "hotpotqa",
            model_dir))
        return {"gin": [*QUERY_SIDE_GIN, *QUERY_SIDE_BINDINGS], "base": base_model, "as_task": "hotpotqa"}

    stage(model_dir, "query-side fine-tuning on qa_open", fine_tune)
    # Scored on the six datasets: the new qa_open tasks have no KILT dev files (see qa_open_table).
    index_and_evaluate(row_dir, model_dir, data_dir, index_dir=os.path.join(base_dir, "index"), datasets=TASKS)
    stage(os.path.join(row_dir, "qa_open_bm25"), "BM25 answer recall on qa_open",
          lambda: bm25_answer_recall(data_dir, qa_dir))


def qa_open_dir(data_dir: str) -> str:
    """The qa_open questions beside the mini-KILT files the prepared KB was read from."""
    from t5_retrieval.data import layout

    with open(os.path.join(layout.kb_dir(data_dir), "manifest.json")) as f:
        source = json.load(f)["source"]
    qa_dir = os.path.join(os.path.dirname(os.path.dirname(source)), "qa_open")
    if not os.path.isdir(qa_dir):
        raise FileNotFoundError(f"{qa_dir}: no qa_open directory beside the KB source {source}")
    return qa_dir


def bm25_answer_recall(data_dir: str, qa_dir: str, tasks: tuple[str, ...] = QA_OPEN_TASKS) -> dict[str, Any]:
    """BM25's answer-in-passage recall@QA_OPEN_KS on each task's dev questions (as the data's reference)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.kilt.answers import AnswerTexts
    from t5_retrieval.data.kilt.qa_open import read_qa_task
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.query_side import ranking_answer_recall
    from t5_retrieval.retrieval.index import build_bm25_index

    store = PassageStore.open(layout.kb_dir(data_dir))
    index, texts = build_bm25_index(store, layout.kb_dir(data_dir)), AnswerTexts(store)
    recall = {}
    for name in tasks:
        task = read_qa_task(qa_dir, name, "dev")
        rows, _ = index.search([e.query for e in task.examples], max(QA_OPEN_KS))
        rankings = [[index.passage_ids[i] for i in top] for top in rows]
        recall[name] = ranking_answer_recall(texts, task, rankings, QA_OPEN_KS)
    return {"dev": recall}


def qa_open_table(work_dir: str) -> str:
    """Answer-in-passage recall@5/20/100 on the qa_open dev sets: BM25, MiniLM zero-shot, query-side."""
    from t5_retrieval.query_side import REPORT_FILE

    row_dir = os.path.join(work_dir, "query_side")
    report_path, bm25_path = os.path.join(row_dir, "model", REPORT_FILE), os.path.join(row_dir, "qa_open_bm25", DONE)
    if not (os.path.exists(report_path) and os.path.exists(bm25_path)):
        return ""
    with open(report_path) as f:
        report = json.load(f)
    with open(bm25_path) as f:
        bm25 = json.load(f)["dev"]
    header = "| retriever | " + " | ".join(f"{t} R@{k}" for t in QA_OPEN_TASKS for k in QA_OPEN_KS) + " |"
    lines = [header, "|" + "---|" * (1 + len(QA_OPEN_TASKS) * len(QA_OPEN_KS))]
    for title, recall in (("BM25", bm25), ("MiniLM-L6 zero-shot", report["dev_before"]),
                          ("query-side fine-tuned", report["dev_after"])):
        cells = [f"{recall[t][f'answer_recall@{k}']:.3f}" for t in QA_OPEN_TASKS for k in QA_OPEN_KS]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
