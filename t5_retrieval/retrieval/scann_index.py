"""The ScaNN backend: a maximum-inner-product ScaNN searcher over KB embeddings (the default).

`build_scann_index` stages the embedding shards into one disk-backed matrix (a memory map, so the
only in-RAM copy is ScaNN's own) and builds either a tree + asymmetric hashing + exact reordering
searcher (the ScaNN recipe for large sets) or an exact brute-force one (`mode="brute_force"`,
and automatically for sets too small to partition). `ScannIndex.save` writes the ScaNN assets into
`scann/` next to the shared files (`stored_index`), with the build parameters under "scann" in
index.json. This is the only module that imports ScaNN.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.stores import embedding_store
from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval.stored_index import IndexMismatchError, StoredIndex, read_complete_store

REORDER_DTYPES = ("float32", "bfloat16", "int8", "none")
SCANN_DIR = "scann"

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ScannConfig:
    """ScaNN build parameters; None means "derive from the dataset size" (see `resolved`).

    mode: "auto" (tree + AH when the set has >= min_points_for_tree points, else brute force:
      below ~50k points exact search costs a few ms per query and partitioning buys nothing),
      "tree_ah" or "brute_force" (exact).
    num_leaves: k-means partitions, default ~sqrt(n) (ScaNN needs num_leaves <= n).
    num_leaves_to_search: partitions probed per query, default ~num_leaves / 10 (at least 8).
    dimensions_per_block: AH sub-space size (2 is ScaNN's accuracy-oriented default).
    anisotropic_quantization_threshold: AH loss threshold for MIPS (ScaNN paper: 0.2).
    reorder_num_neighbors: AH candidates re-scored exactly from the reordering copy; raised to k at
      search time.
    reorder_dtype: the reordering copy's storage: "float32" (exact), "bfloat16" or "int8" (half and a
      quarter of the memory, recall@100 0.999 and 0.996 at 1M x 768), or "none" (no copy: AH scores
      are final; with dimensions_per_block=1 this is the layout that fits 36M x 768 in 16 GB).
    training_sample_size: points sampled for k-means / AH training, default min(n, 100k).
    """

    mode: str = "auto"
    num_leaves: int | None = None
    num_leaves_to_search: int | None = None
    dimensions_per_block: int = 2
    anisotropic_quantization_threshold: float = 0.2
    reorder_num_neighbors: int = 500
    reorder_dtype: str = "float32"
    training_sample_size: int | None = None
    min_points_for_tree: int = 50_000
    num_neighbors: int = 100
    training_threads: int = 0

    def resolved(self, n: int) -> ScannConfig:
        """Fills the size-dependent defaults for a set of n points and picks the mode."""
        if self.mode not in ("auto", "tree_ah", "brute_force"):
            raise ConfigError(f"ScannConfig.mode must be auto, tree_ah or brute_force, got {self.mode!r}")
        if self.reorder_dtype not in REORDER_DTYPES:
            raise ConfigError(f"ScannConfig.reorder_dtype must be one of {', '.join(REORDER_DTYPES)}, "
                              f"got {self.reorder_dtype!r}")
        counts = ("num_leaves", "num_leaves_to_search", "dimensions_per_block", "reorder_num_neighbors",
                  "training_sample_size", "num_neighbors")
        below_one = [f"{name}={getattr(self, name)}" for name in counts
                     if getattr(self, name) is not None and getattr(self, name) < 1]
        if below_one:  # ScaNN would divide by them or refuse them only while building
            raise ConfigError(f"ScannConfig: {', '.join(below_one)}; these must be >= 1")
        mode = self.mode
        if mode == "auto":
            mode = "tree_ah" if n >= self.min_points_for_tree else "brute_force"
            if mode == "brute_force":
                log.warning("index: %d points < min_points_for_tree=%d: using exact brute force", n,
                            self.min_points_for_tree)
        if mode == "brute_force":
            return dataclasses.replace(self, mode=mode)
        leaves = self.num_leaves or max(1, int(round(math.sqrt(n))))
        if leaves > n:
            raise ConfigError(f"ScannConfig.num_leaves={leaves} exceeds the {n} points to index")
        to_search = self.num_leaves_to_search or min(leaves, max(8, leaves // 10))
        return dataclasses.replace(self, mode=mode, num_leaves=leaves, num_leaves_to_search=min(to_search, leaves),
                                   training_sample_size=self.training_sample_size or min(n, 100_000))

    @property
    def reorders(self) -> bool:
        """Whether AH candidates are re-scored from a reordering copy (never for exact search)."""
        return self.mode != "brute_force" and self.reorder_dtype != "none"


def _scann():
    # ScaNN imports TensorFlow: only the stages that build or load an index pay for it.
    from scann.scann_ops.py import scann_ops_pybind
    return scann_ops_pybind


def _scann_builder():
    from scann.scann_ops.py import scann_builder
    return scann_builder


def build_searcher(matrix: np.ndarray, config: ScannConfig) -> Any:
    """Builds a ScaNN searcher with dot-product (MIPS) scoring; `config` must be `resolved`.

    The tree's k-means starts from k-means++ centres rather than ScaNN's default random ones, which
    are drawn differently on every build: with them the same embeddings give the same index (its
    AH codebooks are seeded already), whatever the number of training threads.
    """
    builder = _scann().builder(matrix, config.num_neighbors, "dot_product")
    if config.mode == "brute_force":
        builder = builder.score_brute_force()
    else:
        builder = builder.tree(num_leaves=config.num_leaves, num_leaves_to_search=config.num_leaves_to_search,
                               training_sample_size=config.training_sample_size, random_init=False)
        builder = builder.score_ah(config.dimensions_per_block,
                                   anisotropic_quantization_threshold=config.anisotropic_quantization_threshold)
        if config.reorders:
            reorder_type = _scann_builder().ReorderType[config.reorder_dtype.upper()]
            builder = builder.reorder(config.reorder_num_neighbors, quantize=reorder_type)
    return builder.set_n_training_threads(config.training_threads).build()


class ScannIndex(StoredIndex):
    """A ScaNN searcher plus what it was built from: passage ids (row order) and model fingerprint."""

    backend = "scann"

    def __init__(self, searcher: Any, passage_ids: Sequence[str], fingerprint: str, dim: int,
                 config: ScannConfig, source: str = "", meta: dict[str, Any] | None = None,
                 embeddings_dir: str = ""):
        super().__init__(passage_ids, fingerprint, dim, source, meta, embeddings_dir)
        self.searcher = searcher
        self.config = config

    def search(self, query_embeddings: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-k rows and scores per query, best first (fewer than k only when the index is smaller,
        or when tree + AH's probed partitions hold fewer than k points); ties in ScaNN's order."""
        queries = self._queries(query_embeddings, k)
        k = min(k, len(self))
        if not len(queries):
            return [], []
        kwargs = {"final_num_neighbors": k}
        if self.config.reorders:
            kwargs["pre_reorder_num_neighbors"] = max(k, self.config.reorder_num_neighbors)
        rows, scores = self.searcher.search_batched(queries, **kwargs)
        # ScaNN pads short result lists with row 0 and a NaN score.
        keep = np.isfinite(scores)
        return ([r[m].astype(np.int64) for r, m in zip(rows, keep)], [s[m] for s, m in zip(scores, keep)])

    def _write_assets(self, directory: str) -> None:
        # Without index.json whatever is here is a crashed save's partial assets: start clean.
        shutil.rmtree(os.path.join(directory, SCANN_DIR), ignore_errors=True)
        os.makedirs(os.path.join(directory, SCANN_DIR), exist_ok=True)
        self.searcher.serialize(os.path.join(directory, SCANN_DIR), relative_path=True)

    def _parameters(self) -> dict[str, Any]:
        return {"scann": dataclasses.asdict(self.config)}

    @classmethod
    def _load(cls, directory: str, record: dict[str, Any], passage_ids: list[str]) -> ScannIndex:
        try:
            searcher = _scann().load_searcher(os.path.join(directory, SCANN_DIR))
        except Exception as e:  # ScaNN says "File too short" etc. without naming a file
            raise IndexMismatchError(f"{os.path.join(directory, SCANN_DIR)}: damaged ScaNN assets "
                                     f"({type(e).__name__}: {str(e)[:200]}); rebuild the index with `t5r index`") from None
        return cls(searcher, passage_ids, record["fingerprint"], int(record["dim"]), ScannConfig(**record["scann"]),
                   source=directory, meta=record.get("meta", {}), embeddings_dir=record.get("embeddings_dir", ""))


def build_scann_index(embeddings_dir: str, config: ScannConfig | None = None,
                      staging_dir: str | None = None) -> ScannIndex:
    """Builds a ScannIndex from complete embedding shards, staging them through a disk-backed matrix.

    The staging file (in `staging_dir`, default the system temp dir) is deleted once ScaNN holds its
    own copy, so peak memory is one matrix plus one shard.
    """
    manifest, ids = read_complete_store(embeddings_dir)
    config = (config or ScannConfig()).resolved(manifest.num_passages)
    staging = tempfile.mkdtemp(prefix="t5r-index-", dir=staging_dir)
    try:
        matrix = np.lib.format.open_memmap(os.path.join(staging, "matrix.npy"), mode="w+", dtype=np.float32,
                                           shape=(manifest.num_passages, manifest.dim))
        embedding_store.load_matrix(embeddings_dir, out=matrix)
        log.info("index: building %s over %d x %d", config.mode, manifest.num_passages, manifest.dim)
        searcher = build_searcher(matrix, config)
        del matrix
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ScannIndex(searcher, ids, manifest.fingerprint, manifest.dim, config, source=embeddings_dir,
                      meta=manifest.meta, embeddings_dir=os.path.abspath(embeddings_dir))
