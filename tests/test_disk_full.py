"""A really full disk (a 200 KiB tmpfs in a private mount namespace) during training: one line, no
thread tracebacks, exit status 2, and the checkpoints written before it kept."""

from __future__ import annotations

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
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *argv], capture_output=True, text=True,
                          timeout=600)


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
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith(f"t5r train: error: {mount / 'model'}/"), result.stderr[-3000:]
    assert "no space left on the device" in errors[0]
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr, result.stderr[-3000:]
