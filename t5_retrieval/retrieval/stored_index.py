"""What every index backend shares: the index directory's layout, its commit order and its checks.

An index directory holds the backend's own assets, `passage_ids.txt` (the row order),
`index.json`, written last as the commit, and `t5r_checksums.json` (size and sha256 of every file,
written after it and verified by every load):

    {"format": "t5r-index-v2", "backend": "scann" | "exact" | "bm25", "fingerprint", "dim", "num_passages",
     "ids_sha256", "meta", "embeddings_dir", <backend>: {its build parameters}}

Directories written before there were backends (format "t5r-scann-index-v1", no "backend" field)
are ScaNN indexes. `StoredIndex` holds what an index was built from (passage ids, model
fingerprint, provenance), checks it against a query model and a KB, and saves and loads the shared
files; a backend adds its assets and its search (`scann_index`, `exact_index`, `bm25_index`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from t5_retrieval import artefact_io, checksums
from t5_retrieval.artefact_io import disk_full, is_disk_full, nearly_full
from t5_retrieval.data.records import write_json_atomic
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.passages import ids_digest
from t5_retrieval.errors import UserError
from t5_retrieval.retrieval.encoder import Encoder, is_encoder_of

FORMAT = "t5r-index-v2"
SCANN_V1_FORMAT = "t5r-scann-index-v1"  # ScaNN-only directories, written before the backend field existed
INDEX_JSON = "index.json"
RECORD_FIELDS = ("backend", "fingerprint", "dim", "num_passages", "ids_sha256")


class IndexMismatchError(UserError, ValueError):
    """The index was built from another model or another KB than the one it is used with, or its
    directory is not a complete index."""


def read_record(directory: str) -> dict[str, Any]:
    """`index.json` of `directory`, with "backend" filled in for a ScaNN directory of format v1;
    read only after it matched its entry in the directory's checksum record."""
    path = os.path.join(directory, INDEX_JSON)
    if not os.path.lexists(path):
        raise IndexMismatchError(f"{path}: not an index directory (no {INDEX_JSON}; run `t5r index`)")
    try:
        record = checksums.verified_json(directory, INDEX_JSON, "index", REBUILD, IndexMismatchError)
    except UserError as e:  # e.g. a build a killed run left unrecorded: say how to build it again
        hint = _unverified_rebuild_hint(directory)
        if hint == REBUILD or not str(e).endswith(REBUILD):
            raise
        raise type(e)(str(e).removesuffix(REBUILD) + hint) from None
    if record.get("format") == SCANN_V1_FORMAT:
        record = {**record, "backend": "scann"}
    elif record.get("format") != FORMAT:
        raise IndexMismatchError(f"{path}: field 'format' is {record.get('format')!r}, expected {FORMAT!r}")
    missing = [field for field in RECORD_FIELDS if field not in record]
    if missing:
        raise IndexMismatchError(f"{path}: damaged (no field {', '.join(map(repr, missing))}); "
                                 "rebuild the index with `t5r index`")
    return record


REBUILD = "rebuild the index with `t5r index`"
HINT_BYTES = 1 << 16  # an index.json is a few hundred bytes


def _unverified_rebuild_hint(directory: str) -> str:
    """The command that builds the index in `directory` again, for a refusal before its index.json
    could be verified: the embeddings directory and backend that file names, read within bounds
    and used for the message's wording only (nothing is loaded from them); REBUILD when it names none."""
    try:
        record = artefact_io.load_json_object(os.path.join(directory, INDEX_JSON), directory, HINT_BYTES)
    except UserError:
        return REBUILD
    embeddings, backend = record.get("embeddings_dir"), record.get("backend")
    if backend == "bm25":  # built from a KB, not from embeddings
        meta = record.get("meta")
        return bm25_rebuild_command(directory, meta.get("kb_dir") if isinstance(meta, dict) else None)
    if not (isinstance(embeddings, str) and embeddings.isprintable() and isinstance(backend, str)
            and backend.isidentifier()):
        return REBUILD
    return f"rebuild it: t5r index --embeddings_dir={embeddings} --output_dir={directory} --backend={backend}"


def bm25_rebuild_command(directory: str, kb_dir: Any) -> str:
    """The `t5r index` command that builds the BM25 index in `directory` again from `kb_dir`."""
    kb = kb_dir if isinstance(kb_dir, str) and kb_dir and kb_dir.isprintable() else "<data_dir>/kb"
    return f"rebuild it: t5r index --backend=bm25 --kb_dir={kb} --output_dir={directory}"


def read_complete_store(embeddings_dir: str) -> tuple[embedding_store.Manifest, list[str]]:
    """The manifest and passage ids of a complete embedding store (what every backend is built from)."""
    manifest = embedding_store.check_complete(embeddings_dir)
    ids = embedding_store.read_ids(embeddings_dir)
    if ids_digest(ids) != manifest.ids_sha256:
        raise embedding_store.EmbeddingsError(f"{embeddings_dir}/{embedding_store.IDS_FILE}: does not match the manifest")
    return manifest, ids


