"""One error path for every `t5r` command: all flag parsing and `main`s live in `t5_retrieval/commands/`,
and every command, given a bad flag value or a bad file, exits with status 2 and one line
`t5r <command>: error: ...` naming what is wrong, without a traceback.

The library under the commands defines no `main`, imports no argparse and writes nothing to stderr
(an AST scan, like tests/test_layers.py): it raises `errors.UserError` and `cli.main` shows it.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import shutil

import numpy as np
import pytest
from conftest import prepare_small_demo

from t5_retrieval import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "t5_retrieval")
# Where flag parsing, `main` and stderr belong: the commands and the dispatcher that shows errors.
COMMAND_LAYER = (os.path.join(PACKAGE, "commands") + os.sep, os.path.join(PACKAGE, "cli.py"))


def command_layer_uses(path: str) -> list[str]:
    """What in this file only the command layer may do: define `main`, import argparse, name sys.stderr."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []
    # `sys.stderr.flush()` writes nothing (errors.py flushes before capturing what libraries print).
    flushed = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "flush"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
            found.append(f"{node.lineno}: defines main()")
        elif isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in node.comparators):
            found.append(f"{node.lineno}: runs as __main__")
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names):
            found.append(f"{node.lineno}: imports argparse")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse":
            found.append(f"{node.lineno}: imports argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(
                a.name in ("stderr", "__stderr__") for a in node.names):
            found.append(f"{node.lineno}: imports sys.stderr")
        elif (isinstance(node, ast.Attribute) and node.attr in ("stderr", "__stderr__")
              and isinstance(node.value, ast.Name) and node.value.id == "sys" and id(node) not in flushed):
            found.append(f"{node.lineno}: writes to sys.{node.attr}")
    return found


def library_files() -> list[str]:
    out = []
    for root, _, files in os.walk(PACKAGE):
        out += [os.path.join(root, f) for f in sorted(files) if f.endswith(".py")]
    return [p for p in out if not p.startswith(COMMAND_LAYER[0]) and p != COMMAND_LAYER[1]]


def test_only_the_commands_parse_flags_define_main_or_write_to_stderr():
    problems = [f"{os.path.relpath(path, REPO)}:{use}" for path in library_files() for use in command_layer_uses(path)]
    assert not problems, ("flag parsing, main() and stderr belong in t5_retrieval/commands/ (errors: raise "
                          "errors.UserError, cli.main shows it):\n" + "\n".join(problems))


def test_the_scan_sees_main_argparse_and_stderr(tmp_path):
    """The scan must catch each thing it forbids, the way it is usually written."""
    path = tmp_path / "lib.py"
    path.write_text("import sys\nfrom argparse import ArgumentParser\n\ndef main(argv):\n"
                    "    print('x', file=sys.stderr)\n\nif __name__ == '__main__':\n    main([])\n")
    assert sorted(command_layer_uses(str(path))) == ["2: imports argparse", "4: defines main()",
                                                     "5: writes to sys.stderr", "7: runs as __main__"]


def test_every_command_lives_in_the_commands_package():
    for name, (target, _) in cli.COMMANDS.items():
        assert target.startswith("t5_retrieval.commands."), f"t5r {name} -> {target}"


# --- every command, a bad flag value and a bad file ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Good inputs the bad cases start from: a prepared data dir with a lexical index, and bad files."""

    raw: str  # KILT-format task files and kb/pages.jsonl
    data: str  # kb/, examples/ (train), negatives/
    emb: str  # lexical (32-dim) embeddings of the KB
    index: str  # their index
    malformed: str  # a jsonl file whose first line is not JSON
    not_a_dir: str  # a regular file where a directory is expected
    empty_dir: str
    tmp: str  # a fresh directory per test, for outputs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("command_errors")
    data = prepare_small_demo(root, ["fever", "nq"])
    emb, index = str(root / "emb"), str(root / "index")
    assert cli.main(["encode", "--lexical_baseline_dim", "32", "--kb_dir", os.path.join(data, "kb"),
                     "--output_dir", emb, "--no_progress"]) == 0
    assert cli.main(["index", "--embeddings_dir", emb, "--output_dir", index]) == 0
    malformed = root / "malformed.jsonl"
    malformed.write_text("{\"id\": 1, not json\n")
    not_a_dir = root / "a_file"
    not_a_dir.write_text("not a directory\n")
    (root / "empty").mkdir()
    return {"raw": str(root / "raw"), "data": data, "emb": emb, "index": index, "malformed": str(malformed),
            "not_a_dir": str(not_a_dir), "empty_dir": str(root / "empty")}


