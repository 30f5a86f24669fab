"""KB embeddings on disk: fixed-size float shards plus a manifest, written resumably by many hosts.

Layout of an embeddings directory:

    manifest.json                 format, model fingerprint, dim, dtype, counts, ids digest, meta
    passage_ids.txt               one passage id per line, in row order
    t5r_checksums.json            size and sha256 of the two files above
    shard-00000-of-00012.npy      rows [0, shard_size) as a [rows, dim] array
    shard-00000-of-00012.npy.sha256.json   its size and sha256, written by the process that wrote it
    ...

Shard i always holds rows [i * shard_size, (i + 1) * shard_size), so every process can compute the
plan alone: process p of P writes its own contiguous range of shards (`process_shards`). A shard is
written to a temporary file and renamed, so a shard file that exists is complete; resuming skips
those whose checksum matches and encodes again the others (damaged, or without their sidecar). A
manifest that disagrees with the run (another model, another KB, another dim or shard size) is
refused instead of mixing embeddings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import gin
import numpy as np

from t5_retrieval import artefact_io, checksums
from t5_retrieval.artefact_io import disk_full, remove_stale_temporaries, replaced_on_success
from t5_retrieval.data.records import Passage, write_json_atomic, write_text_atomic
from t5_retrieval.data.stores.passages import ids_digest
from t5_retrieval.errors import ConfigError, UserError

FORMAT = "t5r-embeddings-v1"
MANIFEST = "manifest.json"
IDS_FILE = "passage_ids.txt"
DTYPES = ("float32", "float16")

log = logging.getLogger(__name__)


class PassageEncoder(Protocol):
    """What writing embeddings needs of a model: the passage side of the retrieval `Encoder`."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray: ...


@gin.configurable
def encode_settings(shard_size: int = 50_000, batch_size: int = 1024, dtype: str = "float32") -> dict:
    """Keyword arguments for `write_embeddings`: rows per shard file, passages per encoder call and
    stored dtype (float32 or float16). One gin-configurable place, shared by `t5r encode` and the
    ANCE orchestrator. The encoder sorts each call's passages by length and cuts its device batches
    to their longest row, so larger calls waste less padding (mini-KILT: 62% of the full-width cost
    at 256 passages per call, 52% at 1024)."""
    return {"shard_size": shard_size, "batch_size": batch_size, "dtype": dtype}


class EmbeddingsError(UserError, ValueError):
    """An embeddings directory that is missing, incomplete or inconsistent with the run."""


