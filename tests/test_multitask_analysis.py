"""TACO analysis: entropy, bins, JSON and figures from a hand-built EMA state; the saved state's
file, and the tau it was trained with (saved with it, or for an older file from config.gin)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5_retrieval import cli
from t5_retrieval.multitask import analysis, taco
from t5_retrieval.multitask.taco import DEFAULT_TAU


def _ema():
    """3 tasks x 6 params: 2 owned by one task, 2 shared equally, 2 not activated."""
    k = np.array([[40.0, 0.0, 1.0, 0.0, 0.0],
                  [0.0, 40.0, 1.0, 0.0, 0.0],
                  [0.0, 0.0, 1.0, 0.0, 0.0]])
    b = np.array([[2.0], [2.0], [2.0]])
    return {"layer": {"kernel": k, "bias": b}}


def test_entropy_is_natural_log_of_softmax_over_tasks():
    w, h = analysis.task_weights_and_entropy(_ema(), tau=2.0)
    np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-12, err_msg="weights sum to 1 over tasks")
    # Leaves flatten in key order (bias, kernel): columns 0 and 3 are uniform, 1 is task 0's.
    assert np.allclose(h[[0, 3]], np.log(3)), f"uniform columns must have entropy ln 3, got {h}"
    z = np.array([20.0, 0.0, 0.0])
    p = np.exp(z) / np.exp(z).sum()
    np.testing.assert_allclose(h[1], -(p * np.log(p)).sum(), rtol=1e-6)


def test_summary_counts_task_specific_and_not_activated_bins():
    s = analysis.summarize(_ema(), ["nq", "fever", "trex"], tau=2.0)
    assert s["num_params"] == 6 and s["num_tasks"] == 3
    assert s["not_activated_fraction"] == pytest.approx(2 / 6), "columns 3 and 4 are all zero"
    assert s["task_specific_fraction"] == pytest.approx(2 / 6), "columns 0 and 1 are specific"
    assert s["tasks"]["nq"]["task_specific_fraction"] == pytest.approx(1 / 6)
    assert s["tasks"]["fever"]["task_specific_fraction"] == pytest.approx(1 / 6)
    assert s["tasks"]["trex"]["task_specific_fraction"] == 0.0
    assert sum(s["entropy_histogram"]["counts"]) == 6


def test_save_and_load_npz_round_trip_a_taco_state_with_its_hyperparameters(tmp_path):
    params = {"a": jnp.ones((3, 2)), "b": {"c": jnp.ones(4)}}
    tx = taco(num_tasks=2, total_steps=10, burn_in_fraction=0.0, tau=0.5)
    state = tx.init(params)
    grads = {"a": jnp.arange(12.0).reshape(2, 3, 2), "b": {"c": jnp.arange(8.0).reshape(2, 4)}}
    _, state = jax.jit(tx.update)(grads, state, params)
    path = str(tmp_path / "state.npz")
    analysis.save_state_npz(state.ema, ["nq", "fever"], path, state.hyperparams)
    saved = analysis.load_state_npz(path)
    assert saved.task_names == ["nq", "fever"]
    assert set(saved.arrays) == {"a", "b/c"}
    np.testing.assert_allclose(saved.arrays["b/c"], np.asarray(state.ema["b"]["c"]))
    assert saved.hyperparams == {"beta": pytest.approx(0.999), "burn_in_steps": 0, "median_samples": 1 << 18,
                                 "median_seed": 0, "tau": 0.5, "zero_median_fatal": 1}
    assert analysis.saved_tau(path, saved) == 0.5


def test_save_rejects_wrong_task_count(tmp_path):
    with pytest.raises(ValueError, match="leading task axis of 2"):
        analysis.save_state_npz({"w": np.zeros((3, 4))}, ["a", "b"], str(tmp_path / "x.npz"))


def test_load_rejects_file_without_task_names(tmp_path):
    path = str(tmp_path / "bad.npz")
    np.savez(path, w=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="task_names"):
        analysis.load_state_npz(path)


def _old_taco_state(model_dir, config_gin: str | None) -> str:
    """A model directory as `t5r train` left it before states saved hyperparameters: taco_state.npz
    (arrays and task names only) and, if given, its config.gin."""
    os.makedirs(model_dir)
    path = os.path.join(model_dir, analysis.TACO_STATE_FILE)
    np.savez(path, w=np.zeros((2, 3)), task_names=np.array(["nq", "fever"]))
    if config_gin is not None:
        with open(os.path.join(model_dir, "config.gin"), "w") as f:
            f.write(config_gin)
    return path


def test_a_state_saved_before_hyperparameters_takes_tau_from_the_models_config_gin(tmp_path, caplog):
    config = ("# Macros:\nTAU = 0.75\n\n# Parameters for episode/taco:\n"
              "episode/taco.beta = 0.99\nepisode/taco.tau = %TAU\n\n"
              "# Parameters for train:\ntrain.log_every = 20\n")
    path = _old_taco_state(str(tmp_path / "model"), config)
    assert analysis.state_file(str(tmp_path / "model")) == path, "the old file name is still found"
    saved = analysis.load_state_npz(path)
    assert saved.hyperparams == {} and saved.task_names == ["nq", "fever"]
    assert analysis.saved_tau(path, saved) == 0.75
    assert "tau 0.75 from" in caplog.text and "config.gin" in caplog.text, "the source of tau must be logged"


def test_a_state_saved_before_hyperparameters_without_a_tau_binding_takes_tacos_default(tmp_path, caplog):
    path = _old_taco_state(str(tmp_path / "model"), "train.log_every = 20\n")
    assert analysis.saved_tau(path, analysis.load_state_npz(path)) == DEFAULT_TAU
    assert "TACO's default tau" in caplog.text


def test_the_new_state_file_is_found_before_the_old_one(tmp_path):
    model_dir = str(tmp_path / "model")
    _old_taco_state(model_dir, None)
    analysis.save_state_npz({"w": np.zeros((2, 3))}, ["nq", "fever"], os.path.join(model_dir, analysis.STATE_FILE))
    assert analysis.state_file(model_dir) == os.path.join(model_dir, analysis.STATE_FILE)
    assert analysis.state_file(str(tmp_path)) is None


def test_t5r_analyze_reads_tau_from_the_saved_state_unless_given(tmp_path):
    state = str(tmp_path / "state.npz")
    analysis.save_state_npz(_ema(), ["nq", "fever", "trex"], state, {"tau": 0.5})
    for argv, tau in (([], 0.5), (["--tau", "4.0"], 4.0)):
        out = str(tmp_path / f"out{tau}")
        assert cli.main(["analyze", "--state_npz", state, "--out", out, *argv]) == 0
        with open(os.path.join(out, "analysis.json")) as f:
            assert json.load(f)["tau"] == tau


def test_t5r_analyze_writes_figures_and_json(tmp_path, capsys):
    state = str(tmp_path / "state.npz")
    analysis.save_state_npz(_ema(), ["nq", "fever", "trex"], state)
    out = str(tmp_path / "out")
    assert cli.main(["analyze", "--state_npz", state, "--out", out, "--tau", "2.0"]) == 0
    for name in ("entropy_histogram.png", "sensitivity_distributions.png"):
        with open(os.path.join(out, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{name} must be a PNG"
    with open(os.path.join(out, "analysis.json")) as f:
        summary = json.load(f)
    assert summary["task_specific_fraction"] == pytest.approx(2 / 6)
    assert "task specific 33.33%" in capsys.readouterr().out