@pytest.fixture
def inputs(prepared, tmp_path, clean_gin):
    return Inputs(**prepared, tmp=str(tmp_path))


def kb(x: Inputs) -> str:
    return os.path.join(x.data, "kb")


def damaged_index(x: Inputs) -> str:
    """A copy of the index whose index.json is not JSON."""
    path = os.path.join(x.tmp, "damaged_index")
    shutil.copytree(x.index, path)
    with open(os.path.join(path, "index.json"), "w") as f:
        f.write("{not json")
    return path


def broken_gin(x: Inputs) -> str:
    path = os.path.join(x.tmp, "broken.gin")
    with open(path, "w") as f:
        f.write("train.num_steps = = 5\n")
    return path


def malformed_task_dir(x: Inputs, task: str = "fever", split: str = "train") -> str:
    """A directory holding `{task}-{split}-kilt.jsonl` whose first line is not JSON."""
    directory = os.path.join(x.tmp, "tasks")
    os.makedirs(directory)
    shutil.copy(x.malformed, os.path.join(directory, f"{task}-{split}-kilt.jsonl"))
    return directory


def malformed_examples_data_dir(x: Inputs) -> str:
    """A data dir with the good KB and a malformed examples file for fever."""
    directory = os.path.join(x.tmp, "data")
    os.makedirs(os.path.join(directory, "examples"))
    os.symlink(kb(x), os.path.join(directory, "kb"))
    shutil.copy(x.malformed, os.path.join(directory, "examples", "fever-train.jsonl"))
    return directory


def malformed_npz(x: Inputs) -> str:
    path = os.path.join(x.tmp, "state.npz")
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 this is no zip archive")
    return path


def sums_mismatch_dir(x: Inputs) -> str:
    """A download directory holding a file whose recorded sha256 is another one."""
    directory = os.path.join(x.tmp, "kilt")
    os.makedirs(directory)
    with open(os.path.join(directory, "fever-dev-kilt.jsonl"), "w") as f:
        f.write("{}\n")
    with open(os.path.join(directory, "SHA256SUMS"), "w") as f:
        f.write(f"{'0' * 64}  fever-dev-kilt.jsonl\n")
    return directory


def empty_file(x: Inputs) -> str:
    path = os.path.join(x.tmp, "token")
    open(path, "w").close()
    return path


def malformed_record_dir(x: Inputs) -> str:
    directory = os.path.join(x.tmp, "records")
    os.makedirs(directory)
    with open(os.path.join(directory, "bm25-seed0.json.gz"), "wb") as f:
        f.write(b"not gzip")
    return directory


def malformed_kb_source_dir(x: Inputs) -> str:
    """A mini-KILT-like directory whose kb/passages.jsonl is malformed."""
    directory = os.path.join(x.tmp, "mini_kilt")
    os.makedirs(os.path.join(directory, "kb"))
    shutil.copy(x.malformed, os.path.join(directory, "kb", "passages.jsonl"))
    return directory


# command -> [(case, argv after the command name, what the error line must name)], one bad flag value
# and one bad file or directory each. Bad values fail before any long work (no model is trained).
TINY_T5 = ["--gin_file=models/t5_tiny.gin", "--gin_file=runs/base.gin", "--gin.DATA_DIR='d'", "--gin.VOCABULARY='v'",
           "--gin.MIXTURE_OR_TASK_NAME='demo_fever'", "--gin.TRAIN_STEPS=5"]
DEMO_GIN = ["--gin_file=runs/demo.gin", "--gin.DATA_DIR='d'", "--gin.VOCABULARY='v'",
            "--gin.MIXTURE_OR_TASK_NAME='demo'", "--gin.WARMUP_MIXTURE='demo_noprefix'"]
