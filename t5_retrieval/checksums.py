"""Content checksums of finished artefacts: recorded when an artefact is complete, verified when opened.

Every artefact a later stage trusts (a passage store, an embedding shard, an index, an export, a
checkpoint step, the demo slice) is written whole and then described by a checksum record: the size
and sha256 of each of its files. `t5r_checksums.json` does this for a directory; an embedding shard,
written by one of many processes, carries its own `<shard>.sha256.json`. Opening an artefact
verifies the record, so a flipped byte, a truncated or a missing file is an error naming the file,
never a silently different result. An artefact without a record (from an older version) is refused
too; `t5r checksum --accept <dir>` records it as it is now, after the user has checked it.

Cost. Hashing reads every byte (about 1 GB/s here), which is nothing for mini-KILT and minutes for
the full KILT index. So a full verification leaves a stamp, `t5r_verified.json`: each file's size,
modification time and inode when its hash last matched. A later open hashes only the files whose
stat differs from the stamp (any rewrite, copy or restore changes it); a bit that rots in place
without a write is found by `t5r checksum <dir>`, which always hashes everything. The stamp is
written only where the artefact is writable; elsewhere every open hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from t5_retrieval.errors import UserError, open_replaced_on_success

CHECKSUMS_FILE = "t5r_checksums.json"
STAMP_FILE = "t5r_verified.json"
SIDECAR_SUFFIX = ".sha256.json"
ALGORITHM = "sha256"
_CHUNK = 4 << 20
_OWN_FILES = (CHECKSUMS_FILE, STAMP_FILE)


class ChecksumError(UserError):
    """A file of an artefact is missing, truncated or altered since it was written, or has no record."""


def sha256_file(path: str) -> str:
    """Streamed in chunks: a file of any size costs 4 MiB of memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _entry(path: str) -> dict[str, Any]:
    return {"size": os.path.getsize(path), ALGORITHM: sha256_file(path)}


