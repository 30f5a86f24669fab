"""Reading and writing an artefact's files: bounded reads of what someone handed over, writes that
appear whole or not at all, and a full disk or a second writer reported as such.

Every record, stamp, sidecar, manifest and `index.json` the project reads, and every file a
checksum record lists, is opened here. A file is read only when it is a regular file (not a FIFO,
whose open or read would block, nor a device such as `/dev/zero`, which never ends) that lies inside
its artefact (a symbolic link may point within it, not out of it); at most `limit` bytes are read
(a record's size for a file it lists); and JSON is parsed only when it nests at most
`MAX_JSON_DEPTH` levels, so no input reaches Python's recursion limit. Each refusal is an error
of the caller's class naming the file: one line, exit status 2 from `t5r`.

Every output is written under a temporary name and renamed into place (`replaced_on_success`), so a
reader sees the old file or the whole new one and a crash leaves a name the next run removes
(`remove_stale_temporaries`); an output directory is checked writable before the work
(`check_writable_dir`), and one writer at a time holds it (`directory_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from t5_retrieval.errors import DiskFullError, LockedError, UserError

MAX_JSON_DEPTH = 64  # the project's records nest 4 levels; a model config 5
MAX_JSON_BYTES = 64 << 20  # a record of every file of the full KILT index is a few hundred KiB
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type ("array" for a list)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _hint(fix: str) -> str:
    return f"; {fix}" if fix else ""


def outside(path: str, inside: str) -> str | None:
    """Where `path` really is (symbolic links followed) when that is outside the directory `inside`; else None."""
    real, root = os.path.realpath(path), os.path.realpath(inside)
    return None if real == root or real.startswith(root.rstrip(os.sep) + os.sep) else real


def check_regular(path: str, inside: str | None = None, error: type[UserError] = UserError, fix: str = "") -> None:
    """Raises `error` unless `path` is a regular file (symbolic links followed) inside `inside`;
    FileNotFoundError when there is nothing there."""
    if inside is not None and (real := outside(path, inside)) is not None:
        raise error(f"{path}: a symbolic link to {real}, outside {inside}; an artefact's files are its own{_hint(fix)}")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise error(f"{path}: {_kind(mode)}, not a regular file{_hint(fix)}")


def open_regular(path: str, inside: str | None = None, error: type[UserError] = UserError, fix: str = ""):  # -> BinaryIO
    """`path` opened for binary reading, refused (`error`) unless it is a regular file inside
    `inside`. Opened without blocking and checked on the open descriptor: a FIFO put there in the
    meantime is refused, not waited on."""
    check_regular(path, inside, error, fix)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{path}: {_kind(mode)}, not a regular file{_hint(fix)}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str, limit: int, inside: str | None = None, error: type[UserError] = UserError,
               fix: str = "") -> bytes:
    """At most `limit` bytes: the whole of `path`, refused (`error`) when it holds more."""
    with open_regular(path, inside, error, fix) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{path}: more than {limit} bytes, more than this file can hold{_hint(fix)}")
    return data


def read_text(path: str, limit: int, inside: str | None = None, error: type[UserError] = UserError,
              fix: str = "") -> str:
    """`read_bytes` decoded as UTF-8; undecodable bytes are `error` naming the offset."""
    data = read_bytes(path, limit, inside, error, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}){_hint(fix)}") from None


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets inside strings not counted)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b'""', data)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(data: bytes, where: str, error: type[UserError] = UserError, fix: str = "") -> Any:
    """JSON of at most MAX_JSON_DEPTH levels; `error` naming `where` for anything else."""
    if json_depth(data) > MAX_JSON_DEPTH:
        raise error(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels, which no t5r file is{_hint(fix)}")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}){_hint(fix)}") from None
    except ValueError as e:
        raise error(f"{where}: not valid JSON ({e}){_hint(fix)}") from None


def load_json(path: str, inside: str | None = None, limit: int = MAX_JSON_BYTES, error: type[UserError] = UserError,
              fix: str = "") -> Any:
    """The JSON document in the file `path` (a regular file inside `inside`, at most `limit` bytes,
    `MAX_JSON_DEPTH` levels deep); `error` naming the file for anything else."""
    return parse_json(read_bytes(path, limit, inside, error, fix), path, error, fix)


def load_json_object(path: str, inside: str | None = None, limit: int = MAX_JSON_BYTES,
                     error: type[UserError] = UserError, fix: str = "") -> dict[str, Any]:
    """`load_json` of a file that must hold a JSON object."""
    doc = load_json(path, inside, limit, error, fix)
    if not isinstance(doc, dict):
        raise error(f"{path}: a JSON {json_type(doc)}, expected an object{_hint(fix)}")
    return doc


_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT; also read from the message, since gin's re-raised copy of an exception that
    passed through a configurable keeps the text but not `errno`."""
    if not isinstance(error, OSError):
        return False
    return error.errno in _FULL or any(f"[Errno {code}]" in str(error) for code in _FULL)