LEXICAL = ["--lexical_baseline_dim", "32"]

def unreadable_checksum_record(x) -> str:
    path = os.path.join(x.tmp, "artefact")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "t5r_checksums.json"), "w") as f:
        f.write("{oops")
    return path


CASES = {
    "train": [
        ("bad flag value", lambda x: ["--model_dir", os.path.join(x.tmp, "m"), *TINY_T5,
                                      "--gin.train.max_nonfinite_in_a_row=0"], lambda x: "max_nonfinite_in_a_row"),
        ("bad file", lambda x: ["--model_dir", os.path.join(x.tmp, "m"), f"--gin_file={broken_gin(x)}"],
         lambda x: "broken.gin"),
    ],
    "plan": [
        ("bad flag value", lambda x: ["--topology", "v9:2x2", *TINY_T5], lambda x: "--topology='v9:2x2'"),
        ("bad file", lambda x: ["--topology", "v5e:2x2", f"--gin_file={broken_gin(x)}"], lambda x: "broken.gin"),
    ],
    "data kb": [
        ("bad flag value", lambda x: ["--source", os.path.join(x.raw, "kb", "pages.jsonl"), "--data_dir", x.tmp,
                                      "--words_per_passage", "0"], lambda x: "words_per_passage"),
        ("bad file", lambda x: ["--source", x.malformed, "--data_dir", x.tmp], lambda x: f"{x.malformed}:1"),
    ],
    "data tasks": [
        ("bad flag value", lambda x: ["--input_dir", x.raw, "--data_dir", x.data, "--tasks", "nosuch"],
         lambda x: "nosuch"),
        ("bad file", lambda x: ["--input_dir", malformed_task_dir(x), "--data_dir", x.data, "--tasks", "fever",
                                "--splits", "train"], lambda x: "fever-train-kilt.jsonl:1"),
    ],
    "data negatives": [
        ("bad flag value", lambda x: ["--data_dir", x.data, "--tasks", "fever", "--top_k", "0"], lambda x: "top_k"),
        ("bad file", lambda x: ["--data_dir", malformed_examples_data_dir(x), "--tasks", "fever"],
         lambda x: "fever-train.jsonl:1"),
    ],
    "data demo": [
        ("bad flag value", lambda x: ["--out", os.path.join(x.tmp, "demo"), "--num_pages", "0"], lambda x: "num_pages"),
        ("bad file", lambda x: ["--out", os.path.join(x.not_a_dir, "demo")], lambda x: x.not_a_dir),
    ],
    "data download-kilt": [
        ("bad flag value", lambda x: ["--out", x.tmp, "--files", "fever-dev-kilt.jsonl",
                                      "--base_url", "file:///no/such/kilt/"], lambda x: "file:///no/such/kilt/"),
        ("bad file", lambda x: ["--out", sums_mismatch_dir(x), "--files", "fever-dev-kilt.jsonl"],
         lambda x: "fever-dev-kilt.jsonl: sha256"),
    ],
    "data slice": [
        ("bad flag value", lambda x: ["--mini_kilt", x.empty_dir, "--out", os.path.join(x.tmp, "s.tar.gz")],
         lambda x: x.empty_dir),
        ("bad file", lambda x: ["--mini_kilt", malformed_task_dir(x), "--out", os.path.join(x.tmp, "s.tar.gz")],
         lambda x: "fever-train-kilt.jsonl:1"),
    ],
    "vocab train": [
        ("bad flag value", lambda x: ["--kb", kb(x), "--out", os.path.join(x.tmp, "spm"), "--vocab_size", "0"],
         lambda x: "vocab_size"),
        ("bad file", lambda x: ["--kb", x.empty_dir, "--out", os.path.join(x.tmp, "spm")], lambda x: x.empty_dir),
    ],
    "checksum": [
        ("bad flag value", lambda x: [os.path.join(x.tmp, "no_such_artefact")], lambda x: "no_such_artefact"),
        ("bad file", lambda x: [unreadable_checksum_record(x)], lambda x: "t5r_checksums.json: unreadable"),
    ],
    "analyze": [
        ("bad flag value", lambda x: ["--state_npz", written_state(x), "--out", x.tmp, "--tau", "0"],
         lambda x: "tau"),
        ("bad file", lambda x: ["--state_npz", malformed_npz(x), "--out", x.tmp], lambda x: "state.npz"),
    ],
    "encode": [
        ("bad flag value", lambda x: ["--lexical_baseline_dim", "0", "--kb_dir", kb(x), "--output_dir", x.tmp],
         lambda x: "dim must be >= 1, got 0"),
        ("bad file", lambda x: [*LEXICAL, "--kb_dir", x.empty_dir, "--output_dir", x.tmp], lambda x: x.empty_dir),
    ],
    "index": [
        ("bad flag value", lambda x: ["--embeddings_dir", x.emb, "--output_dir", x.tmp,
                                      "--gin.ScannConfig.mode='fastest'"], lambda x: "'fastest'"),
        ("bad file", lambda x: ["--embeddings_dir", x.empty_dir, "--output_dir", x.tmp], lambda x: x.empty_dir),
    ],
    "eval": [
        ("bad flag value", lambda x: [*LEXICAL, "--index_dir", x.index, "--data_dir", x.data, "--split", "train",
                                      "--tasks", "nosuch", "--output_dir", x.tmp], lambda x: "nosuch"),
        ("bad file", lambda x: [*LEXICAL, "--index_dir", damaged_index(x), "--data_dir", x.data,
                                "--output_dir", x.tmp], lambda x: "index.json"),
    ],
    "mine": [
        ("bad flag value", lambda x: ["--lexical_baseline_dim", "0", "--index_dir", x.index, "--data_dir", x.data,
                                      "--source", "t"], lambda x: "dim must be >= 1, got 0"),
        ("bad file", lambda x: [*LEXICAL, "--index_dir", damaged_index(x), "--data_dir", x.data, "--source", "t"],
         lambda x: "index.json"),
    ],
    "fuse": [
        ("bad flag value", lambda x: ["--expert", "fever,lexical:32", "--data_dir", x.data, "--output_dir", x.tmp],
         lambda x: "fever,lexical:32"),
        ("bad file", lambda x: ["--expert", f"fever,lexical:32,{damaged_index(x)}", "--data_dir", x.data,
                                "--output_dir", x.tmp], lambda x: "index.json"),
    ],
    "ance": [
        ("bad flag value", lambda x: ["--work_dir", x.tmp, *DEMO_GIN, "--gin.ance.num_episodes=-1"],
         lambda x: "num_episodes"),
        ("bad file", lambda x: ["--work_dir", x.tmp, f"--gin_file={broken_gin(x)}"], lambda x: "broken.gin"),
    ],
    "serve": [
        ("bad flag value", lambda x: [*LEXICAL, "--index_dir", x.index, "--kb_dir", kb(x), "--tasks", "fever",
                                      "--port", "0", "--workers", "0"], lambda x: "--workers 0"),
        ("bad file", lambda x: [*LEXICAL, "--index_dir", x.index, "--kb_dir", kb(x), "--tasks", "fever",
                                "--port", "0", "--auth_token_file", empty_file(x)], lambda x: empty_file(x)),
    ],
    "export": [
        ("bad flag value", lambda x: ["--checkpoint_dir", x.empty_dir, "--step", "latest", "--index_dir", x.index,
                                      "--kb_dir", kb(x), "--output_dir", os.path.join(x.tmp, "1")],
         lambda x: "'latest'"),
        ("bad file", lambda x: ["--checkpoint_dir", x.empty_dir, "--index_dir", x.index,
                                "--kb_dir", kb(x), "--output_dir", os.path.join(x.tmp, "1")], lambda x: x.empty_dir),
    ],
    "export-hf": [
        ("bad flag value", lambda x: ["--checkpoint_dir", x.empty_dir, "--output_dir", x.tmp, "--step", "latest"],
         lambda x: "'latest'"),
        ("bad file", lambda x: ["--checkpoint_dir", x.empty_dir, "--output_dir",
                                os.path.join(x.tmp, "hf")], lambda x: x.empty_dir),
    ],
    "query-side": [
        ("bad flag value", lambda x: query_side_args(x, x.empty_dir, "nosuch"), lambda x: "nosuch"),
        ("bad file", lambda x: query_side_args(x, malformed_task_dir(x, "nq_open"), "nq_open"),
         lambda x: "nq_open-train-kilt.jsonl:1"),
    ],
    "results": [
        ("bad flag value", lambda x: ["--work_dir", x.tmp, "--rows=", "--seeds", "0,x"], lambda x: "'0,x'"),
        ("bad file", lambda x: ["--work_dir", x.tmp, "--rows=", "--records_dir", malformed_record_dir(x)],
         lambda x: "bm25-seed0.json.gz"),
    ],
    "demo": [
        ("bad flag value", lambda x: ["--data", os.path.join(x.tmp, "nosuch"), "--out", x.tmp],
         lambda x: os.path.join(x.tmp, "nosuch")),
        ("bad file", lambda x: ["--data", malformed_kb_source_dir(x), "--out", x.tmp],
         lambda x: os.path.join("kb", "passages.jsonl") + ":1"),
    ],
}