class StoredIndex(abc.ABC):
    """An index's passage ids (row order), model fingerprint and provenance, and its directory.

    Subclasses set `backend` and implement `search`, `_write_assets`, `_parameters` and `_load`.
    """

    backend: ClassVar[str]

    def __init__(self, passage_ids: Sequence[str], fingerprint: str, dim: int, source: str = "",
                 meta: dict[str, Any] | None = None, embeddings_dir: str = ""):
        self.passage_ids = list(passage_ids)
        self.fingerprint = fingerprint
        self.dim = dim
        self.source = source  # where it was built from or loaded from, for error messages
        self.meta = dict(meta or {})  # The embeddings' provenance (checkpoint, step, KB).
        # The embeddings directory it was built from (their stored vectors are the index's vectors).
        self.embeddings_dir = embeddings_dir

    def __len__(self) -> int:
        return len(self.passage_ids)

    def _queries(self, query_embeddings: np.ndarray, k: int) -> np.ndarray:
        """The query embeddings as a contiguous float32 [n, dim] array; refuses another dim or k < 1."""
        queries = np.ascontiguousarray(query_embeddings, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise ValueError(f"queries must have shape [n, {self.dim}], got {queries.shape}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return queries

    def check(self, encoder: Encoder | None = None, passage_ids: Sequence[str] | None = None) -> None:
        """Raises IndexMismatchError unless the index matches the query encoder and the KB's ids. An
        index of dim 0 (BM25) searches query text: it refuses any query encoder."""
        where = self.source or "index"
        if encoder is not None and self.dim == 0:
            raise IndexMismatchError(f"{where}: a {self.backend.upper()} index searches query text and takes no "
                                     f"model (got {encoder.fingerprint!r}); search it without one, or give an index "
                                     "built with `t5r index --embeddings_dir=...`")
        if encoder is not None:
            if not is_encoder_of(encoder, self.fingerprint):
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

    def record(self) -> dict[str, Any]:
        """What index.json holds: the shared fields, then the backend's build parameters."""
        return {"format": FORMAT, "backend": self.backend, "fingerprint": self.fingerprint, "dim": self.dim,
                "num_passages": len(self.passage_ids), "ids_sha256": ids_digest(self.passage_ids),
                "meta": self.meta, "embeddings_dir": self.embeddings_dir, **self._parameters()}

    def save(self, directory: str) -> None:
        """Writes the backend's assets, passage ids and index.json; index.json is written last, as the commit."""
        commit = os.path.join(directory, INDEX_JSON)
        if os.path.exists(commit):  # unpublish first: a crash below must not leave the old index.json over new assets
            os.remove(commit)
        checksums.begin(directory)  # until the record is written, a load says this run was stopped
        try:
            self._write_assets(directory)
            with open(os.path.join(directory, embedding_store.IDS_FILE), "w", encoding="utf-8") as f:
                f.writelines(f"{pid}\n" for pid in self.passage_ids)
        except Exception as e:  # ScaNN reports a full disk as a generic RuntimeError
            if is_disk_full(e) or nearly_full(directory):
                raise disk_full(directory, e) from e
            raise
        write_json_atomic(commit, self.record())
        checksums.record(directory)  # every file, index.json included: verified by `load`

    @classmethod
    def load(cls, directory: str) -> StoredIndex:
        """The index saved in `directory`; IndexMismatchError if it is damaged or another backend's."""
        record = read_record(directory)
        if record["backend"] != cls.backend:
            raise IndexMismatchError(f"{os.path.join(directory, INDEX_JSON)}: field 'backend' is "
                                     f"{record['backend']!r}, not {cls.backend!r} (index.load_index reads any backend)")
        path = os.path.join(directory, embedding_store.IDS_FILE)
        rebuild = cls._rebuild_hint(directory, record)
        files = checksums.verify(directory, "index", rebuild)  # the ids and the backend's assets, before any is read
        if embedding_store.IDS_FILE not in files:
            raise IndexMismatchError(f"{path}: missing; rebuild the index with `t5r index`")
        ids = checksums.read_verified_text(directory, embedding_store.IDS_FILE, files, rebuild).splitlines()
        if ids_digest(ids) != record["ids_sha256"] or len(ids) != record["num_passages"]:
            raise IndexMismatchError(f"{path}: does not match {INDEX_JSON}'s ids_sha256")
        return cls._load(directory, record, ids)

    @classmethod
    def _rebuild_hint(cls, directory: str, record: dict[str, Any]) -> str:
        """The command that builds this index again, from the embeddings it records."""
        if not record.get("embeddings_dir"):
            return "rebuild it with `t5r index`"
        return (f"rebuild it: t5r index --embeddings_dir={record['embeddings_dir']} --output_dir={directory} "
                f"--backend={record['backend']}")

    @abc.abstractmethod
    def search(self, query_embeddings: np.ndarray, k: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per query: the top-k rows (int64) and their scores (float32), best first (see `index.Index`)."""

    @abc.abstractmethod
    def _write_assets(self, directory: str) -> None:
        """Writes the backend's own files into `directory` (replacing a previous save's)."""

    @abc.abstractmethod
    def _parameters(self) -> dict[str, Any]:
        """The backend's entry of index.json, e.g. {"scann": {build parameters}}."""

    @classmethod
    @abc.abstractmethod
    def _load(cls, directory: str, record: dict[str, Any], passage_ids: list[str]) -> StoredIndex:
        """The backend's index from its assets in `directory`, given the checked record and ids."""
