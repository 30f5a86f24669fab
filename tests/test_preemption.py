"""Preemption: a run killed with SIGKILL (mid-run, or while a checkpoint is being written) and
resumed ends bit-identical to an uninterrupted run; an unreadable checkpoint falls back to the
previous one.

The killed runs are real `t5r train` processes on a tiny model with dropout (so the RNG matters),
watched from this process: one is killed a random moment after a checkpoint completed (inside
some step), one as soon as orbax's temporary checkpoint directory appears. Every process has a
timeout, so the test stops by itself.
"""

from __future__ import annotations

import glob
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from process_harness import REPO, jax_env

from t5_retrieval import checkpoint

TRAIN_STEPS = 24
TIMEOUT_S = 300
TMP_MARKER = ".orbax-checkpoint-tmp"
BINDINGS = ["VOCAB_SIZE = 64", "D_MODEL = 16", "D_FF = 32", "NUM_LAYERS = 1", "NUM_HEADS = 2", "D_KV = 8",
            "DROPOUT = 0.1", "train.batches = @RandomBatches", "RandomBatches.vocab_size = 64",
            "RandomBatches.num_negatives = 1", "train.per_device_batch = 4", f"train.num_steps = {TRAIN_STEPS}",
            "train.checkpoint_every = 2", "train.log_every = 2", "train.keep_checkpoints = 3",
            "make_optimizer.learning_rate = 1e-3"]
VARIANTS = {
    "naive_sum": [],
    # TACO's burn-in ends at step 6, so the resumed runs cross it with a restored EMA.
    "taco": ["train.multitask = @multitask.taco", "multitask.taco.burn_in_fraction = 0.25"],
}


def train_command(model_dir: str, variant: str, extra: tuple[str, ...] = ()) -> list[str]:
    gin = [f"--gin.{b.replace(' = ', '=')}" for b in BINDINGS + VARIANTS[variant] + list(extra)]
    return [sys.executable, "-m", "t5_retrieval.cli", "train", "--model_dir", model_dir,
            "--gin_file=models/t5_tiny.gin", *gin]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """A failing test must not leave training processes running."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start(model_dir: str, variant: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts `t5r train`; its output goes to a log file next to model_dir (`proc.log_path`)."""
    log_path = os.path.join(os.path.dirname(model_dir), f"log_{time.time_ns()}.txt")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(train_command(model_dir, variant, extra), cwd=REPO, env=jax_env(1), stdout=log,
                                stderr=subprocess.STDOUT)
    proc.log_path = log_path
    STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"t5r train did not finish within {TIMEOUT_S}s") from None
    assert proc.returncode == 0, f"t5r train failed (exit {proc.returncode}):\n" + open(proc.log_path).read()[-3000:]


def completed_steps(model_dir: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(model_dir) if n.isdigit()) if os.path.isdir(model_dir) else []