@dataclasses.dataclass(frozen=True)
class Manifest:
    fingerprint: str
    dim: int
    dtype: str
    num_passages: int
    shard_size: int
    ids_sha256: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_shards(self) -> int:
        return -(-self.num_passages // self.shard_size)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        start = shard * self.shard_size
        return start, min(start + self.shard_size, self.num_passages)

    def shard_name(self, shard: int) -> str:
        return f"shard-{shard:05d}-of-{self.num_shards:05d}.npy"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self), "num_shards": self.num_shards, "ids_file": IDS_FILE}

    @classmethod
    def from_json(cls, row: dict[str, Any], path: str) -> Manifest:
        if row.get("format") != FORMAT:
            raise EmbeddingsError(f"{path}: field 'format' is {row.get('format')!r}, expected {FORMAT!r}")
        try:
            return cls(fingerprint=str(row["fingerprint"]), dim=int(row["dim"]), dtype=str(row["dtype"]),
                       num_passages=int(row["num_passages"]), shard_size=int(row["shard_size"]),
                       ids_sha256=str(row["ids_sha256"]), meta=dict(row.get("meta", {})))
        except KeyError as e:
            raise EmbeddingsError(f"{path}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise EmbeddingsError(f"{path}: a field has a value of the wrong type ({e})") from None


def read_manifest(directory: str) -> Manifest:
    """The manifest, read only after it matched its entry in the directory's checksum record."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.lexists(path):
        raise EmbeddingsError(f"{path}: no embeddings manifest (run `t5r encode` first)")
    row = checksums.verified_json(directory, MANIFEST, "embeddings directory", _rerun_hint(directory), EmbeddingsError)
    return Manifest.from_json(row, path)


def read_ids(directory: str) -> list[str]:
    """The passage ids, read only after they matched their entry in the directory's checksum record."""
    rebuild = _rerun_hint(directory)
    files = checksums.read_record(directory, "embeddings directory", rebuild)
    if IDS_FILE in files:
        checksums.check_file(os.path.join(directory, IDS_FILE), files[IDS_FILE],
                             os.path.join(directory, checksums.CHECKSUMS_FILE), rebuild, directory)
    return checksums.read_verified_text(directory, IDS_FILE, files, rebuild).splitlines()


def prepare(directory: str, manifest: Manifest, passage_ids: Sequence[str],
            older_fingerprint: Callable[[], str | None] = lambda: None) -> Manifest:
    """Writes the manifest and ids, or checks that an existing run in `directory` is the same run;
    returns the run's manifest. A run an older version started with the same model recorded the
    fingerprint that version computed (`older_fingerprint()`, the encoder's `legacy_fingerprint`):
    it resumes under that fingerprint, so its shards and the new ones stay one store.
    Shards a crashed run was writing (`shard-*.tmp-<host>-<pid>.npy` of a finished process) are removed."""
    os.makedirs(directory, exist_ok=True)
    for path in remove_stale_temporaries(directory):
        log.info("removed %s, left by a crashed run", path)
    path = os.path.join(directory, MANIFEST)
    record = os.path.join(directory, checksums.CHECKSUMS_FILE)
    if os.path.exists(record):  # only the files it lists: other processes may be adding shards right now
        fresh = "encode into a new --output_dir"
        for name, expected in checksums.read_record(directory, "embeddings directory", fresh).items():
            checksums.check_file(os.path.join(directory, name), expected, record, fresh)
    if os.path.exists(path):
        existing = read_manifest(directory)
        if existing.fingerprint != manifest.fingerprint and existing.fingerprint == older_fingerprint():
            manifest = dataclasses.replace(manifest, fingerprint=existing.fingerprint)
        for field in ("fingerprint", "dim", "dtype", "num_passages", "shard_size", "ids_sha256"):
            old, new = getattr(existing, field), getattr(manifest, field)
            if old != new:
                raise EmbeddingsError(
                    f"{path}: field {field!r} is {old!r} but this run has {new!r}; "
                    "refusing to mix embeddings: use a fresh output directory")
        return manifest
    write_text_atomic(os.path.join(directory, IDS_FILE), "".join(f"{pid}\n" for pid in passage_ids))
    write_json_atomic(path, manifest.to_json())
    checksums.record(directory, [MANIFEST, IDS_FILE])  # the shards carry their own sidecars
    return manifest


def process_shards(num_shards: int, process_index: int, process_count: int) -> range:
    """The contiguous range of shards that process `process_index` of `process_count` writes."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    per, extra = divmod(num_shards, process_count)
    start = process_index * per + min(process_index, extra)
    return range(start, start + per + (process_index < extra))


def shard_problem(directory: str, manifest: Manifest, shard: int) -> str | None:
    """What is wrong with a shard's file ("missing", "truncated ...", ...), or None when it has the
    planned shape and size (renames are atomic, so a shard is either whole or was damaged later)."""
    path = os.path.join(directory, manifest.shard_name(shard))
    if not os.path.exists(path):
        return "missing"
    try:  # a FIFO would block np.load, a link out of the directory is not this run's shard
        artefact_io.check_regular(path, directory, EmbeddingsError)
    except EmbeddingsError as e:
        return str(e).partition(": ")[2]
    start, stop = manifest.shard_rows(shard)
    expected = (stop - start, manifest.dim)
    try:
        array = np.load(path, mmap_mode="r")
    except ValueError as e:
        # numpy refuses to map a file shorter than its header says ("mmap length is greater than file size").
        return f"truncated or damaged ({os.path.getsize(path)} bytes: {e})"
    except OSError as e:
        return f"unreadable ({e})"
    if array.shape != expected:
        return f"has shape {array.shape}, expected {expected}"
    size = os.path.getsize(path)
    if size < array.offset + array.nbytes:
        return f"truncated ({size} of {array.offset + array.nbytes} bytes)"
    return None


def shard_done(directory: str, manifest: Manifest, shard: int) -> bool:
    return shard_problem(directory, manifest, shard) is None


def _to_encode(directory: str, manifest: Manifest, shard: int) -> bool:
    """Whether this process must (re)write `shard`: it is kept only when whole and matching its
    checksum record, so a rerun repairs a damaged shard or one whose sidecar is missing."""
    problem = shard_problem(directory, manifest, shard)
    path = os.path.join(directory, manifest.shard_name(shard))
    if problem is None:
        try:
            checksums.verify_file(path, "embeddings directory", "encoding it again")
        except checksums.ChecksumError as e:
            log.warning("%s", e)
            return True
    elif problem != "missing":
        log.warning("%s: %s; encoding it again", path, problem)
    return problem is not None


def missing_shards(directory: str, manifest: Manifest) -> list[int]:
    return [s for s in range(manifest.num_shards) if not shard_done(directory, manifest, s)]


def _batches(items: list[Passage], size: int) -> Iterator[list[Passage]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


@dataclasses.dataclass(frozen=True)
class EncodeReport:
    shards_written: tuple[int, ...]
    shards_skipped: tuple[int, ...]
    complete: bool


def write_embeddings(
    encoder: PassageEncoder,
    passages: Iterable[Passage],
    passage_ids: Sequence[str],
    directory: str,
    *,
    shard_size: int = 50_000,
    batch_size: int = 256,
    dtype: str = "float32",
    process_index: int = 0,
    process_count: int = 1,
    meta: dict[str, Any] | None = None,
    progress: bool = True,
) -> EncodeReport:
    """Embeds this process's shards of the KB into `directory`, skipping shards already on disk.

    `passages` iterates the KB in the order of `passage_ids` (a `PassageStore` or a list); only this
    process's rows are encoded, in batches of `batch_size`, and each finished shard is renamed into
    place before the next begins, so an interrupted run resumes at the first missing shard.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"encode_settings.dtype must be one of {DTYPES}, got {dtype!r}")
    if shard_size < 1 or batch_size < 1:
        raise ConfigError(f"encode_settings: shard_size and batch_size must be >= 1, got {shard_size}, {batch_size}")
    if not passage_ids:
        raise EmbeddingsError("the KB has no passages to encode")
    manifest = Manifest(fingerprint=encoder.fingerprint, dim=encoder.dim, dtype=dtype,
                        num_passages=len(passage_ids), shard_size=shard_size,
                        ids_sha256=ids_digest(passage_ids), meta=dict(meta or {}))
    manifest = prepare(directory, manifest, passage_ids, lambda: getattr(encoder, "legacy_fingerprint", None))
    mine = process_shards(manifest.num_shards, process_index, process_count)
    todo = [s for s in mine if _to_encode(directory, manifest, s)]
    skipped = tuple(s for s in mine if s not in todo)
    log.info("process %d of %d: shards [%d, %d) of %d, %d of them already on disk", process_index, process_count,
             mine.start, mine.stop, manifest.num_shards, len(skipped))

    from tqdm import tqdm  # Imported here: only encoding shows progress.

    rows_todo = sum(manifest.shard_rows(s)[1] - manifest.shard_rows(s)[0] for s in todo)
    bar = tqdm(total=rows_todo, unit="passage", desc=f"encode p{process_index}", disable=not progress)
    todo_set = set(todo)
    iterator = iter(passages)
    row = 0
    for shard in range(mine.start, mine.stop) if todo else ():
        start, stop = manifest.shard_rows(shard)
        chunk = []
        while row < stop:
            try:
                passage = next(iterator)
            except StopIteration:
                raise EmbeddingsError(f"the KB ended at row {row}, but its ids list {manifest.num_passages}") from None
            if passage.id != passage_ids[row]:
                raise EmbeddingsError(
                    f"KB row {row}: passage id {passage.id!r} differs from ids list entry {passage_ids[row]!r}")
            if row >= start and shard in todo_set:
                chunk.append(passage)
            row += 1
        if shard not in todo_set:
            continue
        out = np.empty((stop - start, manifest.dim), dtype)
        offset = 0
        for batch in _batches(chunk, batch_size):
            vectors = np.asarray(encoder.encode_passages(batch))
            if vectors.shape != (len(batch), manifest.dim):
                raise EmbeddingsError(
                    f"encoder returned shape {vectors.shape} for {len(batch)} passages, expected "
                    f"({len(batch)}, {manifest.dim})")
            out[offset:offset + len(batch)] = vectors
            offset += len(batch)
            bar.update(len(batch))
        path = os.path.join(directory, manifest.shard_name(shard))
        with replaced_on_success(path, ".npy") as tmp:
            try:
                np.save(tmp, out)
            except OSError as e:  # numpy reports a full disk as "N requested and M written"
                raise disk_full(path, e) from e
            # The sidecar (itself written whole) is renamed first, so a shard never stands without it.
            checksums.record_file(tmp)
            os.replace(tmp + checksums.SIDECAR_SUFFIX, path + checksums.SIDECAR_SUFFIX)
        log.info("process %d: wrote %s (rows [%d, %d))", process_index, manifest.shard_name(shard), start, stop)
    bar.close()
    return EncodeReport(tuple(todo), skipped, complete=not missing_shards(directory, manifest))


