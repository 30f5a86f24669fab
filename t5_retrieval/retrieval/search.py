"""The one search path: query texts -> what the index searches -> `Index.search` -> passage ids -> passages.

A `PassageSearcher` is an index plus the function that turns query texts into the index's queries,
the shape pyserini gives its sparse and dense searchers (so that its hybrid is a composition):

- `dense_searcher`: a model's `Encoder` with one task's query prefix -> float32 embeddings, over a
  vector index (the exact or ScaNN backend);
- `bm25_searcher`: the texts without KILT's markers, over the BM25 backend (`bm25_index`).

Both return the same `Ranked` lists, so every caller searches alike and can swap or combine them:
`t5r eval` and `t5r mine` (`evaluate`, `mine`), `t5r serve` (`serve.SearchService`), `Searcher`,
and fusion's experts and its BM25 hybrid. `hits` and `pages` map ranked passage ids to passages and
to pages for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval import metrics
from t5_retrieval.retrieval.encoder import Encoder
from t5_retrieval.retrieval.index import Index


class Ranked(NamedTuple):
    """One query's top passages, best first: their ids and scores (an index's float32; fusion's float64)."""

    passage_ids: list[str]
    scores: np.ndarray


@dataclasses.dataclass(frozen=True)
class Hit:
    """One retrieved passage: its ids, title and text, and the index's score."""

    passage_id: str
    wikipedia_id: str
    title: str
    score: float
    text: str


def hits(ranked: Ranked, passages: PassageLookup) -> list[Hit]:
    """The ranked passages as `Hit`s, best first."""
    found = [passages.get(pid) for pid in ranked.passage_ids]
    return [Hit(p.id, p.wikipedia_id, p.title, float(s), p.text) for p, s in zip(found, ranked.scores)]


def pages(passage_ids: Sequence[str], passages: PassageLookup) -> list[str]:
    """The pages of ranked passages, each once where its best passage ranks (KILT's page ranking)."""
    return metrics.dedup_keep_first(passages.page_of(pid) for pid in passage_ids)


class PassageSearcher:
    """An index and the function that turns query texts into its queries, searched `batch_size` texts at a time."""

    def __init__(self, index: Index, to_queries: Callable[[list[str]], Any], batch_size: int = 128):
        if batch_size < 1:
            raise ConfigError(f"search batch_size must be >= 1, got {batch_size}")
        self.index = index
        self.to_queries = to_queries
        self.batch_size = batch_size

    def search_batches(self, queries: Sequence[str], k: int) -> Iterator[tuple[Any, list[Ranked]]]:
        """Per batch: what the index searched (embeddings or texts) and each query's top k.

        Fusion keeps the embeddings (its ensembles read them); everyone else calls `search`."""
        for start in range(0, len(queries), self.batch_size):
            batch = self.to_queries(list(queries[start:start + self.batch_size]))
            rows, scores = self.index.search(batch, k)
            yield batch, [Ranked([self.index.passage_ids[r] for r in row], score) for row, score in zip(rows, scores)]

    def search(self, queries: Sequence[str], k: int) -> list[Ranked]:
        """Each query's top min(k, len(index)) passages, best first."""
        return [ranked for _, batch in self.search_batches(queries, k) for ranked in batch]

    def hits(self, queries: Sequence[str], k: int, passages: PassageLookup) -> list[list[Hit]]:
        """`search`, with each passage read from `passages`."""
        return [hits(ranked, passages) for ranked in self.search(queries, k)]


def dense_searcher(encoder: Encoder, index: Index, task: str, batch_size: int = 128,
                   lock: threading.Lock | None = None) -> PassageSearcher:
    """Queries embedded by `encoder` with `task`'s prefix (the model's own task name), over a vector index.

    `lock`, for callers searching from several threads, is held while encoding only: the model
    object is not promised to be thread-safe, index search is."""
    def embed(texts: list[str]) -> np.ndarray:
        with lock or contextlib.nullcontext():
            return np.asarray(encoder.encode_queries(texts, task), np.float32)

    return PassageSearcher(index, embed, batch_size)


def bm25_searcher(index: Index, batch_size: int = 128) -> PassageSearcher:
    """Query texts, KILT's markers removed (`bm25_query`), over a BM25 index."""
    from t5_retrieval.data.kilt.negatives import bm25_query  # imports bm25s (and jax): seconds, BM25 users only

    return PassageSearcher(index, lambda texts: [bm25_query(t) for t in texts], batch_size)


def searcher_for(encoder: Encoder | None, index: Index, task: str, batch_size: int = 128) -> PassageSearcher:
    """`task`'s searcher of `index`: the query texts over a BM25 index when `encoder` is None (a BM25
    index takes no model), else `dense_searcher`."""
    return bm25_searcher(index, batch_size) if encoder is None else dense_searcher(encoder, index, task, batch_size)