def wait_for(proc: subprocess.Popen, condition, what: str, poll_s: float = 0.001):
    """Polls `condition()` until it returns something truthy; fails if the run ends or times out first."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n"
                                 + open(proc.log_path).read()[-3000:])
        time.sleep(poll_s)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def final_checkpoint(model_dir: str) -> tuple[dict, dict]:
    """The (state, data position) of the last step's checkpoint, as numpy, read without a target."""
    path = os.path.join(model_dir, str(TRAIN_STEPS))
    state = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"))
    data = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(path, "data"))
    return jax.tree.map(np.asarray, state), data


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run of a variant, started by the first test that asks for it (the killed
    runs' reference; naive_sum's is also the run whose last checkpoint a copy of is truncated)."""
    runs: dict[str, tuple[str, subprocess.Popen]] = {}

    def run(variant: str) -> tuple[str, subprocess.Popen]:
        if variant not in runs or runs[variant][1].poll() not in (None, 0):  # or killed after a failed test
            model_dir = str(tmp_path_factory.mktemp(f"uninterrupted_{variant}") / "model")
            runs[variant] = model_dir, start(model_dir, variant)
        return runs[variant]

    return run


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_run_killed_mid_step_and_mid_checkpoint_resumes_bit_identical(tmp_path, variant, uninterrupted):
    resumed_dir = str(tmp_path / "resumed" / "model")
    os.makedirs(os.path.dirname(resumed_dir))
    reference_dir, reference = uninterrupted(variant)

    # 1. Killed a random moment after the step-6 checkpoint: inside a later step (or between).
    proc = start(resumed_dir, variant)
    wait_for(proc, lambda: 6 in completed_steps(resumed_dir), "the step-6 checkpoint", poll_s=0.01)
    time.sleep(random.uniform(0.0, 0.3))
    kill(proc)
    killed_at = completed_steps(resumed_dir)
    assert killed_at[-1] < TRAIN_STEPS, f"the run finished before it could be killed: {killed_at}"

    # 2. Killed while writing a checkpoint: as soon as a temporary checkpoint directory appears.
    # A kill can land just after the rename; then try again at a later checkpoint.
    caught_mid_write = None
    for _ in range(4):
        proc = start(resumed_dir, variant)
        newest = completed_steps(resumed_dir)[-1]

        def writing_newer(newest: int = newest) -> list[str]:
            return [n for n in os.listdir(resumed_dir)
                    if TMP_MARKER in n and n.split(".")[0].isdigit() and int(n.split(".")[0]) > newest]

        if newest >= TRAIN_STEPS - 2:
            break
        wait_for(proc, writing_newer, "a checkpoint write")
        kill(proc)
        left = [n for n in os.listdir(resumed_dir) if TMP_MARKER in n]
        if left:
            caught_mid_write = left
            break
    if caught_mid_write is None:
        pytest.fail("no SIGKILL landed inside a checkpoint write (each left no temporary directory)")
    proc = start(resumed_dir, variant)
    finish(proc)
    finish(reference)

    assert not glob.glob(os.path.join(resumed_dir, f"*{TMP_MARKER}*")), \
        "the resumed run should delete the temporary directory of the killed save"
    (ref_state, ref_data), (state, data) = final_checkpoint(reference_dir), final_checkpoint(resumed_dir)
    assert data == ref_data, f"data iterator position differs: {data} vs uninterrupted {ref_data}"
    ref_leaves = jax.tree_util.tree_flatten_with_path(ref_state)[0]
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    assert [p for p, _ in leaves] == [p for p, _ in ref_leaves], "checkpointed state trees differ in structure"
    for (path, ref), (_, got) in zip(ref_leaves, leaves):
        np.testing.assert_array_equal(got, ref, err_msg=f"{variant}: resumed run (killed at steps {killed_at} and "
                                                        f"during write {caught_mid_write}) differs at "
                                                        f"{jax.tree_util.keystr(path)}")
    if variant == "taco":
        assert any("TacoState" in jax.tree_util.keystr(p) or "ema" in jax.tree_util.keystr(p) for p, _ in leaves), \
            "the TACO state should be part of the checkpoint"


def test_truncated_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, uninterrupted):
    finished_dir, finished = uninterrupted("naive_sum")  # a finished `t5r train` of naive_sum, copied
    finish(finished)
    model_dir = str(tmp_path / "model")
    shutil.copytree(finished_dir, model_dir)
    expected, _ = final_checkpoint(model_dir)
    assert completed_steps(model_dir) == [20, 22, 24], completed_steps(model_dir)

    # Truncate the array files of the last checkpoint, as a disk-full or killed copy would. Every one
    # of them: with only the largest cut, the restore still succeeded in about 1 run of 3 here.
    files = glob.glob(os.path.join(model_dir, str(TRAIN_STEPS), "state", "**", "d", "*"), recursive=True)
    assert files, "no array files found in the last checkpoint"
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    broken = os.path.join(model_dir, str(TRAIN_STEPS))
    assert checkpoint.manager(model_dir).latest_step() == TRAIN_STEPS

    finish(start(model_dir, "naive_sum"))  # resumes from 22 and redoes steps 23-24
    log_text = "".join(open(p).read() for p in glob.glob(str(tmp_path / "log_*.txt")))
    assert f"checkpoint {broken} could not be restored" in log_text, "the unreadable checkpoint's path must be reported"
    assert "trying the previous checkpoint" in log_text
    moved = glob.glob(os.path.join(model_dir, checkpoint.UNREADABLE_DIR, f"{TRAIN_STEPS}-*"))
    assert len(moved) == 1, f"the unreadable checkpoint should be set aside once, found {moved}"
    state, _ = final_checkpoint(model_dir)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(expected)[0], jax.tree.leaves(state)):
        np.testing.assert_array_equal(b, a, err_msg=f"redone steps 23-24 differ at {jax.tree_util.keystr(path)}")


def test_checkpoint_from_before_the_nonfinite_counters_resumes_with_zero_counts(tmp_path):
    import jax.numpy as jnp

    from t5_retrieval.train import restore_train_state
    from t5_retrieval.train_step import TrainState

    old = TrainState(step=jnp.array(7, jnp.int32), params={"w": jnp.arange(3.0)}, opt_state=(jnp.ones(2),),
                     rng=jnp.zeros(2, jnp.uint32), skipped_steps=None, nonfinite_in_a_row=None)  # no counts saved
    mngr = checkpoint.manager(str(tmp_path), writer=True)
    checkpoint.save(mngr, 7, old, {"step": 7})
    like = TrainState.create({"w": jnp.zeros(3)}, (jnp.zeros(2),), jnp.ones(2, jnp.uint32))
    state, data = restore_train_state(mngr, like)
    assert (int(state.step), data) == (7, {"step": 7})
    np.testing.assert_array_equal(state.params["w"], [0.0, 1.0, 2.0], err_msg="params not restored")
    assert (int(state.skipped_steps), int(state.nonfinite_in_a_row)) == (0, 0), "counters should start at 0"


def test_sigterm_checkpoints_the_current_step_exits_as_preempted_and_the_rerun_resumes_there(tmp_path):
    model_dir = str(tmp_path / "model")
    os.makedirs(model_dir)
    # No regular checkpoint before the end: the only earlier one can come from the SIGTERM.
    long_run = ("train.num_steps = 200", "train.checkpoint_every = 1000")
    proc = start(model_dir, "naive_sum", long_run)

    def logged_steps() -> bool:
        path = os.path.join(model_dir, "metrics.jsonl")
        return os.path.exists(path) and os.path.getsize(path) > 0

    wait_for(proc, logged_steps, "the first logged steps", poll_s=0.01)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError("the run did not stop after SIGTERM") from None
    log_text = open(proc.log_path).read()
    assert code == 128 + signal.SIGTERM, f"expected exit code {128 + signal.SIGTERM} (preempted), got {code}:\n" \
                                         + log_text[-2000:]
    saved = completed_steps(model_dir)
    assert len(saved) == 1 and 0 < saved[0] < 200, f"expected one checkpoint at the step SIGTERM stopped, got {saved}"
    assert f"preempted: saved {model_dir} at step {saved[0]}" in log_text, log_text[-2000:]
    finished = int(re.search(r"SIGTERM after step (\d+) finished", log_text).group(1))
    # Step finished+1 was running when the signal came; its checkpoint may wait for one more at most.
    assert finished + 1 <= saved[0] <= finished + 2, (finished, saved)

    rerun = start(model_dir, "naive_sum", long_run)
    finish(rerun)
    assert f"resumed {model_dir} at step {saved[0]}" in open(rerun.log_path).read()
    assert completed_steps(model_dir)[-1] == 200
