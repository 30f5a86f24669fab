"""A ScaNN maximum-inner-product index over KB embeddings, its on-disk form and its safety checks.

`build_index` stages the embedding shards into one disk-backed matrix (a memory map, so the only
in-RAM copy is ScaNN's own) and builds either a tree + asymmetric hashing + exact reordering
searcher (the ScaNN recipe for large sets) or an exact brute-force one (`mode="brute_force"`,
and automatically for sets too small to partition). `Index.save` writes the ScaNN assets next to
`index.json` (model fingerprint, ids digest, build parameters) and the passage ids; `Index.load`
reads them back. `Index.check` refuses a query model or KB the index was not built from: scores
from another model's embedding space would be silently meaningless.

`t5r index --embeddings_dir=... --output_dir=...` runs `build_index` (parameters in gin).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.records import write_json_atomic
from t5_retrieval.data import embedding_store
from t5_retrieval.retrieval.encoder import Encoder
from t5_retrieval.data.passages import ids_digest
from t5_retrieval.errors import ConfigError, UserError, disk_full, is_disk_full, nearly_full

FORMAT = "t5r-scann-index-v1"
REORDER_DTYPES = ("float32", "bfloat16", "int8", "none")
INDEX_JSON = "index.json"
SCANN_DIR = "scann"

log = logging.getLogger(__name__)


class IndexMismatchError(UserError, ValueError):
    """The index was built from another model or another KB than the one it is used with."""


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

    def resolved(self, n: int) -> "ScannConfig":
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
    """Builds a ScaNN searcher with dot-product (MIPS) scoring; `config` must be `resolved`."""
    builder = _scann().builder(matrix, config.num_neighbors, "dot_product")
    if config.mode == "brute_force":
        builder = builder.score_brute_force()
    else:
        builder = builder.tree(num_leaves=config.num_leaves, num_leaves_to_search=config.num_leaves_to_search,
                               training_sample_size=config.training_sample_size)
        builder = builder.score_ah(config.dimensions_per_block,
                                   anisotropic_quantization_threshold=config.anisotropic_quantization_threshold)
        if config.reorders:
            reorder_type = _scann_builder().ReorderType[config.reorder_dtype.upper()]
            builder = builder.reorder(config.reorder_num_neighbors, quantize=reorder_type)
    return builder.set_n_training_threads(config.training_threads).build()


class Index:
    """A ScaNN searcher plus what it was built from: passage ids (row order) and model fingerprint."""

    def __init__(self, searcher: Any, passage_ids: Sequence[str], fingerprint: str, dim: int,
                 config: ScannConfig, source: str = "", meta: dict[str, Any] | None = None,
                 embeddings_dir: str = ""):
        self.searcher = searcher
        # The embeddings directory it was built from (their stored vectors are the index's vectors).
        self.embeddings_dir = embeddings_dir
        self.meta = dict(meta or {})  # The embeddings' provenance (checkpoint, step, KB).
        self.passage_ids = list(passage_ids)
        self.fingerprint = fingerprint
        self.dim = dim
        self.config = config
        self.source = source

    def __len__(self) -> int:
        return len(self.passage_ids)

    def search(self, queries: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Top-k rows and scores per query, best first (fewer than k only when the index is smaller)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape [n, {self.dim}], got {queries.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
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

    def check(self, encoder: Encoder | None = None, passage_ids: Sequence[str] | None = None) -> None:
        """Raises IndexMismatchError unless the index matches the query encoder and the KB's ids."""
        where = self.source or "index"
        if encoder is not None:
            if encoder.fingerprint != self.fingerprint:
                raise IndexMismatchError(
                    f"{where}: built with model fingerprint {self.fingerprint!r} but the query encoder has "
                    f"{encoder.fingerprint!r}; re-encode the KB with this model (t5r encode) and rebuild (t5r index)")
            if encoder.dim != self.dim:
                raise IndexMismatchError(f"{where}: index dim {self.dim} != query encoder dim {encoder.dim}")
        if passage_ids is not None:
            passage_ids = list(passage_ids)
            if passage_ids != self.passage_ids:
                first = next((i for i, (a, b) in enumerate(zip(passage_ids, self.passage_ids)) if a != b),
                             min(len(passage_ids), len(self.passage_ids)))
                raise IndexMismatchError(
                    f"{where}: passage ids do not match the KB ({len(self.passage_ids)} indexed vs "
                    f"{len(passage_ids)} in the KB; first difference at row {first}): rebuild the index for this KB")

    def save(self, directory: str) -> None:
        """Writes ScaNN assets, passage ids and index.json; index.json is written last, as the commit."""
        commit = os.path.join(directory, INDEX_JSON)
        if os.path.exists(commit):  # unpublish first: a crash below must not leave the old index.json over new assets
            os.remove(commit)
        # Without index.json whatever is here is a crashed save's partial assets: start clean.
        shutil.rmtree(os.path.join(directory, SCANN_DIR), ignore_errors=True)
        os.makedirs(os.path.join(directory, SCANN_DIR), exist_ok=True)
        try:
            self.searcher.serialize(os.path.join(directory, SCANN_DIR), relative_path=True)
            with open(os.path.join(directory, embedding_store.IDS_FILE), "w", encoding="utf-8") as f:
                f.writelines(f"{pid}\n" for pid in self.passage_ids)
        except Exception as e:  # ScaNN reports a full disk as a generic RuntimeError
            if is_disk_full(e) or nearly_full(directory):
                raise disk_full(directory, e) from e
            raise
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "dim": self.dim,
                "num_passages": len(self.passage_ids), "ids_sha256": ids_digest(self.passage_ids),
                "scann": dataclasses.asdict(self.config), "meta": self.meta,
                "embeddings_dir": self.embeddings_dir}
        write_json_atomic(os.path.join(directory, INDEX_JSON), meta)

    @classmethod
    def load(cls, directory: str) -> "Index":
        path = os.path.join(directory, INDEX_JSON)
        if not os.path.exists(path):
            raise IndexMismatchError(f"{path}: not an index directory (no {INDEX_JSON}; run `t5r index`)")
        try:
            with open(path, encoding="utf-8") as f:
                meta = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexMismatchError(f"{path}: damaged ({e}); rebuild the index with `t5r index`") from None
        if meta.get("format") != FORMAT:
            raise IndexMismatchError(f"{path}: field 'format' is {meta.get('format')!r}, expected {FORMAT!r}")
        with open(os.path.join(directory, embedding_store.IDS_FILE), encoding="utf-8") as f:
            ids = f.read().splitlines()
        if ids_digest(ids) != meta["ids_sha256"] or len(ids) != meta["num_passages"]:
            raise IndexMismatchError(f"{directory}/{embedding_store.IDS_FILE}: does not match {INDEX_JSON}'s ids_sha256")
        try:
            searcher = _scann().load_searcher(os.path.join(directory, SCANN_DIR))
        except Exception as e:  # ScaNN says "File too short" etc. without naming a file
            raise IndexMismatchError(f"{os.path.join(directory, SCANN_DIR)}: damaged ScaNN assets "
                                     f"({type(e).__name__}: {str(e)[:200]}); rebuild the index with `t5r index`") from None
        return cls(searcher, ids, meta["fingerprint"], int(meta["dim"]), ScannConfig(**meta["scann"]),
                   source=directory, meta=meta.get("meta", {}), embeddings_dir=meta.get("embeddings_dir", ""))


def build_index(embeddings_dir: str, config: ScannConfig | None = None, staging_dir: str | None = None) -> Index:
    """Builds an Index from complete embedding shards, staging them through a disk-backed matrix.

    The staging file (in `staging_dir`, default the system temp dir) is deleted once ScaNN holds its
    own copy, so peak memory is one matrix plus one shard.
    """
    manifest = embedding_store.check_complete(embeddings_dir)
    ids = embedding_store.read_ids(embeddings_dir)
    if ids_digest(ids) != manifest.ids_sha256:
        raise embedding_store.EmbeddingsError(f"{embeddings_dir}/{embedding_store.IDS_FILE}: does not match the manifest")
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
    return Index(searcher, ids, manifest.fingerprint, manifest.dim, config, source=embeddings_dir,
                 meta=manifest.meta, embeddings_dir=os.path.abspath(embeddings_dir))
