"""What the retrieval stages need from a model: the `Encoder` protocol, plus a real lexical one.

Encoding, indexing, evaluation, mining and serving only ever see this protocol, so they are tested
with `HashedBagOfWordsEncoder` (deterministic, no parameters, fast) and run unchanged with any model
directory opened by `t5_retrieval.inference.load_encoder` (one layer up). The hashed encoder is also
a lexical baseline: a dot product of L2-normalised hashed term-frequency vectors.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores.kb import passage_text
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.errors import ConfigError


@runtime_checkable
class Encoder(Protocol):
    """A dual encoder seen from the retrieval side: everything the retrieval stages, commands,
    `Searcher`, serving, fusion and export read from a model.

    `fingerprint` identifies the model (config + parameters): an index built with one fingerprint
    is refused for queries encoded by another. `features` is how the model reads text, as recorded
    with it; `tasks` is the `TaskSet` of its recorded tasks, built once, which resolves every name a
    user gives a task (empty for a model that records none); `task_names` are its tasks' registered
    names, sorted; `step` is the checkpoint step its parameters come from (None for a model without
    one). `encode_queries` applies the
    task's query prefix. Both encode methods return float32 [n, dim] arrays whose dot products are
    the scores.
    """

    @property
    def fingerprint(self) -> str: ...

    @property
    def dim(self) -> int: ...

    @property
    def features(self) -> Mapping[str, Any]: ...

    @property
    def task_names(self) -> Sequence[str]: ...

    @property
    def tasks(self) -> TaskSet: ...

    @property
    def step(self) -> int | None: ...

    def encode_queries(self, texts: Sequence[str], task: str) -> np.ndarray: ...

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray: ...


def is_encoder_of(encoder: Encoder, fingerprint: str) -> bool:
    """Whether `fingerprint`, as an index, stored embeddings or a query-side model recorded it, names
    `encoder`'s model: its `fingerprint`, or the one older versions recorded for it
    (`legacy_fingerprint`, where the encoder has one, asked only when the current one differs: it
    costs a pass over the weights), so what they built still matches."""
    return fingerprint == encoder.fingerprint or fingerprint == getattr(encoder, "legacy_fingerprint", None)


def warn_if_trained_on_rewritten_text(encoder: Encoder, task: str, but: str) -> None:
    """Warns, naming the task and its preprocessors, when the model trained on `task`'s query text as
    its seqio Task's preprocessors rewrote it (`features.tasks.<task>.text_preprocessors`), where
    text is embedded as given (`but` says where and what to do): a user's text is not what the
    model read."""
    steps = encoder.tasks.spec(task).text_preprocessors
    if steps:
        log.warning("task %s: the model trained on its query text as its seqio Task's preprocessors (%s) leave it, "
                    "but %s", task, ", ".join(steps), but)


log = logging.getLogger(__name__)
_WORD = re.compile(r"\w+")
# Function words carry no topic and, without IDF weights, would dominate every vector.
_STOPWORDS = frozenset(
    "a an and are as at be by for from has he in is it its of on or that the to was were will with title text "
    "what which who whom when where why how this these those there their they i you we she his her not no".split())


class HashedBagOfWordsEncoder:
    """Signed feature hashing of lower-cased non-stopwords with log term frequency, L2-normalised.

    Queries and passages share the map (task is ignored: a lexical model has no task prefix), so
    the score of a query and a passage is the cosine of their hashed term-frequency vectors.
    Words are hashed with blake2b, not Python's `hash`, so vectors are identical across processes.
    """

    def __init__(self, dim: int = 4096):
        if dim < 1:
            raise ConfigError(f"lexical baseline dim must be >= 1, got {dim}")
        self._dim = dim
        self._buckets: dict[str, tuple[int, float]] = {}
        self.features: dict[str, Any] = {}  # no tasks recorded: without a prefix, any task name is its own
        self.tasks = TaskSet(())
        self.step: int | None = None  # nothing trained

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def task_names(self) -> list[str]:
        return sorted(self.tasks)

    @property
    def fingerprint(self) -> str:
        return f"hashed-bow-v2-dim{self._dim}"

    def _bucket(self, word: str) -> tuple[int, float]:
        hit = self._buckets.get(word)
        if hit is None:
            digest = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
            hit = (digest % self._dim, 1.0 if (digest >> 63) & 1 else -1.0)
            self._buckets[word] = hit
        return hit

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        rows, cols, values = [], [], []
        bucket = self._bucket
        for row, text in enumerate(texts):
            counts = Counter(_WORD.findall(text.lower()))
            for word, count in counts.items():
                if word not in _STOPWORDS:
                    col, sign = bucket(word)
                    rows.append(row)
                    cols.append(col)
                    values.append(sign * (1.0 + math.log(count)))
        out = np.zeros((len(texts), self._dim), np.float32)
        np.add.at(out, (np.asarray(rows, np.int64), np.asarray(cols, np.int64)), np.asarray(values, np.float32))
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)

    def encode_queries(self, texts: Sequence[str], task: str) -> np.ndarray:
        del task  # A lexical model has no task prefix.
        return self._encode(texts)

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray:
        return self._encode([passage_text(p) for p in passages])
