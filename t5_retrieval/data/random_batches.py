"""Synthetic token batches in the trainer's format, for model tests and step benchmarks.

Each positive passage starts with its query's tokens, so the task is learnable (a loss that falls
shows the whole step works) without any tokenizer or files. Not a data set: real training uses
`t5_retrieval.data.batches`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import numpy as np


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@gin.configurable
class RandomBatches:
    """Per step: {task: {"query_tokens", "passage_tokens", "task_ids"}}, host-local, deterministic."""

    def __init__(self, per_device_batch: int, local_data_devices: int, host_index: int = 0,
                 host_count: int = 1, seed: int = 0, task_names: Sequence[str] = ("task_a", "task_b"),
                 vocab_size: int = 128, query_len: int = 8, passage_len: int = 16, num_negatives: int = 1):
        if per_device_batch < len(task_names):
            raise ValueError(f"per_device_batch={per_device_batch} < {len(task_names)} tasks: each needs >= 1")
        self.task_names = list(task_names)
        self.sizes = [n * local_data_devices for n in split_evenly(per_device_batch, len(task_names))]
        self.vocab_size, self.query_len, self.passage_len = vocab_size, query_len, passage_len
        self.num_negatives = num_negatives
        self.seed = (seed, host_index, host_count)
        self.step = 0
        self.steps_per_epoch = 100  # nominal: random batches have no epochs
        self.features = {"vocabulary": None, "query_len": query_len, "passage_len": passage_len,
                          "tasks": {name: {"dataset": name, "prefix": None, "index": i}
                                    for i, name in enumerate(self.task_names)}}

    def _tokens(self, rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
        tokens = rng.integers(2, self.vocab_size, size=(rows, length), dtype=np.int32)
        lengths = rng.integers(length // 2, length + 1, size=rows)
        tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0
        tokens[np.arange(rows), lengths - 1] = 1  # EOS
        return tokens

    def __iter__(self) -> "RandomBatches":
        return self

    def __next__(self) -> dict[str, dict[str, np.ndarray]]:
        rng = np.random.default_rng((*self.seed, self.step))
        self.step += 1
        batch = {}
        per_query = 1 + self.num_negatives
        for task_id, (name, size) in enumerate(zip(self.task_names, self.sizes)):
            queries = self._tokens(rng, size, self.query_len)
            passages = self._tokens(rng, size * per_query, self.passage_len)
            overlap = min(self.query_len, self.passage_len) - 1
            passages[::per_query, :overlap] = np.where(queries[:, :overlap] > 1, queries[:, :overlap], 3)
            batch[name] = {"query_tokens": queries, "passage_tokens": passages,
                           "task_ids": np.full((size,), task_id, np.int32)}
        return batch

    def state(self) -> dict[str, Any]:
        return {"step": self.step}

    def restore(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
