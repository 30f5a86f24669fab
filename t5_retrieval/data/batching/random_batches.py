"""Synthetic token batches in the trainer's format, for model tests and step benchmarks.

Each positive passage starts with its query's tokens, so the task is learnable (a loss that falls
shows the whole step works) without any tokenizer or files. Not a data set: real training uses
`t5_retrieval.data.batching.batches`.

Host sharding: every host draws the same global batch and keeps its own rows (host h of H takes
the h-th of H equal slices of each task's queries and of their passages), so the global batch,
and with it the training run, is the same whatever the number of hosts: what the multi-host
tests compare against a single process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.errors import ConfigError


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


@gin.configurable
class RandomBatches:
    """Per step: {task: {"query_tokens", "passage_tokens", "task_ids"}}, host-local, deterministic in
    (seed, step) and independent of the host layout (see the module docstring)."""

    def __init__(self, per_device_batch: int, local_data_devices: int, host_index: int = 0,
                 host_count: int = 1, seed: int = 0, task_names: Sequence[str] = ("task_a", "task_b"),
                 vocab_size: int = 128, query_len: int = 8, passage_len: int = 16, num_negatives: int = 1):
        if per_device_batch < len(task_names):
            raise ConfigError(f"per_device_batch={per_device_batch} < {len(task_names)} tasks: each needs >= 1")
        self.task_names = list(task_names)
        self.sizes = [n * local_data_devices for n in split_evenly(per_device_batch, len(task_names))]
        self.vocab_size, self.query_len, self.passage_len = vocab_size, query_len, passage_len
        self.num_negatives = num_negatives
        if not 0 <= host_index < host_count:
            raise ValueError(f"host_index {host_index} not in [0, {host_count})")
        self.host_index, self.host_count = host_index, host_count
        self.seed = seed
        self.step = 0
        self.steps_per_epoch = 100  # nominal: random batches have no epochs
        # Each task recorded as a real run records it (its `TaskSpec` record and step position), so a
        # config of an older run upgrades to it when the run resumes (`build.upgraded_config`).
        self.features = {"vocabulary": None, "query_len": query_len, "passage_len": passage_len,
                         "tasks": {name: {**TaskSpec(name, name, None, query_len).to_record(), "index": i}
                                   for i, name in enumerate(self.task_names)}}

    def _tokens(self, rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
        tokens = rng.integers(2, self.vocab_size, size=(rows, length), dtype=np.int32)
        lengths = rng.integers(length // 2, length + 1, size=rows)
        tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0
        tokens[np.arange(rows), lengths - 1] = 1  # EOS
        return tokens

    def __iter__(self) -> RandomBatches:
        return self

    def __next__(self) -> dict[str, dict[str, np.ndarray]]:
        # (0, 1): the single-host stream, as before hosts shared one global batch (same data as then).
        rng = np.random.default_rng((self.seed, 0, 1, self.step))
        self.step += 1
        batch = {}
        per_query = 1 + self.num_negatives
        for task_id, (name, size) in enumerate(zip(self.task_names, self.sizes)):
            rows = size * self.host_count
            queries = self._tokens(rng, rows, self.query_len)
            passages = self._tokens(rng, rows * per_query, self.passage_len)
            overlap = min(self.query_len, self.passage_len) - 1
            passages[::per_query, :overlap] = np.where(queries[:, :overlap] > 1, queries[:, :overlap], 3)
            first = self.host_index * size
            batch[name] = {"query_tokens": queries[first:first + size],
                           "passage_tokens": passages[first * per_query:(first + size) * per_query],
                           "task_ids": np.full((size,), task_id, np.int32)}
        return batch

    def state(self) -> dict[str, Any]:
        return {"step": self.step}

    def restore(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
