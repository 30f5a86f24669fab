"""The index interface every caller uses and its three backends.

An index ranks one KB's passages for a batch of queries and is checked against the query model and
the KB it is used with. Callers (eval, mine, serve, `Searcher`, query-side, fusion, export) type
against the `Index` protocol, search it through `search.PassageSearcher` (the one path from query
texts to ranked passages) and open it with `load_index`, which reads the backend recorded in the
directory's index.json. Two backends answer maximum-inner-product search over passage embeddings,
built from a complete embedding store (`t5r encode`) by `build_index`, the backend chosen in gin
(`build_index.backend`) or by `t5r index --backend`:

- "scann" (`scann_index`, the default): ScaNN, exact brute force below 50k points, tree +
  asymmetric hashing + reordering above (parameters in gin, `ScannConfig`).
- "exact" (`exact_index`): brute force in NumPy, equal scores in row order; for small KBs, and the
  oracle the ScaNN backend is tested against.

The third, "bm25" (`bm25_index`), searches query texts with BM25; it is built from a KB
(`build_bm25_index`), has no model (dim 0) and refuses a query encoder.

`t5r index --embeddings_dir=... --output_dir=... [--backend=scann|exact]` (`commands/index.py`)
runs `build_index`; `t5r index --backend=bm25 --kb_dir=... --output_dir=...` runs `build_bm25_index`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import gin
import numpy as np

from t5_retrieval.errors import UserError
from t5_retrieval.retrieval.bm25_index import BM25Index, build_bm25_index, build_bm25_index_for_kb  # noqa: F401
from t5_retrieval.retrieval.encoder import Encoder
from t5_retrieval.retrieval.exact_index import ExactIndex, build_exact_index
from t5_retrieval.retrieval.scann_index import ScannIndex, build_scann_index
from t5_retrieval.retrieval.stored_index import INDEX_JSON, IndexMismatchError, StoredIndex, read_record

BACKENDS: dict[str, type[StoredIndex]] = {"scann": ScannIndex, "exact": ExactIndex, "bm25": BM25Index}
# The backends `build_index` builds from a complete embedding store: (embeddings_dir, staging_dir) -> index.
BUILDERS: dict[str, Callable[[str, str | None], StoredIndex]] = {
    "scann": lambda embeddings_dir, staging_dir: build_scann_index(embeddings_dir, staging_dir=staging_dir),
    "exact": lambda embeddings_dir, staging_dir: build_exact_index(embeddings_dir),
}


@runtime_checkable
class Index(Protocol):
    """A KB's passages ranked for a batch of queries, whatever the backend.

    Rows are the KB's passages in `passage_ids` order (the embedding store's). `search` takes the
    backend's queries (float32 embeddings [n, dim] for scann and exact, a list of texts for bm25)
    and k >= 1 and returns, per query, the rows (int64; the passage is `passage_ids[row]`) and
    scores (float32: dot products, or BM25) of its top min(k, len) passages, best first. `check`
    raises IndexMismatchError for a query encoder of another model (fingerprint, dim; bm25: any
    encoder) or a KB with other passage ids; `save` writes a directory that `load_index` reads back.
    """

    backend: ClassVar[str]  # the name index.json records: "scann", "exact" or "bm25"
    passage_ids: list[str]
    fingerprint: str  # the model that embedded the passages ("bm25-k1=...-b=..." for bm25)
    dim: int  # 0 for bm25
    meta: dict[str, Any]  # the embeddings' provenance (checkpoint, step, KB)
    embeddings_dir: str  # the embedding store it was built from ("" if unknown)

    def __len__(self) -> int: ...

    def search(self, queries: Any, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]: ...

    def check(self, encoder: Encoder | None = None, passage_ids: Sequence[str] | None = None) -> None: ...

    def save(self, directory: str) -> None: ...


@gin.configurable(denylist=["embeddings_dir", "staging_dir"])
def build_index(embeddings_dir: str, backend: str = "scann", staging_dir: str | None = None) -> Index:
    """An index of `backend` over a complete embedding store (ScaNN's parameters: gin `ScannConfig`).

    `staging_dir`: disk for ScaNN's temporary matrix (default: the system temp dir).
    """
    if backend == "bm25":
        raise UserError("a bm25 index (--backend or gin build_index.backend) is built from a KB, not from embeddings: "
                        "t5r index --backend=bm25 --kb_dir=<data_dir>/kb --output_dir=<index_dir>")
    if backend not in BUILDERS:
        raise UserError(f"index backend {backend!r} (--backend or gin build_index.backend): "
                        f"choose one of {', '.join(BUILDERS)}")
    return BUILDERS[backend](embeddings_dir, staging_dir)


def load_index(directory: str) -> Index:
    """The index saved in `directory`, by the backend its index.json records."""
    backend = read_record(directory)["backend"]
    if backend not in BACKENDS:
        raise IndexMismatchError(f"{directory}/{INDEX_JSON}: field 'backend' is {backend!r}; this t5r reads "
                                 f"{', '.join(BACKENDS)}")
    return BACKENDS[backend].load(directory)

