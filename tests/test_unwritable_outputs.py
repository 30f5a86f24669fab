"""Outputs that cannot be written, on real filesystems (a tmpfs in a private mount namespace): a full
disk during training and a read-only output location for every command that writes; each is one
line naming the path, exit status 2, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

TRAIN = ["train", "--gin_file=models/t5_tiny.gin", "--gin.VOCAB_SIZE=128", "--gin.D_MODEL=32", "--gin.D_FF=64",
         "--gin.DROPOUT=0.0", "--gin.train.batches=@RandomBatches", "--gin.train.per_device_batch=4"]


def in_small_filesystem(mount: str, size: str, argv: list[str]) -> subprocess.CompletedProcess:
    """Runs argv with a tmpfs of `size` at `mount`, visible to it alone (unprivileged: a user namespace)."""
    script = f'mount -t tmpfs -o size={size} none "{mount}" && exec "$@"'
    # CPU, as the other subprocess tests: else jax probes for a TPU through libtpu, which under load
    # times out and prints an "INVALID_ARGUMENT: Error" line of its own before any work starts.
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def small_filesystems_work(tmp_path_factory):
    mount = tmp_path_factory.mktemp("probe")
    if shutil.which("unshare") is None or in_small_filesystem(str(mount), "64k", ["true"]).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here (unshare -rm)")


def test_disk_full_while_checkpointing_is_one_line_without_tracebacks(tmp_path, small_filesystems_work):
    mount = tmp_path / "small"
    mount.mkdir()
    result = in_small_filesystem(str(mount), "200k", [
        sys.executable, "-m", "t5_retrieval.cli", *TRAIN, f"--model_dir={mount / 'model'}", "--gin.train.num_steps=2"])
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(f"t5r train: error: {mount / 'model'}/"), result.stderr[-3000:]
    assert "no space left on the device" in errors[0]
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr[-3000:]


# Runs each command in one process (imports paid once) and reports its exit status and stderr.
DRIVER = """
import contextlib, io, json, sys
import gin
from t5_retrieval import cli
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(argv)
    gin.clear_config()
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


LEXICAL = ["--lexical_baseline_dim", "32"]  # a model-free encoder: the commands' I/O is what is tested


def lexical_index(tmp_path, tasks: list[str]) -> tuple[str, str, str]:
    """The small demo's data, its lexical embeddings and their index, made by `t5r encode` and `t5r index`."""
    from conftest import prepare_small_demo

    from t5_retrieval import cli

    data = prepare_small_demo(tmp_path, tasks)
    emb, index = str(tmp_path / "emb"), str(tmp_path / "index")
    assert cli.main(["encode", *LEXICAL, f"--kb_dir={data}/kb", f"--output_dir={emb}", "--no_progress"]) == 0
    assert cli.main(["index", f"--embeddings_dir={emb}", f"--output_dir={index}"]) == 0
    return data, emb, index


def test_every_writing_command_refuses_a_read_only_output_in_one_line(tmp_path, small_filesystems_work):

    data, emb, index = lexical_index(tmp_path, ["fever", "nq"])
    lexical = LEXICAL
    ro = tmp_path / "read_only"
    ro.mkdir()
    commands = {
        "data kb": ["--source", str(tmp_path / "raw" / "kb" / "pages.jsonl"), f"--data_dir={ro}/data"],
        "data demo": [f"--out={ro}/raw"],
        "vocab train": [f"--kb={data}/kb", f"--out={ro}/spm", "--vocab_size=100"],
        "encode": [*lexical, f"--kb_dir={data}/kb", f"--output_dir={ro}/emb"],
        "index": [f"--embeddings_dir={emb}", f"--output_dir={ro}/index"],
        "eval": [*lexical, f"--index_dir={index}", f"--data_dir={data}", "--split=train", "--tasks=fever",
                 f"--output_dir={ro}/eval"],
        "train": [f"--model_dir={ro}/model", "--gin_file=models/t5_tiny.gin", "--gin.train.batches=@RandomBatches"],
    }
    argvs = [name.split() + argv for name, argv in commands.items()]
    result = in_small_filesystem(str(ro), "1m,ro", [sys.executable, "-c", DRIVER, json.dumps(argvs)])
    assert result.returncode == 0, result.stderr[-3000:]
    for name, (code, err) in zip(commands, json.loads(result.stdout.splitlines()[-1])):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"t5r {name}: error: {ro}"), (name, err)
        assert "read-only file system" in lines[0] or "not writable" in lines[0], (name, err)


def test_the_write_probe_of_a_full_output_directory_is_not_left_behind(tmp_path, small_filesystems_work):
    """A directory on a full filesystem: the check names it and leaves nothing (not even a 0-byte probe)."""
    mount = tmp_path / "full"
    mount.mkdir()
    fill = "import os; open(os.path.join(os.environ['DIR'], 'filler'), 'wb').write(b'x' * (1 << 20))\n"
    check = ("import os; from t5_retrieval import artefact_io, errors\n"
             "try:\n    artefact_io.check_writable_dir(os.path.join(os.environ['DIR'], 'eval'), '--output_dir')\n"
             "except errors.UserError as e:\n    print('ERROR', e)\n"
             "print(sorted(os.listdir(os.path.join(os.environ['DIR'], 'eval'))))\n")
    result = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m none "$DIR" && mkdir "$DIR/eval" && '
                             '"$0" -c "$1" ; "$0" -c "$2"', sys.executable, fill, check],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "DIR": str(mount)})
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ERROR {mount / 'eval'}: no space left on the device"), result.stdout + result.stderr
    assert lines[1] == "[]", "the probe file stayed behind"


def test_a_failed_command_leaves_no_output_directory_it_created(tmp_path, clean_gin, capsys):
    """eval, encode, index and mine check their output directory first (creating it, parents too);
    when they then fail on a bad input, the directories they created, still empty, are gone."""
    from t5_retrieval import cli

    data, _, index = lexical_index(tmp_path, ["fever"])
    lexical = LEXICAL
    empty = tmp_path / "empty"
    empty.mkdir()
    new = tmp_path / "new"
    commands = {
        "eval": [*lexical, f"--index_dir={index}", f"--data_dir={data}", "--split=train", "--tasks=nosuch",
                 f"--output_dir={new}/eval"],
        "encode": [*lexical, f"--kb_dir={empty}", f"--output_dir={new}/emb"],
        "index": [f"--embeddings_dir={empty}", f"--output_dir={new}/index"],
        "mine": [*lexical, f"--index_dir={empty}", f"--data_dir={new}/data", "--source=ance-1"],
    }
    for name, argv in commands.items():
        assert cli.main([name, *argv]) == 2, name
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, name
        assert not new.exists(), f"t5r {name} failed and left {sorted(str(p) for p in new.rglob('*'))}"


# A command that fails as a full disk fails while a library's teardown is still pending: an exit
# handler here, like orbax's and tensorstore's callbacks for the writes still in flight.
FULL_DISK_COMMAND = """
import atexit
import sys

from t5_retrieval import artefact_io, cli


def main(argv):
    atexit.register(lambda: open(argv[0], "w").write("the interpreter finalized"))
    raise artefact_io.disk_full(argv[1])


cli.COMMANDS["fill"] = ("__main__:main", "")
cli.run()
"""


def test_after_a_full_disk_is_reported_no_teardown_can_change_the_exit(tmp_path):
    """The report ends the process without interpreter finalization: nothing left running in a
    library (tensorstore's callbacks for a failed save's other writes) can race it and turn status
    2 into 1 with a traceback (an import while `sys.meta_path` is None)."""
    marker = tmp_path / "finalized"
    result = subprocess.run([sys.executable, "-c", FULL_DISK_COMMAND, "fill", str(marker), str(tmp_path / "model")],
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"t5r fill: error: {tmp_path / 'model'}: no space left on the device"), lines
    assert not marker.exists(), "exit handlers ran after the report: teardown can still race the exit"