def _rerun_hint(directory: str) -> str:
    return (f"rerun the `t5r encode` that wrote {directory} (it encodes again each shard that fails its checksum "
            f"or has none; a damaged {MANIFEST} or {IDS_FILE} needs a new --output_dir)")


def check_complete(directory: str, manifest: Manifest | None = None) -> Manifest:
    """The manifest of a directory whose every shard is written and whose manifest and ids match
    their record (each shard is verified against its own when read: `iter_shards`)."""
    checksums.verify(directory, "embeddings directory", _rerun_hint(directory))
    manifest = manifest or read_manifest(directory)
    problems = {s: p for s in range(manifest.num_shards) if (p := shard_problem(directory, manifest, s))}
    if not problems:
        return manifest
    if all(p == "missing" for p in problems.values()):
        names = ", ".join(manifest.shard_name(s) for s in list(problems)[:5])
        raise EmbeddingsError(
            f"{directory}: {len(problems)} of {manifest.num_shards} shards missing ({names}"
            f"{', ...' if len(problems) > 5 else ''}); finish `t5r encode` on every process first")
    shard, problem = next((s, p) for s, p in problems.items() if p != "missing")
    how_many = f" ({len(problems)} shards need it)" if len(problems) > 1 else ""
    raise EmbeddingsError(
        f"{os.path.join(directory, manifest.shard_name(shard))}: {problem}; rerun the `t5r encode` that wrote "
        f"{directory} (it rewrites the shards that are not whole and keeps the others){how_many}")


def iter_shards(directory: str, manifest: Manifest | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Yields (first row, memory-mapped shard) in row order, each verified against its checksum first
    (a flipped byte would otherwise be indexed or trained on in silence)."""
    manifest = check_complete(directory, manifest)
    rebuild = f"rerun the `t5r encode` that wrote {directory}: it encodes this shard again"
    for shard in range(manifest.num_shards):
        path = os.path.join(directory, manifest.shard_name(shard))
        checksums.verify_file(path, "embeddings directory", rebuild)
        yield manifest.shard_rows(shard)[0], np.load(path, mmap_mode="r")


def load_matrix(directory: str, out: np.ndarray | None = None) -> np.ndarray:
    """All embeddings as one float32 [num_passages, dim] matrix, filled shard by shard into `out`.

    Pass a preallocated array (e.g. an `np.lib.format.open_memmap`) to control where the single
    copy lives; only one shard is paged in beyond it at a time.
    """
    manifest = check_complete(directory)
    shape = (manifest.num_passages, manifest.dim)
    if out is None:
        out = np.empty(shape, np.float32)
    elif out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    for start, shard in iter_shards(directory, manifest):
        out[start:start + len(shard)] = shard
    return out
