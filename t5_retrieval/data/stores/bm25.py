"""BM25 over a passage store (bm25s): hard negatives, positives for page-only labels, a baseline.

Passages are indexed as "title text" (the title carries most of the page's identity in KILT),
lower-cased, split on `\\w+` and stripped of English stop words; k1 = 0.9, b = 0.4 (Anserini's
defaults, also DPR's BM25 baseline and mini-KILT's reference numbers).

The scoring functions take a bm25s retriever, so `BM25Index` (the store's passages with their pages,
for negatives and labels) and the BM25 backend of `retrieval.index` (`retrieval/bm25_index.py`,
saved and loaded like the vector backends) rank alike. This is the only module importing bm25s.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import gin
import numpy as np

from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores.kb import PassageStore

if TYPE_CHECKING:
    import bm25s  # imported where a retriever is built or loaded: it imports jax (seconds)

_TOKEN = re.compile(r"\w+")


@functools.cache
def _stop_words() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def bm25_tokens(text: str) -> list[str]:
    stop = _stop_words()
    return [t for t in _TOKEN.findall(text.lower()) if t not in stop]


def _query_ids(retriever: bm25s.BM25, query: str) -> np.ndarray:
    return np.asarray(retriever.get_tokens_ids(bm25_tokens(query)), np.int64)


def query_scores(retriever: bm25s.BM25, query: str) -> np.ndarray:
    """BM25 score of every passage for one query (zeros when no query word is in the KB)."""
    token_ids = _query_ids(retriever, query)
    if token_ids.size == 0:
        return np.zeros(retriever.scores["num_docs"], np.float32)
    return retriever.get_scores_from_ids(token_ids.tolist())


def top_k(retriever: bm25s.BM25, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The top-min(k, n) passage indices of one query, best first, ties broken by store order, and their scores."""
    scores = query_scores(retriever, query)
    k = min(k, len(scores))
    top = np.argpartition(-scores, k - 1)[:k]
    order = np.lexsort((top, -scores[top]))
    top = top[order]
    return top, scores[top]


def score_subset(retriever: bm25s.BM25, query: str, rows: Sequence[int]) -> np.ndarray:
    """BM25 scores (float64) of a few passages (e.g. one page's) without scoring the whole KB."""
    candidates = np.asarray(rows, np.int64)
    out = np.zeros(len(candidates), np.float64)
    sc = retriever.scores
    for token in _query_ids(retriever, query):
        lo, hi = sc["indptr"][token], sc["indptr"][token + 1]
        docs = sc["indices"][lo:hi]
        hit = np.isin(docs, candidates)
        for doc, value in zip(docs[hit], sc["data"][lo:hi][hit]):
            out[candidates == doc] += value
    return out


@gin.configurable(denylist=["passages"])
def index_passages(passages: Iterable[Passage], k1: float = 0.9, b: float = 0.4) -> bm25s.BM25:
    """A bm25s retriever whose document i is the i-th passage, indexed as "title text"."""
    import bm25s

    retriever = bm25s.BM25(k1=k1, b=b)
    retriever.index([bm25_tokens(f"{p.title} {p.text}") for p in passages], show_progress=False)
    return retriever


def save_retriever(retriever: bm25s.BM25, directory: str) -> None:
    retriever.save(directory, show_progress=False)


def load_retriever(directory: str) -> bm25s.BM25:
    import bm25s

    return bm25s.BM25.load(directory, show_progress=False)


@gin.configurable
class BM25Index:
    """A bm25s index whose document i is passage `ids[i]` of a PassageStore."""

    def __init__(self, store: PassageStore, k1: float = 0.9, b: float = 0.4):
        self.store = store
        self.ids = store.ids()
        self.pages = [store.page_of(pid) for pid in self.ids]
        import bm25s

        self.retriever = bm25s.BM25(k1=k1, b=b)
        corpus = (bm25_tokens(f"{p.title} {p.text}") for p in store)
        self.retriever.index(list(corpus), show_progress=False)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every passage for one query (zeros when no query word is in the KB)."""
        return query_scores(self.retriever, query)

    def search(self, queries: Sequence[str], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per query: the top-k passage indices (best first) and their scores; ties broken by store order.

        The shape of a dense index's search (`retrieval.index.Index.search`), with query texts."""
        rows, scores = [], []
        for query in queries:
            top, top_scores = top_k(self.retriever, query, k)
            rows.append(top)
            scores.append(top_scores)
        return rows, scores

    def score_subset(self, query: str, passage_indices: Sequence[int]) -> np.ndarray:
        """BM25 scores of a few passages (e.g. one page's) without scoring the whole KB."""
        candidates = np.asarray(passage_indices, np.int64)
        out = np.zeros(len(candidates), np.float64)
        sc = self.retriever.scores
        for token in _query_ids(self.retriever, query):
            lo, hi = sc["indptr"][token], sc["indptr"][token + 1]
            docs = sc["indices"][lo:hi]
            hit = np.isin(docs, candidates)
            for doc, value in zip(docs[hit], sc["data"][lo:hi][hit]):
                out[candidates == doc] += value
        return out

    def search_pages(self, query: str, k_pages: int, k_passages: int = 1000) -> list[str]:
        """Pages of the top passages, duplicates removed keeping the first (max-pooling), best first."""
        top, _ = top_k(self.retriever, query, k_passages)
        pages: list[str] = []
        seen: set[str] = set()
        for i in top:
            page = self.pages[i]
            if page not in seen:
                seen.add(page)
                pages.append(page)
                if len(pages) == k_pages:
                    break
        return pages
