"""BM25 hard negatives: top-k passages minus every passage of every gold page, best first.

The output is the shared negatives format (`records.write_negatives`), which model-mined negatives
of later ANCE episodes reuse, so training reads either without knowing where they came from.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from t5_retrieval.data.records import Example, Negatives
from t5_retrieval.data.stores.passages import PassageLookup


class TextIndex(Protocol):
    """What mining reads of a BM25 index (`retrieval.bm25_index.BM25Index`, built by the caller)."""

    passage_ids: list[str]

    def search(self, queries: Sequence[str], k: int) -> tuple[list[np.ndarray], list[np.ndarray]]: ...

    def check(self, encoder: None = None, passage_ids: Sequence[str] | None = None) -> None: ...


def bm25_query(text: str) -> str:
    """KILT markers carry no lexical content for BM25."""
    for marker in ("[SEP]", "[START_ENT]", "[END_ENT]"):
        text = text.replace(marker, " ")
    return text


def mine_bm25_negatives(examples: Sequence[Example], index: TextIndex, passages: PassageLookup,
                        top_k: int = 100) -> Iterator[Negatives]:
    """For each example: the top_k passages of `index` (BM25 over `passages`), dropping its positives
    and those on any gold page."""
    for example in examples:
        gold = {p for s in example.gold_pages for p in s}
        (top,), _ = index.search([bm25_query(example.query)], top_k)
        found = [index.passage_ids[i] for i in top]
        yield Negatives(example.id, tuple(pid for pid in found
                                          if passages.page_of(pid) not in gold and pid not in example.positive_passages))
