"""Resumable stages: a directory per stage, marked finished by a `DONE` file written last.

`t5r ance` and `t5r results` are sequences of such stages, so a rerun skips what has finished; a
stage interrupted midway is run again (training resumes from its last checkpoint, encoding from
its last shard). `index_and_evaluate` is the stage pair every trained or loaded model ends with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from t5_retrieval.data.records import write_json_atomic

log = logging.getLogger(__name__)
DONE = "DONE"


def is_done(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, DONE))


def mark_done(directory: str, info: dict[str, Any]) -> None:
    write_json_atomic(os.path.join(directory, DONE), {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), **info})


def stage(directory: str, name: str, run: Callable[[], dict[str, Any] | None]) -> None:
    """Runs `run` unless `directory` is marked done; marks it done (with run's info and the time) afterwards."""
    if is_done(directory):
        log.info("%s: already done (%s)", name, directory)
        return
    os.makedirs(directory, exist_ok=True)
    start = time.time()
    log.info("%s ...", name)
    info = run() or {}
    mark_done(directory, {"stage": name, "seconds": round(time.time() - start, 1), **info})


def index_and_evaluate(stage_dir: str, model_dir: str, data_dir: str, eval_split: str = "dev",
                       index_dir: str | None = None, datasets: Sequence[str] | None = None) -> None:
    """Encodes the KB with `model_dir`'s model, builds its index, and scores the eval split of every
    dataset the model was trained on (or of `datasets`): `stage_dir/{embeddings,index,eval}`.

    `index_dir`: score against this existing index instead (a query-side model searches its base's
    index, which `Index.check` verifies through the fingerprint); nothing is encoded then."""
    from t5_retrieval.data import embedding_store, layout, task_names
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.encoder import recorded_tasks
    from t5_retrieval.retrieval.evaluate import evaluate, write_results
    from t5_retrieval.retrieval.index import Index, build_index

    store = PassageStore.open(layout.kb_dir(data_dir))
    emb_dir, eval_dir = os.path.join(stage_dir, "embeddings"), os.path.join(stage_dir, "eval")

    def encode_and_index() -> dict[str, Any]:
        encoder = load_encoder(model_dir)
        embedding_store.write_embeddings(encoder, store, store.ids(), emb_dir, meta={"model_dir": model_dir},
                                         **embedding_store.encode_settings())
        index = build_index(emb_dir)
        index.save(index_dir)
        return {"fingerprint": encoder.fingerprint, "passages": len(index)}

    def score() -> dict[str, Any]:
        encoder = load_encoder(model_dir)
        index = Index.load(index_dir)
        index.check(encoder, store.ids())
        tasks = recorded_tasks(encoder)
        # Tables are keyed by the model's task names, as the results tables read them.
        examples = {task_names.resolve(tasks, d): read_examples(
            layout.examples_path(data_dir, task_names.dataset_of(tasks, d), eval_split))
            for d in datasets or task_names.datasets(tasks)}
        result = evaluate(encoder, index, examples, store)
        result.tables = {task: result.tables[task] for task in sorted(result.tables)}
        write_results(result, eval_dir)
        return {"tables": result.tables, "index": index_dir}

    if index_dir is None:
        index_dir = os.path.join(stage_dir, "index")
        stage(index_dir, "encode + index", encode_and_index)
    stage(eval_dir, "evaluate", score)


def mine_stage(negatives_dir: str, model_dir: str, index_dir: str, data_dir: str, depth: int,
               answer_checkable: Sequence[str] = ()) -> None:
    """Hard negatives for every training query of every dataset the model was trained on, mined with
    `model_dir`'s model from its index (checked to be that model's, over this KB): its top-`depth`
    minus gold pages and, for the datasets in `answer_checkable` (where an answer string means
    relevance: QA, slot filling), minus answer-holding passages, MT-DPR's confounders."""
    from t5_retrieval.data import layout, task_names
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.records import read_examples, write_negatives
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.encoder import recorded_tasks
    from t5_retrieval.retrieval.index import Index
    from t5_retrieval.retrieval.mine import mine_negatives

    def run() -> dict[str, Any]:
        store = PassageStore.open(layout.kb_dir(data_dir))
        encoder, index = load_encoder(model_dir), Index.load(index_dir)
        index.check(encoder, store.ids())
        counts = {}
        tasks = recorded_tasks(encoder)
        for dataset in task_names.datasets(tasks):
            task = task_names.resolve(tasks, dataset)
            # Queries are encoded as the model's task for this dataset (its prefix).
            examples = [dataclasses.replace(e, task=task)
                        for e in read_examples(layout.examples_path(data_dir, dataset, "train"))]
            rows = mine_negatives(encoder, index, examples, store, k=depth,
                                  exclude_answers=dataset in answer_checkable)
            counts[dataset] = write_negatives(layout.negatives_path(negatives_dir, dataset, "train"), rows)
        return {"negatives": counts, "model": model_dir, "answer_checkable": sorted(answer_checkable)}

    stage(negatives_dir, "mine", run)
