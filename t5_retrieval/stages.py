"""Resumable stages: a directory per stage, marked finished by a `DONE` file written last.

`t5r ance` and `t5r results` are sequences of such stages, so a rerun skips what has finished; a
stage interrupted midway is run again (training resumes from its last checkpoint, encoding from
its last shard). `index_and_evaluate` is the stage pair every trained or loaded model ends with.

Multi-process jobs (`launch/run.py`): every process runs the same sequence. Training and KB
encoding are shared (each process its data shard, its range of embedding shards); building the
index, evaluating and mining run on process 0 alone while the others wait at a barrier. Only
process 0 writes `DONE`, and every process decides whether a stage is done before any process can
mark it, so all of them take the same path through the sequence.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from t5_retrieval.checksums import STAGE_MARKER as DONE
from t5_retrieval.data.records import write_json_atomic

log = logging.getLogger(__name__)


def is_done(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, DONE))


def mark_done(directory: str, info: dict[str, Any]) -> None:
    write_json_atomic(os.path.join(directory, DONE), {"finished": time.strftime("%Y-%m-%d %H:%M:%S"), **info})


# Waiting processes idle while process 0 mines or evaluates, which takes hours on a full KB.
BARRIER_TIMEOUT_S = 48 * 3600


def process() -> tuple[int, int]:
    """(this process's index, the job's process count); (0, 1) outside `jax.distributed`."""
    import jax

    return jax.process_index(), jax.process_count()


def barrier(key: str) -> None:
    """Waits until every process of the job reaches `key` (unique per call site and stage); a no-op
    for one process. A coordination-service barrier, not a device collective, so a long wait does
    not hit a collective's timeout."""
    index, count = process()
    if count > 1:
        from orbax.checkpoint import multihost

        multihost.sync_global_processes(key, timeout=BARRIER_TIMEOUT_S, processes=set(range(count)))


def stage(directory: str, name: str, run: Callable[[], dict[str, Any] | None], leader_only: bool = False) -> None:
    """Runs `run` unless `directory` is marked done; marks it done (with run's info and the time) afterwards.

    `leader_only`: only process 0 runs it (the others wait); otherwise every process does its share.
    """
    done = is_done(directory)
    barrier(f"t5r stage checked: {directory}")  # no process marks it done before all have looked
    if done:
        log.info("%s: already done (%s)", name, directory)
        return
    index, _ = process()
    start = time.time()
    info: dict[str, Any] = {}
    if leader_only and index != 0:
        log.info("%s: process 0 runs it; waiting", name)
    else:
        os.makedirs(directory, exist_ok=True)
        log.info("%s ...", name)
        info = run() or {}
        if not leader_only:
            barrier(f"t5r stage ran: {directory}")
    if index == 0:
        mark_done(directory, {"stage": name, "seconds": round(time.time() - start, 1), **info})
    barrier(f"t5r stage done: {directory}")


def index_and_evaluate(stage_dir: str, model_dir: str, data_dir: str, eval_split: str = "dev",
                       index_dir: str | None = None, datasets: Sequence[str] | None = None) -> None:
    """Encodes the KB with `model_dir`'s model, builds its index, and scores the eval split of every
    dataset the model was trained on (or of `datasets`): `stage_dir/{embeddings,index,eval}`.

    `index_dir`: score against this existing index instead (a query-side model searches its base's
    index, which `Index.check` verifies through the fingerprint); nothing is encoded then. The index's
    backend is gin's `build_index.backend` (ScaNN by default)."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.stores import embedding_store
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.tasks.examples import task_examples
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.evaluate import evaluate, write_results
    from t5_retrieval.retrieval.index import build_index, load_index

    store = PassageStore.open(layout.kb_dir(data_dir))
    emb_dir, eval_dir = os.path.join(stage_dir, "embeddings"), os.path.join(stage_dir, "eval")
    index_path = index_dir or os.path.join(stage_dir, "index")

    def encode() -> dict[str, Any]:
        encoder = load_encoder(model_dir)
        index, count = process()
        report = embedding_store.write_embeddings(
            encoder, store, store.ids(), emb_dir, meta={"model_dir": model_dir}, process_index=index,
            process_count=count, **embedding_store.encode_settings())
        return {"fingerprint": encoder.fingerprint, "shards_written_by_process_0": len(report.shards_written)}

    def build() -> dict[str, Any]:
        index = build_index(emb_dir)
        index.save(index_path)
        return {"fingerprint": index.fingerprint, "passages": len(index)}

    def score() -> dict[str, Any]:
        encoder = load_encoder(model_dir)
        index = load_index(index_path)
        index.check(encoder, store.ids())
        # Tables are keyed by the model's task names, as the results tables read them.
        examples = task_examples(encoder.tasks, data_dir, eval_split, datasets or ())
        result = evaluate(encoder, index, examples, store)
        result.tables = {task: result.tables[task] for task in sorted(result.tables)}
        write_results(result, eval_dir)
        return {"tables": result.tables, "index": index_path}

    if index_dir is None:
        stage(emb_dir, "encode", encode)
        stage(index_path, "index", build, leader_only=True)
    stage(eval_dir, "evaluate", score, leader_only=True)


def mine_stage(negatives_dir: str, model_dir: str, index_dir: str, data_dir: str, depth: int,
               answer_checkable: Sequence[str] = ()) -> None:
    """Hard negatives for every training query of every dataset the model was trained on, mined with
    `model_dir`'s model from its index (checked to be that model's, over this KB): its top-`depth`
    minus gold pages and, for the datasets in `answer_checkable` (where an answer string means
    relevance: QA, slot filling), minus answer-holding passages, MT-DPR's confounders."""
    from t5_retrieval.data import layout
    from t5_retrieval.data.records import write_negatives
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.tasks.examples import task_examples
    from t5_retrieval.inference import load_encoder
    from t5_retrieval.retrieval.index import load_index
    from t5_retrieval.retrieval.mine import mine_negatives

    def run() -> dict[str, Any]:
        store = PassageStore.open(layout.kb_dir(data_dir))
        encoder, index = load_encoder(model_dir), load_index(index_dir)
        index.check(encoder, store.ids())
        counts = {}
        for task in encoder.tasks:
            spec = encoder.tasks.spec(task)
            if spec.negatives_name in counts:  # tasks reading one dataset's text as written share its file
                continue
            # Queries are encoded as the model's task (its prefix); the file is named as training reads it.
            examples = task_examples(encoder.tasks, data_dir, "train", [task])[task]  # one task's at a time
            rows = mine_negatives(encoder, index, examples, store, k=depth,
                                  exclude_answers=spec.dataset in answer_checkable)
            counts[spec.negatives_name] = write_negatives(
                layout.negatives_path(negatives_dir, spec.negatives_name, "train"), rows)
        return {"negatives": counts, "model": model_dir, "answer_checkable": sorted(answer_checkable)}

    stage(negatives_dir, "mine", run, leader_only=True)