def disk_full(path: str, error: BaseException | None = None) -> DiskFullError:
    """The error for a write that ran out of space at `path` (earlier outputs are complete and kept)."""
    free = _free_bytes(path)
    detail = f" ({error})" if error is not None and not is_disk_full(error) else ""
    return DiskFullError(f"{path}: no space left on the device{detail}"
                     + (f"; {free / 2**20:.0f} MiB free" if free is not None else "")
                     + ". Free space (or choose another output directory) and rerun: finished outputs are kept "
                       "and the run resumes")


def nearly_full(path: str, margin: int = 16 << 20) -> bool:
    """Whether the filesystem of `path` has less than `margin` bytes free: how a write that failed
    with a library's own message (tensorstore, ScaNN) is recognised as a full disk."""
    free = _free_bytes(path)
    return free is not None and free < margin


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def check_writable_dir(path: str, flag: str) -> None:
    """Creates `path` if missing and writes a probe file there, so an unusable output location is
    reported before hours of work rather than after them."""
    probe = os.path.join(path, f".t5r-write-probe-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        try:
            with open(probe, "w") as f:
                f.write("ok")
        finally:  # also when the write fails (a full disk): the probe must not stay behind
            with contextlib.suppress(FileNotFoundError):
                os.remove(probe)
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(path, e) from e
        raise UserError(f"{path}: {flag} is not writable ({e.strerror or e}); choose a directory you can "
                        "write to") from e


@contextlib.contextmanager
def writable_output_dir(path: str, flag: str):
    """`check_writable_dir` for a command's output directory; when the block fails, the directories
    it created that are still empty are removed, so a failed command leaves no empty output behind
    (a resumable one's finished files, and the directory holding them, stay)."""
    created, parent = [], os.path.abspath(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    check_writable_dir(path, flag)
    try:
        yield
    except BaseException:
        for directory in created:  # the deepest first; stops at the first that holds something
            try:
                os.rmdir(directory)
            except OSError:
                break
        raise


@contextlib.contextmanager
def replaced_on_success(path: str | os.PathLike[str], suffix: str = "") -> Iterator[str]:
    """Yields `temp_path(path, suffix)` for the block to write (a file or a directory); when the block
    ends without error it is renamed onto `path`, else it is removed. So a reader sees the old output or
    the whole new one, and a crash leaves only a name `remove_stale_temporaries` finds. A full disk is
    raised as `DiskFullError` naming `path`. Like rename(2), the rename replaces a file or an empty
    directory: a caller replacing a full directory removes it first."""
    path = os.fspath(path)
    tmp = temp_path(path, suffix)
    _remove(tmp)  # a leftover of an earlier process that had this pid
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        if is_disk_full(e):
            raise disk_full(path, e) from e
        raise


@contextlib.contextmanager
def open_replaced_on_success(path: str | os.PathLike[str], mode: str = "w") -> Iterator[IO[Any]]:
    """`open(path, mode)` (UTF-8 for text) through `replaced_on_success`: the file appears whole or not at
    all."""
    encoding = None if "b" in mode else "utf-8"
    with replaced_on_success(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def temp_path(path: str, suffix: str = "") -> str:
    """Where to write `path` before renaming it into place: `<path>.tmp-<host>-<pid><suffix>`, so the
    next run can tell a crashed writer's leftovers (this host, process gone) from a live one's."""
    return f"{path}.tmp-{_HOST}-{os.getpid()}{suffix}"


_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
_TEMP_NAME = re.compile(r"\.tmp-(?:(?P<host>[A-Za-z0-9_.]+)-)?(?P<pid>\d+)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(directory: str, pattern: str = "*.tmp-*") -> list[str]:
    """Removes files and directories matching `pattern` in `directory` that a crashed run left: its
    `.tmp-<host>-<pid>` names this host and a process that no longer runs. Another host's
    temporaries are left alone (in a multi-host job its writer may be running). Returns the paths."""
    removed = []
    for path in sorted(glob.glob(os.path.join(glob.escape(directory), pattern))):
        match = _TEMP_NAME.search(os.path.basename(path))
        if not match or match.group("host") not in (None, _HOST) or _alive(int(match.group("pid"))):
            continue
        _remove(path)
        removed.append(path)
    return removed


def _lock_holder(fd: int) -> dict[str, Any]:
    """What the holder wrote into a lock file ({"pid", "host", "since", "command"}), or {}."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


@contextlib.contextmanager
def directory_lock(path: str, what: str) -> Iterator[dict[str, Any]]:
    """Holds an exclusive `flock` on the file `path` for the block, with this process's pid, host and
    start time written into it; yields what an earlier holder left there ({} if none).

    A second process asking for it while the first runs gets LockedError naming the holder. The
    kernel releases a flock when its process ends however it ends (kill -9 too), so a lock left by a
    killed run is no lock: the next run takes it over (the yielded record names the killed one,
    whose entry was never cleared). The file stays (removing it would let two runs lock two
    different files of one name); a run that ends clears its entry. On a file system without
    locks (some network mounts) the block runs unlocked."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            who = (f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"
                   if holder else "its pid is not recorded yet")
            stop = f"; or stop it (on {holder.get('host')}: kill {holder.get('pid')})" if holder else ""
            raise LockedError(f"{os.path.dirname(path) or '.'}: another run is writing this {what} ({who}; "
                              f"{path}); wait for it to end{stop}, then run this command again") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        previous = _lock_holder(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode("utf-8"), 0)
        try:
            yield previous
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock
