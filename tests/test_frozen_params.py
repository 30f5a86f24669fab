"""`make_optimizer.frozen`: frozen parameters never move, for any method, and TACO's global median is
taken over the trained parameters only; a TACO run with a frozen word-embedding table trains,
checkpoints and resumes through `t5r train`."""

import functools
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import prepare_small_demo

from t5_retrieval import checkpoint, cli, gin_utils
from t5_retrieval.inference import load_dual_encoder
from t5_retrieval.multitask import taco
from t5_retrieval.multitask.analysis import STATE_FILE, load_state_npz
from t5_retrieval.optim import freeze, make_optimizer
from t5_retrieval.sharding import param_path
from t5_retrieval.train import train

TASKS = ("fever", "trex")
WORD_EMBEDDING = "bert/embeddings/word/embedding"


def params_and_task_gradients(num_tasks: int = 2):
    """A word-embedding table whose per-task gradients touch 2 of 50 rows (as a real batch's tokens do)
    beside a dense kernel with dense gradients."""
    rng = np.random.default_rng(0)
    params = {"embeddings": {"word": {"embedding": jnp.asarray(rng.normal(size=(50, 4)), jnp.float32)}},
              "dense": {"kernel": jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)}}
    sparse = np.zeros((num_tasks, 50, 4), np.float32)
    sparse[:, :2] = rng.normal(size=(num_tasks, 2, 4))
    grads = {"embeddings": {"word": {"embedding": jnp.asarray(sparse)}},
             "dense": {"kernel": jnp.asarray(rng.normal(size=(num_tasks, 4, 4)), jnp.float32)}}
    return params, grads


@pytest.mark.parametrize("multitask", [None, functools.partial(taco, burn_in_fraction=0.0)], ids=["none", "taco"])
def test_frozen_parameters_get_zero_updates_and_the_rest_train(multitask):
    params, grads = params_and_task_gradients()
    optimizer = make_optimizer(total_steps=10, num_tasks=2, learning_rate=0.1, multitask=multitask,
                               frozen=["embeddings/word/.*"])
    if multitask is None:  # the summed-loss path hands the optimiser one gradient, no task axis
        grads = jax.tree.map(lambda g: g.sum(0), grads)
    state = optimizer.init(params)
    for _ in range(3):
        updates, state = optimizer.update(grads, state, params, task_losses=jnp.ones(2))
        assert updates["embeddings"]["word"]["embedding"].shape == (50, 4)
        assert not np.any(np.asarray(updates["embeddings"]["word"]["embedding"])), "a frozen parameter moved"
    assert np.any(np.asarray(updates["dense"]["kernel"])), "after warm-up the trained parameter must move"


def test_tacos_median_is_taken_over_the_trained_parameters_only():
    params, grads = params_and_task_gradients()
    everything = taco(num_tasks=2, total_steps=10, burn_in_fraction=0.0, beta=0.0, median="exact")
    trained_only = freeze(taco(num_tasks=2, total_steps=10, burn_in_fraction=0.0, beta=0.0, median="exact"),
                          ["embeddings/.*"])
    _, all_state = everything.update(grads, everything.init(params), params)
    _, trained_state = trained_only.update(grads, trained_only.init(params), params)
    ema = optax.tree_utils.tree_get(trained_state, "TacoState").ema
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ema)[0]]
    assert paths == ["['dense']['kernel']"], f"only the trained kernel has sensitivity state: {paths}"
    # With the sparse table included, most sensitivities are 0 and so is the global median: TACO's
    # normaliser degenerates. Over the dense kernel alone it is positive.
    all_values = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(all_state.ema)])
    trained_values = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(ema)])
    assert np.median(all_values) == 0.0 and np.median(trained_values) > 0.0


def test_a_pattern_that_matches_no_parameter_is_named():
    params, _ = params_and_task_gradients()
    optimizer = make_optimizer(total_steps=10, num_tasks=2, frozen=["bert/embeddings/word/embedding"])
    with pytest.raises(ValueError, match="'bert/embeddings/word/embedding' matches no parameter"):
        optimizer.init(params)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepare_small_demo(tmp_path_factory.mktemp("frozen_demo"), TASKS)


def taco_bindings(data_dir: str, steps: int) -> list[str]:
    """A 1-layer BERT with MiniLM's 30,522-row vocabulary under runs/taco.gin: a step's 2 x 4 queries and
    their passages touch a few hundred rows, so the table is mostly untouched, as MiniLM's is."""
    return [f"DATA_DIR = '{data_dir}'", "VOCABULARY = @minilm_l6_dir()", "VOCAB_SIZE = 30522",
            f"MIXTURE_OR_TASK_NAME = {[f'demo_{t}' for t in TASKS]}", f"TRAIN_STEPS = {steps}", "QUERY_LEN = 16",
            "PASSAGE_LEN = 32", "NUM_NEGATIVES = 1", "PER_DEVICE_BATCH = 4", "NUM_LAYERS = 1",
            "train.checkpoint_every = 1", "train.keep_checkpoints = 10", "train.log_every = 1",
            "multitask.taco.burn_in_fraction = 0.0"]


def run_taco(model_dir: str, data_dir: str, steps: int, *bindings: str) -> None:
    gin.clear_config()
    try:
        gin_utils.parse_gin(["models/bert_tiny.gin", "runs/taco.gin"],
                            [*taco_bindings(data_dir, steps), *(bindings or [f"make_optimizer.frozen = ['{WORD_EMBEDDING}']"])])
        train(model_dir)
    finally:
        gin.clear_config()


def logged(model_dir: str) -> list[dict[str, float]]:
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_taco_whose_median_is_0_stops_at_step_1_naming_the_task_and_the_remedies(data_dir, tmp_path, capsys):
    model_dir = str(tmp_path / "model")
    argv = ["train", "--gin_file=models/bert_tiny.gin", "--gin_file=runs/taco.gin", f"--model_dir={model_dir}",
            "--gin.multitask.taco.median_over='all'",
            *[f"--gin.{b.replace(' = ', '=')}" for b in taco_bindings(data_dir, steps=3)]]
    status = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and "step 1: TACO: task 'demo_fever' has " in err[0], err
    zero_percent = float(err[0].split(" has ")[1].split("%")[0])
    assert zero_percent > 50.0, f"the median is 0 only when most sensitivities are: {err[0]}"
    assert "make_optimizer.frozen" in err[0] and "multitask.taco.median_over = 'nonzero'" in err[0], err[0]
    assert checkpoint.manager(model_dir).latest_step() is None, "no checkpoint of a collapsed TACO is written"


def test_allowed_zero_median_trains_and_logs_the_normaliser_per_task(data_dir, tmp_path, caplog):
    model_dir = str(tmp_path / "model")
    with caplog.at_level("WARNING"):
        run_taco(model_dir, data_dir, 2, "multitask.taco.median_over = 'all'", "multitask.taco.allow_zero_median = True")
    warnings = [r.getMessage() for r in caplog.records if "TACO: task" in r.getMessage()]
    assert len(warnings) == 2 and "allowed: multitask.taco.allow_zero_median" in warnings[0], warnings  # once a task
    for row in logged(model_dir):
        assert row["taco/median/0"] == 0.0 and row["taco/median/1"] == 0.0, row
        assert row["taco/zero_fraction/0"] > 0.5 and row["taco/zero_fraction/1"] > 0.5, row


def test_bert_models_shipped_with_taco_take_a_median_that_is_not_0(data_dir, tmp_path):
    """runs/taco.gin with a BERT-family model file (no binding of ours) does not collapse."""
    model_dir = str(tmp_path / "model")
    run_taco(model_dir, data_dir, 2, "train.seed = 0")
    for row in logged(model_dir):
        assert row["taco/median/0"] > 0.0 and row["taco/median/1"] > 0.0, row


def test_taco_with_a_frozen_word_embedding_trains_and_resumes(data_dir, tmp_path):
    model_dir = str(tmp_path / "model")

    def flat_params(step: int) -> dict[str, np.ndarray]:
        params = load_dual_encoder(model_dir, step).params
        return {param_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}

    run_taco(model_dir, data_dir, steps=2)
    # Read before the resume: its config.gin (3 steps) is not the one step 1 was trained with, so
    # step 1 no longer restores for inference afterwards (checkpoint records cover config.gin).
    flat_first = flat_params(1)
    run_taco(model_dir, data_dir, steps=3)  # resumes the partitioned optimiser state from step 2
    mngr = checkpoint.manager(model_dir)
    assert sorted(mngr.all_steps()) == [1, 2, 3]
    flat_last = flat_params(3)
    np.testing.assert_array_equal(flat_first[WORD_EMBEDDING], flat_last[WORD_EMBEDDING])
    moved = [path for path in flat_first if not np.array_equal(flat_first[path], flat_last[path])]
    assert len(moved) > 10 and WORD_EMBEDDING not in moved, moved
    ema, task_names, _ = load_state_npz(os.path.join(model_dir, STATE_FILE))
    assert [t.startswith("demo_") for t in task_names] == [True, True]
    assert not any("embeddings/word" in name for name in ema) and len(ema) > 10, sorted(ema)
    for row in logged(model_dir):  # the word-embedding table frozen, the median is not 0
        assert row["taco/median/0"] > 0.0 and row["taco/median/1"] > 0.0, row
