"""Errors a user can fix (a file, a flag, a checkpoint, the disk), and the commands their messages suggest.

`t5r` shows a `UserError` as one line, `t5r <command>: error: <path>[:<line>]: <what and what to
do>`, and exits with status 2; `t5r --debug ...` (or T5R_DEBUG=1) shows the traceback. Any other
exception is a bug and keeps its traceback. Every module's own error type (bad data, a checkpoint
that does not fit, an index of another model, ...) derives from `UserError`. The checks that raise
the disk's and the output directory's errors early are `artefact_io`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

DEBUG_ENV = "T5R_DEBUG"  # set (or `t5r --debug`): tracebacks and every library message are shown


class UserError(Exception):
    """A problem in what the user gave; the message names the path (and line) and what to do."""


class ConfigError(UserError, ValueError):
    """A value that cannot work in a flag, a gin binding or a stored model config; the message names
    the flag or binding (`ScannConfig.mode`, `--lexical_baseline_dim`) and what it accepts. Also a
    ValueError, for callers of the library functions that raise it."""


class DiskFullError(UserError):
    """A write ran out of space; what was finished before it is kept."""


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


class LockedError(UserError):
    """Another live process holds the lock of a directory this command would write."""


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