def _stat_key(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def artefact_files(directory: str) -> list[str]:
    """Every file under `directory` (relative, sorted), but the checksum record and stamp themselves
    and files that carry their own sidecar records."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel not in _OWN_FILES and not name.endswith(SIDECAR_SUFFIX):
                found.append(rel)
    return sorted(found)


def _write_json(path: str, doc: dict[str, Any]) -> None:
    with open_replaced_on_success(path) as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def record(directory: str) -> dict[str, Any]:
    """Writes `t5r_checksums.json` for the finished artefact in `directory` (every file in it) and a
    stamp, since the files were just hashed as they are. Returns the record."""
    files = {name: _entry(os.path.join(directory, name)) for name in artefact_files(directory)}
    doc = {"algorithm": ALGORITHM, "files": files}
    _write_json(os.path.join(directory, CHECKSUMS_FILE), doc)
    _write_stamp(directory, {name: [*_stat_key(os.path.join(directory, name)), entry[ALGORITHM]]
                             for name, entry in files.items()})
    return doc


def record_file(path: str) -> None:
    """Writes `<path>.sha256.json` for one finished file (an embedding shard written by one process)."""
    _write_json(path + SIDECAR_SUFFIX, {"algorithm": ALGORITHM, **_entry(path)})


def _check(path: str, expected: dict[str, Any], where: str, rebuild: str) -> None:
    if not os.path.exists(path):
        raise ChecksumError(f"{path}: missing (listed in {where}); {rebuild}")
    size = os.path.getsize(path)
    if size != expected["size"]:
        raise ChecksumError(f"{path}: {size} bytes where {expected['size']} were written (truncated or "
                            f"overwritten); {rebuild}")
    if sha256_file(path) != expected[ALGORITHM]:
        raise ChecksumError(f"{path}: fails its {ALGORITHM} checksum (altered since it was written); {rebuild}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ChecksumError(f"{path}: unreadable checksum record ({e}); check the artefact and run "
                            f"`t5r checksum --accept {os.path.dirname(path) or '.'}`") from None
    if doc.get("algorithm") != ALGORITHM:
        raise ChecksumError(f"{path}: algorithm {doc.get('algorithm')!r}, expected {ALGORITHM!r}")
    return doc


def _missing_record(directory: str, what: str) -> ChecksumError:
    return ChecksumError(
        f"{directory}: {what} has no {CHECKSUMS_FILE} (written by an older t5-retrieval, or not by t5r); "
        f"if you trust it, record its checksums as it is now: t5r checksum --accept {directory}")


def _recorded(directory: str, what: str) -> tuple[str, dict[str, Any]]:
    record_path = os.path.join(directory, CHECKSUMS_FILE)
    if not os.path.exists(record_path):
        raise _missing_record(directory, what)
    return record_path, _read_json(record_path).get("files", {})


def verify(directory: str, what: str, rebuild: str, *, full: bool = False) -> None:
    """Verifies the artefact in `directory` against its record; raises ChecksumError naming the file.

    `what` names the artefact for messages ("passage store"); `rebuild` says how to make it again.
    Files unchanged since the stamp are not hashed again unless `full`."""
    record_path, files = _recorded(directory, what)
    stamp = {} if full else _read_stamp(directory)
    fresh = {}
    for name, expected in files.items():
        path = os.path.join(directory, name)
        key = [*_stat_key(path), expected[ALGORITHM]] if os.path.exists(path) else None
        if key is None or stamp.get(name) != key:
            _check(path, expected, record_path, rebuild)
            key = [*_stat_key(path), expected[ALGORITHM]]
        fresh[name] = key
    if fresh != stamp:
        _write_stamp(directory, fresh)


def verify_file(path: str, what: str, rebuild: str) -> None:
    """Verifies one file against its `<path>.sha256.json` sidecar, or against its directory's record
    when an older artefact was accepted whole (`t5r checksum --accept`). Always hashes: the caller
    reads the whole file next anyway."""
    if not os.path.exists(path):
        raise ChecksumError(f"{path}: missing; {rebuild}")
    sidecar = path + SIDECAR_SUFFIX
    if os.path.exists(sidecar):
        _check(path, _read_json(sidecar), sidecar, rebuild)
        return
    directory, name = os.path.split(path)
    record_path, files = _recorded(directory or ".", what)
    if name not in files:
        raise ChecksumError(f"{path}: not in {record_path} and no {os.path.basename(sidecar)}; {rebuild}")
    _check(path, files[name], record_path, rebuild)


def _read_stamp(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, STAMP_FILE), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_stamp(directory: str, keys: dict[str, list[Any]]) -> None:
    """{file: [size, mtime_ns, inode, sha256 it matched]}. Best effort: where the artefact is read-only,
    every open hashes."""
    try:
        _write_json(os.path.join(directory, STAMP_FILE), keys)
    except OSError:
        pass


def verify_all(directory: str) -> tuple[int, int]:
    """Hashes every file the records in `directory` list (its `t5r_checksums.json` and any sidecars),
    ignoring the stamp; returns (files, bytes) verified. What `t5r checksum <dir>` runs."""
    if not os.path.isdir(directory):
        raise ChecksumError(f"{directory}: not a directory")
    count = size = 0
    rebuild = "rebuild the artefact with the command that wrote it"
    if os.path.exists(os.path.join(directory, CHECKSUMS_FILE)):
        verify(directory, "this artefact", rebuild, full=True)
        files = _read_json(os.path.join(directory, CHECKSUMS_FILE))["files"]
        count, size = len(files), sum(entry["size"] for entry in files.values())
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            if name.endswith(SIDECAR_SUFFIX):
                path = os.path.join(root, name[:-len(SIDECAR_SUFFIX)])
                _check(path, _read_json(os.path.join(root, name)), name, rebuild)
                count, size = count + 1, size + os.path.getsize(path)
    if not count:
        raise _missing_record(directory, "this directory")
    return count, size
