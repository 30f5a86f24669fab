"""BM25's scoring over a passage store (bm25s), for the one BM25 class, `retrieval.bm25_index.BM25Index`.

Passages are indexed as "title text" (the title carries most of the page's identity in KILT),
lower-cased, split on `\\w+` and stripped of English stop words; k1 = 0.9, b = 0.4 (Anserini's
defaults, also DPR's BM25 baseline and mini-KILT's reference numbers; gin `index_passages`).

Functions over a bm25s retriever: `index_passages` builds one, `top_k` ranks, `score_subset`
scores a few passages (the page-only labels of `t5r data tasks`), `save_retriever` and
`load_retriever` store it. This is the only module importing bm25s, and it does so only where a
retriever is built or loaded (bm25s imports jax)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import gin
import numpy as np

from t5_retrieval.data.records import Passage

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
