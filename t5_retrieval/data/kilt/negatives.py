"""BM25 hard negatives: top-k passages minus every passage of every gold page, best first.

The output is the shared negatives format (`records.write_negatives`), which model-mined negatives
of later ANCE episodes reuse, so training reads either without knowing where they came from.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from t5_retrieval.data.records import Example, Negatives
from t5_retrieval.data.stores.bm25 import BM25Index


def bm25_query(text: str) -> str:
    """KILT markers carry no lexical content for BM25."""
    for marker in ("[SEP]", "[START_ENT]", "[END_ENT]"):
        text = text.replace(marker, " ")
    return text


def mine_bm25_negatives(examples: Sequence[Example], index: BM25Index, top_k: int = 100) -> Iterator[Negatives]:
    """For each example: the top_k BM25 passages, dropping its positives and those on any gold page."""
    for example in examples:
        gold = {p for s in example.gold_pages for p in s}
        (top,), _ = index.search([bm25_query(example.query)], top_k)
        yield Negatives(example.id, tuple(index.ids[i] for i in top
                                          if index.pages[i] not in gold and index.ids[i] not in example.positive_passages))