def written_state(x: Inputs) -> str:
    from t5_retrieval.multitask.analysis import save_state_npz

    path = os.path.join(x.tmp, "good_state.npz")
    save_state_npz({"w": np.ones((2, 3), np.float32)}, ["fever", "nq"], path)
    return path


def query_side_args(x: Inputs, qa_dir: str, task: str) -> list[str]:
    return ["--checkpoint_dir", x.empty_dir, "--index_dir", x.index, "--embeddings_dir", x.emb, "--kb_dir", kb(x),
            "--qa_dir", qa_dir, "--task", task, "--as_task", "fever", "--output_dir", os.path.join(x.tmp, "qs")]


def run(argv: list[str], capsys) -> tuple[int, str]:
    """`t5r <argv>` in-process: (exit status, stderr). argparse's usage errors exit through SystemExit."""
    try:
        status = cli.main(argv)
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def test_every_command_has_a_bad_flag_value_and_a_bad_file_case():
    assert sorted(CASES) == sorted(cli.COMMANDS)
    for name, cases in CASES.items():
        assert [case for case, _, _ in cases] == ["bad flag value", "bad file"], name


@pytest.mark.parametrize("name,case,argv,needle",
                         [(name, case, argv, needle) for name, cases in CASES.items() for case, argv, needle in cases],
                         ids=[f"{name}-{case}" for name, cases in CASES.items() for case, _, _ in cases])
