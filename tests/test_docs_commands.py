"""Every `t5r` command shown in README.md and docs/ names a real command, flags it has, and gin
files that exist (the expensive commands themselves run in the pipeline tests)."""

import contextlib
import functools
import glob
import io
import os
import re

import pytest

from t5_retrieval import cli, gin_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) of every `t5r ...` line in the docs' fenced code blocks, with
    backslash continuations joined and comments dropped."""
    out = []
    for path in DOCS:
        text = open(path, encoding="utf-8").read()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("t5r ") and not re.match(r"t5r [\w -]+:", line):  # not printed output
                    out.append((os.path.relpath(path, REPO), line))
    return out


@functools.cache
def flags_of(command: str) -> frozenset[str]:
    """The flags `t5r <command> --help` lists."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*command.split(), "--help"])
    return frozenset(re.findall(r"(--[a-z_]+)", out.getvalue()))


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 10, COMMANDS


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w}:{line[:40]}" for w, line in COMMANDS])
def test_documented_command_uses_real_flags_and_gin_files(where, line):
    words = line.split()[1:]
    name, rest = cli.resolve(words)
    flags = flags_of(name)
    for word in rest:
        flag = re.match(r"\[?(--[a-z_]+)", word)
        if flag and not word.startswith("--gin."):
            assert flag.group(1) in flags, f"{where}: `t5r {name}` has no flag {flag.group(1)} ({line})"
        gin_file = re.match(r"--gin_file=(\S+\.gin)$", word)
        if gin_file and not re.search(r"/[A-Z_]+\.gin$", word):  # MODEL.gin, ROW.gin: placeholders
            assert os.path.exists(os.path.join(gin_utils.GIN_CONFIGS_DIR, gin_file.group(1))), f"{where}: {word}"
