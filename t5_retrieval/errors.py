"""Errors a user can fix (a file, a flag, a checkpoint, the disk), and the checks that raise them early.

`t5r` shows a `UserError` as one line, `t5r <command>: error: <path>[:<line>]: <what and what to
do>`, and exits with status 2; `t5r --debug ...` (or T5R_DEBUG=1) shows the traceback. Any other
exception is a bug and keeps its traceback. Every module's own error type (bad data, a checkpoint
that does not fit, an index of another model, ...) derives from `UserError`.
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
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

DEBUG_ENV = "T5R_DEBUG"  # set (or `t5r --debug`): tracebacks and every library message are shown


class UserError(Exception):
    """A problem in what the user gave; the message names the path (and line) and what to do."""


class ConfigError(UserError, ValueError):
    """A value that cannot work in a flag, a gin binding or a stored model config; the message names
    the flag or binding (`ScannConfig.mode`, `--lexical_baseline_dim`) and what it accepts. Also a
    ValueError, for callers of the library functions that raise it."""


_FULL = (errno.ENOSPC, errno.EDQUOT)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT; also read from the message, since gin's re-raised copy of an exception that
    passed through a configurable keeps the text but not `errno`."""
    if not isinstance(error, OSError):
        return False
    return error.errno in _FULL or any(f"[Errno {code}]" in str(error) for code in _FULL)


class DiskFullError(UserError):
    """A write ran out of space; what was finished before it is kept."""


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


_PLAIN_WORD = re.compile(r"[\w@%+=:,./-]*")


def shell_command(words: list[str]) -> str:
    """`words` as one line to paste into a shell: how an error message gives a command to run. A
    flag's value is quoted on its own, so a gin string reads as the docs write it
    (`--gin.MIXTURE_OR_TASK_MODULE="'my_tasks'"`)."""
    def quoted(text: str) -> str:
        if _PLAIN_WORD.fullmatch(text):
            return text
        if not any(c in text for c in '"$`\\!'):
            return f'"{text}"'
        return "'" + text.replace("'", "'\"'\"'") + "'"

    out = []
    for word in words:
        flag, sep, value = word.partition("=")
        plain_flag = word.startswith("--") and sep and _PLAIN_WORD.fullmatch(flag)
        out.append(f"{flag}={quoted(value)}" if plain_flag else quoted(word))
    return " ".join(out)


def command_with(command_line: list[str], **flags: str) -> str:
    """`command_line` with these flags set (`tasks="fever"` -> `--tasks=fever`, replacing any value
    given before), as one line to paste into a shell: an error's suggestion is a command that works."""
    kept = without_flags(command_line, {f"--{name}" for name in flags})
    return shell_command([*kept, *(f"--{name}={value}" for name, value in flags.items())])


def without_flags(command_line: list[str], names: set[str]) -> list[str]:
    """`command_line` with the flags `names` (`--flag=value` or `--flag value`) left out."""
    kept, words = [], iter(command_line)
    for word in words:
        if word in names:
            next(words, None)  # `--flag value`: the value goes too
        elif word.partition("=")[0] not in names:
            kept.append(word)
    return kept


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


class LockedError(UserError):
    """Another live process holds the lock of a directory this command would write."""


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


class _CapturedStderr:
    def __init__(self) -> None:
        self.discarded = False

    def discard(self) -> None:
        """Drop what was captured: the caller reports the failure itself, in one line."""
        self.discarded = True


@contextlib.contextmanager
def stderr_kept_unless_discarded():
    """Captures file descriptor 2 (what native code and threads print, too) for the block and writes
    it back when the block ends, unless the block called `discard()` on what this yields: for a
    library whose failure prints screens of thread tracebacks before the one error the caller
    reports. With T5R_DEBUG set nothing is captured."""
    captured = _CapturedStderr()
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        yield captured
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not captured.discarded:
                sink.seek(0)
                while chunk := sink.read(1 << 16):
                    os.write(2, chunk)
