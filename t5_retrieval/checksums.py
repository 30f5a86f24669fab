"""Content checksums of finished artefacts: recorded when an artefact is complete, verified when opened.

Every artefact a later stage trusts (a passage store, an embedding shard, an index, an export, a
checkpoint step, the demo slice) is written whole and then described by a checksum record: the size
and sha256 of each of its files. `t5r_checksums.json` does this for a directory; an embedding shard,
written by one of many processes, carries its own `<shard>.sha256.json`. Opening an artefact
verifies the record both ways: every listed file is there with its size and hash, and every file
there is listed (or carries its own sidecar). So a flipped byte, a truncated, missing or added file
is an error naming the file, never a silently different result, and a record with an entry removed
or emptied vouches for nothing. An artefact without a record is refused too: a writer that was
stopped before recording leaves `t5r_checksums.pending` and is told to run again; one from an older
version is recorded as it is now by `t5r checksum --accept <dir>`, after the user has checked it.

Cost. Hashing reads every byte (about 1 GB/s here), which is nothing for mini-KILT and minutes for
the full KILT index. So a verification leaves a stamp, `t5r_verified.json`: each file's size,
mtime, ctime and inode when its hash last matched. A later open hashes only the files whose stat
differs from the stamp; ctime is set by the kernel on every write, chmod or restore (`cp -a` too),
so no copy or edit keeps it. A bit that rots in place without a write is found by a full
verification: `t5r checksum <dir>`, or `--verify=full` on the commands that open artefacts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from t5_retrieval import artefact_io
from t5_retrieval.artefact_io import open_replaced_on_success
from t5_retrieval.errors import DiskFullError, UserError

CHECKSUMS_FILE = "t5r_checksums.json"
STAMP_FILE = "t5r_verified.json"
PENDING_FILE = "t5r_checksums.pending"  # a writer has started; removed when its record is written
SIDECAR_SUFFIX = ".sha256.json"
ALGORITHM = "sha256"
VERIFY_MODES = ("stamp", "full")
_CHUNK = 4 << 20
# `stages.py` marks a finished stage's directory (an embeddings or index directory too) with this
# file, written after the artefact's record; it says the stage ran, and no stage reads data from it.
STAGE_MARKER = "DONE"
OWN_FILES = (CHECKSUMS_FILE, STAMP_FILE, PENDING_FILE)
_OWN_TEMPORARIES = tuple(f"{name}.tmp-" for name in OWN_FILES)  # `_write_json`'s
_NOT_CONTENT = (*OWN_FILES, STAGE_MARKER)  # files of a directory that are no part of its artefact
_DIGEST = re.compile(r"[0-9a-f]{64}")
RECORD_BYTES = 64 << 20  # the most a record or stamp holds (the full KILT index's: a few hundred KiB)
SIDECAR_BYTES = 4096  # a sidecar's one entry
_mode = "stamp"


class ChecksumError(UserError):
    """A file of an artefact is missing, truncated, altered or unlisted, or its record is absent or malformed."""


# A path is a str (a local file) or an `etils.epath.Path` (a checkpoint, maybe on an object store).
Path = Any


def _size(path: Path) -> int:
    return os.path.getsize(path) if isinstance(path, str) else path.stat().length


def _exists(path: Path) -> bool:
    return os.path.exists(path) if isinstance(path, str) else path.exists()


def sha256_file(path: Path) -> str:
    """The one file hash of the project. Streamed in chunks: a file of any size costs 4 MiB of memory."""
    digest = hashlib.sha256()
    with open(path, "rb") if isinstance(path, str) else path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def verification(mode: str) -> Iterator[None]:
    """Within it, `verify` trusts the stamp ("stamp") or hashes every file ("full"): what a
    command's `--verify` flag sets for the artefacts it opens."""
    global _mode
    if mode not in VERIFY_MODES:
        raise ValueError(f"verification mode {mode!r} is not one of {VERIFY_MODES}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def entry(path: Path) -> dict[str, Any]:
    """What a record holds for one file."""
    return {"size": _size(path), ALGORITHM: sha256_file(path)}


def record_doc(files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A checksum record of these entries (the one format, for directories and checkpoints)."""
    return {"algorithm": ALGORITHM, "files": files}


def _stat_key(path: str, digest: str) -> list[Any]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]


def artefact_files(directory: str) -> list[str]:
    """Every file under `directory` (relative, sorted), but the checksum record, stamp and pending
    marker themselves (and their temporaries, which a process killed while writing them leaves),
    the stage marker, sidecars and the files that carry one."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if (rel in _NOT_CONTENT or rel.startswith(_OWN_TEMPORARIES) or name.endswith(SIDECAR_SUFFIX)
                    or name + SIDECAR_SUFFIX in files):
                continue
            found.append(rel)
    return sorted(found)


def files_under(directory: Path, prefix: str = "") -> list[str]:
    """Every file under `directory` (an `etils.epath.Path`: a checkpoint step, local or on an object
    store), relative, sorted, but its checksum record, stamp and pending marker: what a checkpoint
    step's record lists. (`artefact_files` lists a local artefact, leaving out sidecars, the files
    that carry one and the stage marker too.)"""
    found = []
    for child in directory.iterdir():
        if child.is_dir():
            found += files_under(child, f"{prefix}{child.name}/")
        elif prefix or child.name not in OWN_FILES:
            found.append(prefix + child.name)
    return sorted(found)


def _write_json(path: str, doc: dict[str, Any]) -> None:
    with open_replaced_on_success(path) as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def begin(directory: str) -> None:
    """Marks `directory` as being written: its old record and stamp go, and until `record` a missing
    record is reported as an interrupted run rather than an older version's artefact."""
    os.makedirs(directory, exist_ok=True)
    for name in (CHECKSUMS_FILE, STAMP_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, name))
    with open(os.path.join(directory, PENDING_FILE), "w", encoding="utf-8") as f:
        f.write("a t5r command is writing this artefact; its checksums are recorded when it finishes\n")


def record(directory: str, names: list[str] | None = None, accepted: dict[str, Any] | None = None) -> dict[str, Any]:
    """Writes `t5r_checksums.json` for the finished artefact in `directory` (every file in it, or
    `names` where other processes are still adding files that carry sidecars) and a stamp, since the
    files were just hashed as they are. `accepted`: why a user vouched for the files (`t5r checksum
    --accept`), kept in the record. Returns the record."""
    names = artefact_files(directory) if names is None else sorted(names)
    if not names:
        raise ChecksumError(f"{directory}: no files to record checksums of")
    files = {name: entry(os.path.join(directory, name)) for name in names}
    doc = record_doc(files) | ({"accepted": accepted} if accepted else {})
    _write_json(os.path.join(directory, CHECKSUMS_FILE), doc)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, PENDING_FILE))
    _write_stamp(directory, {name: _stat_key(os.path.join(directory, name), files[name][ALGORITHM])
                             for name in names})
    return doc


def record_file(path: str) -> None:
    """Writes `<path>.sha256.json` for one finished file (an embedding shard written by one process)."""
    _write_json(path + SIDECAR_SUFFIX, {"algorithm": ALGORITHM, **entry(path)})


def check_file(path: Path, expected: dict[str, Any], where: str, rebuild: str, inside: str | None = None) -> None:
    """Raises ChecksumError unless `path` has the size and hash of `expected` (an entry of `where`),
    and, a local file, is a regular file inside the directory `inside` (default: its own)."""
    if not _exists(path):
        raise ChecksumError(f"{path}: missing (listed in {where}); {rebuild}")
    if isinstance(path, str):
        artefact_io.check_regular(path, inside or os.path.dirname(path) or ".", ChecksumError, rebuild)
    size = _size(path)
    if size != expected["size"]:
        raise ChecksumError(f"{path}: {size} bytes where {expected['size']} were written (truncated or "
                            f"overwritten); {rebuild}")
    if sha256_file(path) != expected[ALGORITHM]:
        raise ChecksumError(f"{path}: fails its {ALGORITHM} checksum (altered since it was written); {rebuild}")


