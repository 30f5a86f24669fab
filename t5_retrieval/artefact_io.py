"""Reading the files of an artefact someone handed over: regular files inside it only, bounded.

Every record, stamp, sidecar, manifest and `index.json` the project reads, and every file a
checksum record lists, is opened here. A file is read only when it is a regular file (not a FIFO,
whose open or read would block, nor a device such as `/dev/zero`, which never ends) that lies inside
its artefact (a symbolic link may point within it, not out of it); at most `limit` bytes are read
(a record's size for a file it lists); and JSON is parsed only when it nests at most
`MAX_JSON_DEPTH` levels, so no input reaches Python's recursion limit. Each refusal is an error
of the caller's class naming the file: one line, exit status 2 from `t5r`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from t5_retrieval.errors import UserError

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
