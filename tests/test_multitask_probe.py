"""The sensitivity probe measures what TACO training measures: with a learning rate of 0 (params
fixed) and no dropout, a TACO run's final EMA equals the probe's over the same batches."""

import os

import gin
import jax
import numpy as np
from tiny_model import _bindings, build_tiny_run

from t5_retrieval import gin_utils, sharding
from t5_retrieval.data.batching.batches import make_train_iterator
from t5_retrieval.inference import load_encoder
from t5_retrieval.multitask.analysis import STATE_FILE, load_state_npz
from t5_retrieval.probe import probe_sensitivities
from t5_retrieval.train import train

STEPS, BETA = 4, 0.5


def test_probe_equals_the_ema_of_a_taco_run_that_does_not_move(tmp_path, clean_gin):
    run = build_tiny_run(str(tmp_path), models=())
    bindings = [*_bindings(run.data_dir, run.vocabulary), f"TRAIN_STEPS = {STEPS}", "DROPOUT = 0.0",
                "LEARNING_RATE = 0.0", "train.per_device_batch = 4", f"multitask.taco.beta = {BETA}"]
    gin_utils.parse_gin(["models/t5_tiny.gin", "runs/taco.gin"], bindings)
    model_dir = str(tmp_path / "model")
    train(model_dir)
    trained_ema, names, _ = load_state_npz(os.path.join(model_dir, STATE_FILE))

    encoder = load_encoder(model_dir)
    batches = make_train_iterator(per_device_batch=4)  # the run's first batches again (seed 0)
    gin.clear_config()
    ema = probe_sensitivities(encoder.model, encoder.params, batches, names, STEPS, BETA,
                              encoder.config["dual_encoder"]["logit_scale"], sharding.make_mesh(), progress=False).arrays
    probed = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
              for path, x in jax.tree_util.tree_flatten_with_path(ema)[0]}
    assert sorted(probed) == sorted(trained_ema), "the probe's EMA must cover the same parameters"
    for name, value in trained_ema.items():
        assert value.shape[0] == len(names)
        np.testing.assert_allclose(probed[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    assert max(float(np.abs(v).max()) for v in trained_ema.values()) > 0