def _shape(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_entry(value: Any, where: str, fix: str) -> dict[str, Any]:
    size = value.get("size") if isinstance(value, dict) else None
    digest = value.get(ALGORITHM) if isinstance(value, dict) else None
    if (not isinstance(size, int) or isinstance(size, bool) or size < 0
            or not isinstance(digest, str) or not _DIGEST.fullmatch(digest)):
        raise ChecksumError(f"{where}: expected {{\"size\": bytes, \"{ALGORITHM}\": 64 hex digits}}, got "
                            f"{_shape(value)}; {fix}")
    return value


def _check_algorithm(doc: Any, where: str, fix: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ChecksumError(f"{where}: not a checksum record (a JSON {type(doc).__name__}, expected an object); {fix}")
    if doc.get("algorithm") != ALGORITHM:
        raise ChecksumError(f"{where}: field 'algorithm' is {_shape(doc.get('algorithm'))}, expected "
                            f"\"{ALGORITHM}\"; {fix}")
    return doc


def _safe_name(name: str) -> bool:
    """A relative path inside the artefact (a record must not vouch for files outside it)."""
    parts = name.split("/")
    return bool(name) and not os.path.isabs(name) and ".." not in parts and "" not in parts


def parse_record(doc: Any, where: str, fix: str) -> dict[str, dict[str, Any]]:
    """The `files` of a checksum record read from `where`; ChecksumError naming the field for any
    other shape, an empty listing included (it would vouch for nothing)."""
    files = _check_algorithm(doc, where, fix).get("files")
    if not isinstance(files, dict) or not files:
        raise ChecksumError(f"{where}: field 'files' is {_shape(files) if 'files' in doc else 'absent'}, expected "
                            f"an object listing every file of the artefact; {fix}")
    for name, value in files.items():
        if not _safe_name(name):
            raise ChecksumError(f"{where}: files[{json.dumps(name)}]: not a relative path inside the artefact; {fix}")
        _check_entry(value, f"{where}: files[{json.dumps(name)}]", fix)
    return files


def parse_sidecar(doc: Any, where: str, fix: str) -> dict[str, Any]:
    """The one entry of a `<file>.sha256.json` sidecar; ChecksumError for any other shape."""
    return _check_entry(_check_algorithm(doc, where, fix), where, fix)


def _load_json(path: str, fix: str, limit: int = RECORD_BYTES) -> Any:
    """A record or sidecar: a regular file of its artefact, at most `limit` bytes of JSON of bounded depth."""
    try:
        return artefact_io.load_json(path, os.path.dirname(path) or ".", limit, ChecksumError)
    except ChecksumError as e:
        raise ChecksumError(f"{path}: unreadable checksum record ({str(e).removeprefix(path + ': ')}); {fix}"
                            ) from None


def _accept_fix(directory: str, rebuild: str) -> str:
    return f"{rebuild}; or, if you have checked the files and trust them: t5r checksum --accept {directory}"


def _missing_record(directory: str, what: str, rebuild: str) -> ChecksumError:
    if os.path.exists(os.path.join(directory, PENDING_FILE)):
        return ChecksumError(
            f"{directory}: {what} has no {CHECKSUMS_FILE}: the run writing it stopped before recording its "
            f"checksums ({PENDING_FILE} is left), so it may be incomplete; {rebuild}")
    return ChecksumError(
        f"{directory}: {what} has no {CHECKSUMS_FILE} (written by an older t5-retrieval, or not by t5r); "
        f"if you trust it, record its checksums as it is now: t5r checksum --accept {directory}")


def read_record(directory: str, what: str, rebuild: str) -> dict[str, dict[str, Any]]:
    """The files `directory`'s record lists, each {"size", "sha256"}; ChecksumError if it has none
    or a malformed one."""
    path = os.path.join(directory, CHECKSUMS_FILE)
    if not os.path.exists(path):
        raise _missing_record(directory, what, rebuild)
    fix = _accept_fix(directory, rebuild)
    return parse_record(_load_json(path, fix), path, fix)


def check_listing(directory: str, listed: dict[str, Any], on_disk: list[str], rebuild: str) -> None:
    """Raises ChecksumError for a file present but not listed, or listed but not present."""
    where = os.path.join(directory, CHECKSUMS_FILE)
    unlisted = sorted(set(on_disk) - set(listed))
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        raise ChecksumError(
            f"{os.path.join(directory, unlisted[0])}: not listed in {where}{more}, so nothing vouches for it; "
            f"{rebuild}; or, if it belongs there and you trust it: t5r checksum --accept {directory}")
    present = set(on_disk)
    for name in sorted(set(listed) - present):
        if not os.path.isfile(os.path.join(directory, name + SIDECAR_SUFFIX)):
            raise ChecksumError(f"{os.path.join(directory, name)}: missing (listed in {where}); {rebuild}")


def verify(directory: str, what: str, rebuild: str, *, full: bool = False, stamp: bool = True
           ) -> dict[str, dict[str, Any]]:
    """Verifies the artefact in `directory` against its record; raises ChecksumError naming the file.
    Returns the record's files ({name: {"size", "sha256"}}): a caller reads at most `size` bytes of each.

    `what` names the artefact for messages ("passage store"); `rebuild` says how to make it again.
    Files unchanged since the stamp are not hashed again unless `full` or `verification("full")`.
    `stamp=False`: leave no stamp (an export, which must carry nothing of this machine)."""
    files = read_record(directory, what, rebuild)
    check_listing(directory, files, artefact_files(directory), rebuild)
    record_path = os.path.join(directory, CHECKSUMS_FILE)
    stamped = {} if full or _mode == "full" or not stamp else _read_stamp(directory)
    fresh = {}
    for name, expected in files.items():
        path = os.path.join(directory, name)
        if not os.path.exists(path):  # a file that has since got its own sidecar: verified by it
            continue
        key = _stat_key(path, expected[ALGORITHM])
        if stamped.get(name) != key:
            check_file(path, expected, record_path, rebuild, directory)
            key = _stat_key(path, expected[ALGORITHM])
        fresh[name] = key
    if stamp and fresh != stamped:
        _write_stamp(directory, fresh)
    return files


def verified_json(directory: str, name: str, what: str, rebuild: str,
                  error: type[UserError] = ChecksumError) -> Any:
    """The JSON document in the file `name` of the artefact in `directory` (its manifest, say),
    parsed only after it matched its entry in the artefact's record: what a caller reads before
    verifying the whole artefact, e.g. to say how to rebuild it. Content that is no JSON object is
    `error`."""
    files = read_record(directory, what, rebuild)
    path, record_path = os.path.join(directory, name), os.path.join(directory, CHECKSUMS_FILE)
    if name not in files:
        raise ChecksumError(f"{path}: not listed in {record_path}, so nothing vouches for it; {rebuild}")
    check_file(path, files[name], record_path, rebuild, directory)
    return artefact_io.load_json_object(path, directory, files[name]["size"], error, rebuild)


def read_verified_text(directory: str, name: str, files: dict[str, dict[str, Any]], rebuild: str) -> str:
    """The text of the file `name` of an artefact `verify` just returned the record `files` of:
    at most its recorded size, UTF-8."""
    path = os.path.join(directory, name)
    size = files[name]["size"] if name in files else 0
    return artefact_io.read_text(path, size, directory, ChecksumError, rebuild)


def verify_file(path: str, what: str, rebuild: str) -> None:
    """Verifies one file against its `<path>.sha256.json` sidecar, or against its directory's record
    when an older artefact was accepted whole (`t5r checksum --accept`). Always hashes: the caller
    reads the whole file next anyway."""
    if not os.path.exists(path):
        raise ChecksumError(f"{path}: missing; {rebuild}")
    sidecar = path + SIDECAR_SUFFIX
    if os.path.exists(sidecar):
        check_file(path, parse_sidecar(_load_json(sidecar, rebuild, SIDECAR_BYTES), sidecar, rebuild), sidecar,
                   rebuild)
        return
    directory, name = os.path.split(path)
    directory = directory or "."
    record_path = os.path.join(directory, CHECKSUMS_FILE)
    files = read_record(directory, what, rebuild) if os.path.exists(record_path) else {}
    if name not in files:
        raise ChecksumError(f"{path}: no {os.path.basename(sidecar)} and not in {record_path}, so nothing "
                            f"vouches for it; {rebuild}")
    check_file(path, files[name], record_path, rebuild, directory)


def _read_stamp(directory: str) -> dict[str, Any]:
    """The stamp, or {} (every file hashed) for one that is missing, malformed, or not a regular
    file of the artefact of at most RECORD_BYTES."""
    try:
        stamp = artefact_io.load_json(os.path.join(directory, STAMP_FILE), directory, RECORD_BYTES, ChecksumError)
    except (OSError, ChecksumError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _write_stamp(directory: str, keys: dict[str, list[Any]]) -> None:
    """{file: [size, mtime_ns, ctime_ns, inode, sha256 it matched]}. Best effort: where the artefact
    is read-only or its disk full the old stamp stays, and files whose stat changed since are hashed
    on every open: a read (`t5r eval`) never fails for want of writing it."""
    try:
        _write_json(os.path.join(directory, STAMP_FILE), keys)
    except (OSError, DiskFullError):
        pass


def verify_all(directory: str, stamp: bool = True) -> tuple[int, int]:
    """Hashes every file the records in `directory` list (its `t5r_checksums.json` and any sidecars),
    ignoring the stamp, and refuses a file no record lists; returns (files, bytes) verified. What
    `t5r checksum <dir>` runs. `stamp=False`: write no stamp (an export)."""
    if not os.path.isdir(directory):
        raise ChecksumError(f"{directory}: not a directory")
    rebuild = "rebuild it with the t5r command that wrote it"
    sidecars = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in sorted(names)
                if name.endswith(SIDECAR_SUFFIX)]
    count = size = 0
    if os.path.exists(os.path.join(directory, CHECKSUMS_FILE)) or not sidecars:
        verify(directory, "this artefact", rebuild, full=True, stamp=stamp)
        files = read_record(directory, "this artefact", rebuild)
        count, size = len(files), sum(value["size"] for value in files.values())
    else:
        check_listing(directory, {}, artefact_files(directory), rebuild)
    for sidecar in sidecars:
        path = sidecar[:-len(SIDECAR_SUFFIX)]
        check_file(path, parse_sidecar(_load_json(sidecar, rebuild, SIDECAR_BYTES), sidecar, rebuild), sidecar,
                   rebuild, directory)
        count, size = count + 1, size + os.path.getsize(path)
    return count, size
