"""The exact backend: brute-force maximum inner product search in NumPy, for small KBs and as the oracle.

Every query is scored against every passage, so the result is the true top-k by dot product, and
equal scores are ordered by row (the lower row first): the ranking is a pure function of the
embeddings, which makes this backend the reference the ScaNN backend is tested against. Scores
are computed a tile of at most `SCORE_TILE` query x passage pairs at a time (a few hundred queries
against a block of passages), and each block's top k is merged into the running top k, so search
memory stays bounded whatever the KB size; the cost is n x dim multiply-adds per query.

`ExactIndex.save` writes the matrix as `embeddings.npy` (float32 [n, dim]) next to the shared
files (`stored_index`); `load` memory-maps it, so only the pages searched are read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5_retrieval.artefact_io import replaced_on_success
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.retrieval.stored_index import IndexMismatchError, StoredIndex, read_complete_store

MATRIX_FILE = "embeddings.npy"
QUERY_CHUNK = 256  # queries scored together
SCORE_TILE = 1 << 21  # query x passage scores held at once (8 MiB of float32)


def _tile_top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns and scores [q, min(k, m)] of each row's k highest scores, best first, equal scores by column.

    `np.partition` finds the k-th highest score t in O(m); every score above t is taken, and of the
    scores equal to t the leftmost ones fill the remaining places, so ties never depend on the
    partition's internal order.
    """
    m = scores.shape[1]
    if k < m:
        kth = np.partition(scores, m - k, axis=1)[:, m - k, None]
        above = scores > kth
        tied = scores == kth
        places = k - above.sum(axis=1, keepdims=True)
        taken = above | (tied & (np.cumsum(tied, axis=1, dtype=np.int32) <= places))
        columns = np.nonzero(taken)[1].reshape(len(scores), k)
    else:
        columns = np.broadcast_to(np.arange(m), scores.shape)
    return _best_first(columns, np.take_along_axis(scores, columns, axis=1), k)


def _best_first(rows: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The first k of (rows, scores) [q, c] sorted by descending score, then ascending row."""
    order = np.lexsort((rows, -scores), axis=1)[:, :k]
    return np.take_along_axis(rows, order, axis=1), np.take_along_axis(scores, order, axis=1)


def exact_top_k(matrix: np.ndarray, queries: np.ndarray, k: int, tile: int = SCORE_TILE
                ) -> tuple[np.ndarray, np.ndarray]:
    """Rows int64 [q, min(k, n)] and scores float32 of each query's highest dot products with the
    rows of `matrix` [n, d], best first, equal scores in row order; at most ~`tile` scores at once."""
    n = len(matrix)
    k = min(k, n)
    if not len(queries):
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    chunk = min(len(queries), QUERY_CHUNK)
    block = max(k, tile // chunk)  # passages per tile: at least k, so one block's top k is all it adds
    all_rows, all_scores = [], []
    for start in range(0, len(queries), chunk):
        batch = queries[start:start + chunk]
        rows = np.zeros((len(batch), 0), np.int64)
        scores = np.zeros((len(batch), 0), np.float32)
        for first in range(0, n, block):
            columns, block_scores = _tile_top_k(batch @ np.asarray(matrix[first:first + block]).T, k)
            rows, scores = _best_first(np.concatenate([rows, columns + first], axis=1),
                                       np.concatenate([scores, block_scores], axis=1), k)
        all_rows.append(rows)
        all_scores.append(scores)
    return np.concatenate(all_rows).astype(np.int64), np.concatenate(all_scores).astype(np.float32)


class ExactIndex(StoredIndex):
    """The KB's embedding matrix, searched exhaustively, plus what it was built from."""

    backend = "exact"

    def __init__(self, matrix: np.ndarray, passage_ids: Sequence[str], fingerprint: str, source: str = "",
                 meta: dict[str, Any] | None = None, embeddings_dir: str = ""):
        if matrix.ndim != 2 or len(matrix) != len(passage_ids):
            raise ValueError(f"matrix of shape {matrix.shape} for {len(passage_ids)} passage ids")
        super().__init__(passage_ids, fingerprint, matrix.shape[1], source, meta, embeddings_dir)
        self.matrix = matrix

    def search(self, query_embeddings: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-min(k, n) rows and scores per query, best first; equal scores in row order."""
        queries = self._queries(query_embeddings, k)
        if not len(queries):
            return [], []
        if not np.isfinite(queries).all():
            raise ValueError("query embeddings hold NaN or infinite values")
        rows, scores = exact_top_k(self.matrix, queries, k)
        return list(rows), list(scores)

    def _write_assets(self, directory: str) -> None:
        path = os.path.join(directory, MATRIX_FILE)
        # A new file renamed into place: an index loaded from here keeps reading its own (memory-mapped) copy.
        with replaced_on_success(path, ".npy") as tmp:
            np.save(tmp, np.asarray(self.matrix, np.float32))

    def _parameters(self) -> dict[str, Any]:
        return {"exact": {"matrix": MATRIX_FILE}}

    @classmethod
    def _load(cls, directory: str, record: dict[str, Any], passage_ids: list[str]) -> ExactIndex:
        path = os.path.join(directory, MATRIX_FILE)
        expected = (len(passage_ids), int(record["dim"]))
        try:
            matrix = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:  # missing, truncated, or not an .npy file
            raise IndexMismatchError(f"{path}: damaged or missing ({type(e).__name__}: {str(e)[:200]}); "
                                     "rebuild the index with `t5r index`") from None
        if matrix.dtype != np.float32 or matrix.shape != expected:
            raise IndexMismatchError(f"{path}: damaged (float32 {expected} expected, found {matrix.dtype} "
                                     f"{matrix.shape}); rebuild the index with `t5r index`")
        return cls(matrix, passage_ids, record["fingerprint"], source=directory, meta=record.get("meta", {}),
                   embeddings_dir=record.get("embeddings_dir", ""))


def build_exact_index(embeddings_dir: str) -> ExactIndex:
    """An ExactIndex over complete embedding shards, read into one float32 matrix in RAM."""
    manifest, ids = read_complete_store(embeddings_dir)
    return ExactIndex(embedding_store.load_matrix(embeddings_dir), ids, manifest.fingerprint, source=embeddings_dir,
                      meta=manifest.meta, embeddings_dir=os.path.abspath(embeddings_dir))
