"""Multi-host for real: two processes on 127.0.0.1 joined by `jax.distributed` (gloo CPU collectives)
form one 2-device mesh, train the tiny model on per-host data shards, checkpoint with orbax, and
resume; the result equals one process with 2 devices and the same global batch.

Every process is started through `launch/run.py` (the launchers' shared entry point) and has a
hard timeout, so a hung collective ends the test instead of blocking it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from process_harness import TIMEOUT_S, job_flags, run_processes, start

TRAIN_STEPS, CHECKPOINT_EVERY = 8, 4
GIN = ["--gin_file=models/t5_tiny.gin"] + [f"--gin.{b}" for b in (
    "VOCAB_SIZE=64", "D_MODEL=16", "D_FF=32", "NUM_LAYERS=1", "NUM_HEADS=2", "D_KV=8", "DROPOUT=0.1",
    "train.batches=@RandomBatches", "RandomBatches.vocab_size=64", "RandomBatches.num_negatives=1",
    # 4 queries per device: the global batch is 8 queries whether 1 process has 2 devices or 2 have 1.
    "train.per_device_batch=4", f"train.num_steps={TRAIN_STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}",
    "train.log_every=2", "train.keep_checkpoints=5", "train.multitask=@multitask.taco",
    "multitask.taco.burn_in_fraction=0.25")]


def train(model_dir: str, launch_flags: list[list[str]], devices_per_process: int) -> list[str]:
    """Runs one `launch/run.py ... -- train` per entry of launch_flags, concurrently; returns their logs."""
    return run_processes(["train", "--model_dir", model_dir, *GIN], launch_flags, devices_per_process,
                         log_dir=os.path.dirname(model_dir))


def two_processes(model_dir: str) -> list[str]:
    return train(model_dir, job_flags(2), devices_per_process=1)


def final_state(model_dir: str) -> dict:
    """The last checkpoint's state as numpy arrays (whatever devices saved it)."""
    path = os.path.join(model_dir, str(TRAIN_STEPS), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    return checkpointer.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                                                tree))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    multi, single = str(root / "multi" / "model"), str(root / "single" / "model")
    os.makedirs(os.path.dirname(multi))
    os.makedirs(os.path.dirname(single))
    first = two_processes(multi)
    assert sorted(int(n) for n in os.listdir(multi) if n.isdigit()) == [CHECKPOINT_EVERY, TRAIN_STEPS]
    shutil.rmtree(os.path.join(multi, str(TRAIN_STEPS)))  # as if preempted after the step-4 checkpoint
    resumed = two_processes(multi)
    train(single, [[]], devices_per_process=2)
    return multi, single, first, resumed


def test_two_processes_form_one_mesh_over_gloo(runs):
    _, _, first, _ = runs
    for i, text in enumerate(first):
        assert "Gloo" in text and "connected to 1 peer" in text, f"process {i} did not join the gloo group:\n{text[-2000:]}"


def test_both_processes_resume_from_the_orbax_checkpoint(runs):
    _, _, _, resumed = runs
    for i, text in enumerate(resumed):
        assert f"at step {CHECKPOINT_EVERY}" in text and "resumed" in text, \
            f"process {i} should resume at step {CHECKPOINT_EVERY}:\n{text[-2000:]}"


def test_two_process_run_with_resume_equals_one_process_with_the_same_global_batch(runs):
    multi, single, _, _ = runs
    expected, got = final_state(single), final_state(multi)
    leaves, expected_leaves = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(expected)
    assert len(leaves) == len(expected_leaves), "checkpointed states differ in structure"
    for (path, a), b in zip(leaves, expected_leaves):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7,
                                   err_msg=f"2 processes (resumed) vs 1 process differ at {jax.tree_util.keystr(path)}")
    with open(os.path.join(multi, "metrics.jsonl")) as f:
        multi_losses = {r["step"]: r["loss"] for r in map(json.loads, f)}
    with open(os.path.join(single, "metrics.jsonl")) as f:
        single_losses = {r["step"]: r["loss"] for r in map(json.loads, f)}
    for step in (2, 4, 6, 8):
        assert multi_losses[step] == pytest.approx(single_losses[step], rel=1e-6), \
            f"step {step}: loss {multi_losses[step]} with 2 processes, {single_losses[step]} with 1"
    assert not glob.glob(os.path.join(multi, "*.orbax-checkpoint-tmp*"))


def test_sigterm_to_one_host_checkpoints_the_same_step_on_both_and_stops_them(tmp_path):
    """jax's preemption sync manager spreads one host's SIGTERM; both save one step and exit 143."""
    import signal
    import time

    model_dir = str(tmp_path / "model")
    gin = [g for g in GIN if "num_steps" not in g and "checkpoint_every" not in g]
    gin += ["--gin.train.num_steps=400", "--gin.train.checkpoint_every=1000"]
    logs = [str(tmp_path / f"process_{i}.log") for i in range(2)]
    procs = [start(flags, ["train", "--model_dir", model_dir, *gin], log, devices_per_process=1)
             for flags, log in zip(job_flags(2), logs)]
    try:
        metrics = os.path.join(model_dir, "metrics.jsonl")
        deadline = time.monotonic() + TIMEOUT_S
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            assert time.monotonic() < deadline, "no step was logged in time"
            assert all(p.poll() is None for p in procs), "a process ended early:\n" + open(logs[0]).read()[-2000:]
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # only the non-coordinator host is told
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [open(log).read() for log in logs]
    assert codes == [128 + signal.SIGTERM] * 2, f"both hosts should exit as preempted (143), got {codes}:\n" \
                                                + "\n".join(t[-1500:] for t in texts)
    saved = sorted(int(n) for n in os.listdir(model_dir) if n.isdigit())
    assert len(saved) == 1 and 0 < saved[0] < 400, f"expected one checkpoint at the agreed step, got {saved}"
    for i, text in enumerate(texts):
        assert f"at step {saved[0]}" in text and "preempted" in text, f"process {i}:\n{text[-1500:]}"
