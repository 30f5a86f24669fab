"""What every row shares: the six tasks, the prepared data, and in-process gin-configured stages."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


TASKS = ("fever", "wow", "hotpotqa", "trex", "entityquestions", "entity_linking")


def prepare_data(raw_dir: str, data_dir: str) -> None:
    """KB from the paragraph passages, examples of every task, BM25 negatives (each step resumable)."""
    from t5_retrieval.data.kilt.prepare import prepare_missing
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    prepare_missing(os.path.join(raw_dir, "kb", "passages.jsonl"), raw_dir, data_dir, TASKS, build_bm25_index_for_kb)


def dataset_name(names: Iterable[str], dataset: str) -> str:
    """Which of a model's task names (a table's keys, or seqio Mixtures standing for their Tasks)
    reads `dataset`: resolved against what the seqio registry records of them; a name registered as
    nothing is a dataset (BM25's tables are keyed by dataset).

    Raises UnknownTaskError (a KeyError) when none of them, or several, read it."""
    from t5_retrieval.data.tasks.task_names import TaskSet

    return TaskSet.registered(names).resolve(dataset)


def dataset_table(tables: dict[str, Any], dataset: str) -> dict[str, Any]:
    """A dataset's entry of a `t5r eval` table (keyed by the model's name for it, `dataset_name`)."""
    return tables[dataset_name(tables, dataset)]


def configured(gin_files: Sequence[str], bindings: Sequence[str], run: Callable[[], T]) -> T:
    """`run()` under these gin files and `NAME = value` bindings alone (cleared before and after)."""
    import gin

    from t5_retrieval import gin_utils

    gin.clear_config()
    try:
        gin_utils.parse_gin(gin_files, bindings)
        return run()
    finally:
        gin.clear_config()


def train_model(model_dir: str, gin_files: list[str], bindings: list[str]) -> dict[str, Any]:
    """`t5r train --gin_file=<gin files> --gin.<bindings>` in-process."""
    from t5_retrieval.train import portable_bindings, train

    def run() -> Any:
        portable_bindings()  # config.gin records its paths absolute, as `t5r train` does
        return train(model_dir)

    state = configured(gin_files, bindings, run)
    return {"steps": int(state.step), "gin_files": gin_files, "bindings": bindings}