def test_a_bad_input_is_one_error_line_and_status_2(name, case, argv, needle, inputs, capsys):
    status, err = run([*name.split(), *argv(inputs)], capsys)
    lines = [line for line in err.splitlines() if line.startswith(f"t5r {name}: error: ")]
    assert status == 2, f"t5r {name} ({case}) exited with {status}:\n{err}"
    assert "Traceback" not in err, f"t5r {name} ({case}) showed a traceback:\n{err}"
    assert len(lines) == 1, f"t5r {name} ({case}): expected one `t5r {name}: error:` line:\n{err}"
    assert needle(inputs) in lines[0], f"t5r {name} ({case}): the error does not name {needle(inputs)!r}: {lines[0]}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_debug_shows_the_traceback_of_the_same_bad_file(name, inputs, monkeypatch):
    """`t5r --debug <command>` raises what the one line would have reported, for every command."""
    from t5_retrieval.errors import DEBUG_ENV, UserError

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    (_, argv, needle), = [case for case in CASES[name] if case[0] == "bad file"]
    args = argv(inputs)
    with pytest.raises((UserError, OSError)) as raised:
        cli.main(["--debug", *name.split(), *args])
    assert needle(inputs) in str(raised.value), str(raised.value)
    assert DEBUG_ENV not in os.environ, "`--debug` holds for its own command only"
    assert cli.main([*name.split(), *args]) == 2, "the next command in the process reports in one line"
