"""The training program end to end on a tiny model: learning, exact resume, config checks, inference."""

import json
import os
import shutil

import gin
import jax
import numpy as np
import pytest

from t5_retrieval import checkpoint, gin_utils
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.errors import UserError
from t5_retrieval.inference import load_encoder
from t5_retrieval.train import train

TINY = ["models/t5_tiny.gin", ]
BINDINGS = ["VOCAB_SIZE = 128", "D_MODEL = 32", "D_FF = 64", "DROPOUT = 0.0",
            "train.batches = @RandomBatches", "RandomBatches.num_negatives = 1",
            "make_optimizer.learning_rate = 1e-3", "train.per_device_batch = 16", "train.log_every = 5"]


def run(model_dir, *extra):
    gin.clear_config()
    gin_utils.parse_gin(TINY, BINDINGS + list(extra))
    return train(str(model_dir))


def metrics(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("run") / "model"
    state = run(model_dir, "train.num_steps = 60", "train.checkpoint_every = 20")
    yield model_dir, jax.device_get(state.params)
    gin.clear_config()


def test_loss_falls_on_learnable_batches(finished_run):
    model_dir, _ = finished_run
    rows = metrics(model_dir)
    first, last = np.mean([r["loss"] for r in rows[:2]]), np.mean([r["loss"] for r in rows[-2:]])
    assert last < 0.5 * first, f"loss should fall by half in 60 steps: first {first:.3f}, last {last:.3f}"
    assert {"loss/task_a", "accuracy/task_b", "steps_per_second"} <= set(rows[-1]), sorted(rows[-1])


def test_training_says_what_it_is_doing(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        run(tmp_path / "model", "train.num_steps = 2", "train.checkpoint_every = 1")
    text = caplog.text
    for expected in (f"model {tmp_path / 'model'}: T5 dual encoder", "parameters", "device(s) (cpu)", "mesh {",
                     "peak learning rate 0.001", "the step embeds 1 query shape(s) in one pass of the model",
                     "step 1 compiled and ran in", "saved checkpoint "
                     f"{tmp_path / 'model' / '2'}", f"finished {tmp_path / 'model'} at step 2"):
        assert expected in text, f"{expected!r} not logged:\n{text}"


def test_tensorboard_reads_the_runs_metrics(finished_run):
    """The command docs give for watching a run works on a real run's tb/ directory."""
    import subprocess
    import sys

    model_dir, _ = finished_run
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    out = subprocess.run([tensorboard, "--inspect", "--logdir", str(model_dir / "tb")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and "loss/task_a" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_the_metrics_log_writes_tensorboard_events_without_importing_torch(tmp_path):
    """tensorboardX imports torch wherever it is installed (4 s of every run's start on a busy CI
    machine); the run's writer is imported without it, and what it writes still reads back."""
    import importlib.util
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed here: tensorboardX would not import it anyway")
    probe = ("import sys; from t5_retrieval.train import MetricsLog; log = MetricsLog(sys.argv[1], 0); "
             "log.write(3, {'loss': 0.5}); log.close(); print(sorted({'torch', 'tensorboardX'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['tensorboardX']", out.stdout + out.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 0.5)]


def test_resume_from_checkpoint_reaches_identical_parameters(finished_run, tmp_path):
    model_dir, final_params = finished_run
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(model_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "60")  # as if killed between the checkpoints at 40 and 60
    assert checkpoint.manager(str(resumed_dir)).latest_step() == 40
    state = run(resumed_dir, "train.num_steps = 60", "train.checkpoint_every = 20")
    assert int(state.step) == 60
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(final_params)[0],
                            jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b, err_msg=f"resumed run differs at {jax.tree_util.keystr(path)}")
    steps = [row["step"] for row in metrics(resumed_dir)]
    assert steps == sorted(set(steps)) == list(range(5, 61, 5)), f"one metrics row per logged step: {steps}"


def test_model_dir_with_another_architecture_is_refused(finished_run, tmp_path):
    model_dir, _ = finished_run
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    with pytest.raises(checkpoint.CheckpointError, match=r"model config differs from this run's in t5\.d_ff; "):
        run(other, "train.num_steps = 60", "D_FF = 96")


def test_a_checkpoint_whose_optimiser_state_does_not_fit_is_refused_saying_what_to_do(finished_run, tmp_path):
    """As a checkpoint written before multi-task states held their hyperparameters is: its optimiser
    state has other fields than this run's (here: no multi-task state at all)."""
    model_dir, _ = finished_run
    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    shutil.rmtree(other / "60")
    with pytest.raises(checkpoint.CheckpointError, match=r"optimiser state does not fit.*lacks opt_state/0/.*"
                                                         r"--gin.train.init_from=") as refused:
        run(other, "train.num_steps = 60", "train.multitask = @multitask.taco")
    assert isinstance(refused.value, UserError), "t5r shows it as one line, exit status 2"
    assert sorted(checkpoint.manager(str(other)).all_steps()) == [20, 40], "no checkpoint is set aside or deleted"


def test_a_run_written_before_newer_config_fields_resumes(finished_run, tmp_path):
    """Fields added to the model config since a run started (at their defaults) do not block its resume."""
    model_dir, final_params = finished_run
    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    shutil.rmtree(old / "60")
    config = checkpoint.read_config(str(old))
    for field in ("separate_query_encoder", "query_generation"):
        del config["dual_encoder"][field]
    config["features"].pop("passage_template", None)  # the real iterator records one, RandomBatches none
    for spec in config["features"]["tasks"].values():
        del spec["index"]
    with open(old / checkpoint.CONFIG_FILE, "w") as f:
        json.dump(config, f)
    state = run(old, "train.num_steps = 60", "train.checkpoint_every = 20")
    for a, b in zip(jax.tree.leaves(final_params), jax.tree.leaves(jax.device_get(state.params))):
        np.testing.assert_array_equal(a, b, err_msg="the upgraded run must resume bit-identically")
    assert checkpoint.read_config(str(old)) == checkpoint.read_config(str(model_dir)), "config rewritten as now"


def test_load_encoder_restores_the_trained_parameters(finished_run):
    model_dir, final_params = finished_run
    encoder = load_encoder(str(model_dir))
    tokens = next(RandomBatches(per_device_batch=2, local_data_devices=1))["task_a"]["passage_tokens"]
    expected = encoder.model.apply({"params": final_params}, tokens)
    np.testing.assert_allclose(encoder.encode_tokens(tokens), np.asarray(expected), rtol=1e-5, atol=1e-5,
                               err_msg="restored encoder does not embed like the trained parameters")
    assert encoder.dim == 32
    earlier = load_encoder(str(model_dir), step=40)
    assert earlier.fingerprint != encoder.fingerprint, "different checkpoints must have different fingerprints"
    with pytest.raises(KeyError, match="unknown task 'nope'.*task_a"):
        encoder.encode_queries(["q"], task="nope")


def test_a_config_recorded_before_vocabulary_digests_resumes_with_the_current_digest():
    from t5_retrieval.train import upgraded_config

    current = {"features": {"vocabulary": "/v/spm.model", "vocabulary_digest": "0123456789abcdef", "tasks": {}}}
    stored = {"features": {"vocabulary": "/v/spm.model", "tasks": {}}}
    assert upgraded_config(stored, current) == current, "a run started before digests were recorded must resume"
    changed = {"features": {**current["features"], "vocabulary_digest": "fedcba9876543210"}}
    assert upgraded_config(changed, current) != current, "a recorded digest is never overwritten"


def test_zero_steps_is_refused_naming_the_binding(tmp_path):
    """num_steps=0 once counted as unset and the run died computing None epochs x steps per epoch."""
    with pytest.raises(UserError, match=r"^train.num_steps must be >= 1, got 0\n"):
        train(str(tmp_path / "model"), batches=RandomBatches, num_steps=0)


def test_training_without_seqio_data_starts_without_tensorflow():
    """seqio, and TensorFlow under it (~5 s to import), load only when a run reads a seqio
    Mixture: `t5r train` over RandomBatches starts without them."""
    import subprocess
    import sys

    probe = "import sys, t5_retrieval.train; print(sorted({'seqio', 'tensorflow'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
