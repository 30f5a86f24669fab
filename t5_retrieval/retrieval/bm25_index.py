"""The BM25 backend: an `Index` like the exact and ScaNN ones, whose queries are texts, not embeddings.

BM25 (Robertson et al.) over the KB's passages, each indexed as "title text", lower-cased, split
on `\\w+`, English stop words dropped; k1 = 0.9 and b = 0.4 (Anserini's defaults, DPR's BM25
baseline and mini-KILT's reference numbers; gin `index_passages.k1`, `index_passages.b`). The score
of passage d for query q is Lucene's BM25 (as bm25s computes it, `data/stores/bm25.py`), summed
over q's words t:

    ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5)) * tf(t, d) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))

(N passages, df(t) of them holding t, |d| the passage's words after stop words are dropped).

It shares the vector backends' directory (`stored_index`: passage ids, index.json written last,
checksums verified on load), their `search(queries, k) -> (rows, scores)` and their `check` against
a KB, so `search.bm25_searcher` and `search.dense_searcher` are the same kind of searcher: `t5r
eval`, fusion's hybrid, the results table's BM25 row, its qa_open recall and `t5r data negatives`
all rank through this class. What differs, because there is no model: it is built from a KB
(`build_bm25_index`, `t5r index --backend=bm25 --kb_dir=...`), not from an embedding store; `dim`
is 0 and `fingerprint` names the parameters ("bm25-k1=0.9-b=0.4"), so `check` refuses any query
encoder; `search` takes a list of query texts (equal scores in row order).

`save` writes bm25s's arrays and vocabulary under `bm25s/`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.retrieval.stored_index import IndexMismatchError, StoredIndex, bm25_rebuild_command

RETRIEVER_DIR = "bm25s"


class BM25Index(StoredIndex):
    """A bm25s retriever whose document i is passage `passage_ids[i]`."""

    backend = "bm25"

    def __init__(self, retriever: Any, passage_ids: Sequence[str], source: str = "",
                 meta: dict[str, Any] | None = None):
        if retriever.scores["num_docs"] != len(passage_ids):
            raise ValueError(f"a BM25 retriever of {retriever.scores['num_docs']} documents for "
                             f"{len(passage_ids)} passage ids")
        super().__init__(passage_ids, f"bm25-k1={retriever.k1}-b={retriever.b}", 0, source, meta)
        self.retriever = retriever

    def search(self, queries: Sequence[str], k: int  # type: ignore[override]  # texts, not vectors: its one difference
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-min(k, n) rows (int64) and BM25 scores (float32) per query text, best first; ties in row order."""
        from t5_retrieval.data.stores import bm25  # bm25s imports jax: only where BM25 is used

        if isinstance(queries, (str, np.ndarray)) or not all(isinstance(q, str) for q in queries):
            raise ValueError(f"{self.source or 'index'}: a BM25 index searches query texts: pass a list of strings "
                             "(search.bm25_searcher), not embeddings")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        found = [bm25.top_k(self.retriever, query, k) for query in queries]
        return [rows.astype(np.int64) for rows, _ in found], [scores.astype(np.float32) for _, scores in found]

    def _write_assets(self, directory: str) -> None:
        from t5_retrieval.data.stores import bm25

        # Without index.json whatever is here is a crashed save's partial assets: start clean.
        shutil.rmtree(os.path.join(directory, RETRIEVER_DIR), ignore_errors=True)
        bm25.save_retriever(self.retriever, os.path.join(directory, RETRIEVER_DIR))

    def _parameters(self) -> dict[str, Any]:
        return {"bm25": {"k1": self.retriever.k1, "b": self.retriever.b, "retriever": RETRIEVER_DIR}}

    @classmethod
    def _load(cls, directory: str, record: dict[str, Any], passage_ids: list[str]) -> BM25Index:
        from t5_retrieval.data.stores import bm25

        path = os.path.join(directory, RETRIEVER_DIR)
        try:
            retriever = bm25.load_retriever(path)
            return cls(retriever, passage_ids, source=directory, meta=record.get("meta", {}))
        except (OSError, ValueError, KeyError, TypeError) as e:  # missing, truncated or not bm25s's files
            raise IndexMismatchError(f"{path}: damaged or missing ({type(e).__name__}: {str(e)[:200]}); "
                                     f"{cls._rebuild_hint(directory, record)}") from None

    @classmethod
    def _rebuild_hint(cls, directory: str, record: dict[str, Any]) -> str:
        return bm25_rebuild_command(directory, record.get("meta", {}).get("kb_dir"))


def build_bm25_index(passages: PassageLookup, kb_dir: str = "") -> BM25Index:
    """BM25 over `passages` in `ids()` order (k1 and b as gin binds `index_passages`); `kb_dir`, the
    KB's directory, is recorded as its source (`meta.kb_dir`)."""
    from t5_retrieval.data.stores import bm25

    return BM25Index(bm25.index_passages(passages), passages.ids(), source=kb_dir,
                     meta={"kb_dir": kb_dir} if kb_dir else {})


def build_bm25_index_for_kb(kb_dir: str) -> BM25Index:
    """BM25 over the passage store in `kb_dir` (`data.stores.kb.PassageStore`), recorded as built from it."""
    from t5_retrieval.data.stores.kb import PassageStore

    return build_bm25_index(PassageStore.open(kb_dir), kb_dir)
