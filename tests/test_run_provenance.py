"""A run record keeps what ran: every model's operative gin config, TACO's medians at each logged step
and the specialisation of its final state, as recomputed from the model directory it came from."""

import dataclasses
import functools
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from process_harness import XLA_CACHE

from t5_retrieval.multitask.analysis import load_state_npz, state_file, summarize
from t5_retrieval.multitask.taco import taco
from t5_retrieval.results.common import train_model
from t5_retrieval.results.curve import curve_count, curve_table
from t5_retrieval.results.provenance import training_record
from t5_retrieval.results.records import RunRecord, read_records
from t5_retrieval.results.specialisation import ran_as_defined, run_specialisation, specialisation_table
from t5_retrieval.stages import stage

TINY = ["models/t5_tiny.gin"]
BINDINGS = ["VOCAB_SIZE = 128", "D_MODEL = 32", "D_FF = 64", "DROPOUT = 0.0", "train.batches = @RandomBatches",
            "RandomBatches.num_negatives = 1", "make_optimizer.learning_rate = 1e-3", "train.per_device_batch = 16",
            "train.num_steps = 20", "train.log_every = 5", "train.multitask = @multitask.taco",
            "multitask.taco.beta = 0.9"]
RECORDS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "run_records", "mini_kilt_task_lengths")


def trained_run(run_dir: str, *extra: str) -> str:
    """A run directory whose `model/` was trained by a stage, as `t5r results` trains a row's model;
    its bindings name a path in the work directory (the suite's compilation cache, linked there),
    which its config.gin leaves out (a machine-local setting)."""
    model_dir = os.path.join(run_dir, "model")
    cache = os.path.join(os.path.dirname(run_dir), "xla")
    if not os.path.lexists(cache):
        os.symlink(XLA_CACHE, cache)
    bindings = [*BINDINGS, f"train.compilation_cache_dir = '{cache}'", *extra]
    stage(model_dir, "training", functools.partial(train_model, model_dir, TINY, bindings))
    return model_dir


@pytest.fixture(scope="module")
def taco_run(tmp_path_factory) -> str:
    run_dir = str(tmp_path_factory.mktemp("work") / "taco")
    trained_run(run_dir)
    return run_dir


def test_the_record_keeps_the_operative_config_without_machine_paths(taco_run):
    model = training_record(taco_run)["model"]
    with open(os.path.join(taco_run, "model", "config.gin")) as f:
        config = f.read()
    work_dir = os.path.dirname(taco_run)
    assert "\ntaco.beta = 0.9\n" in model["operative_config"], model["operative_config"]
    assert work_dir not in model["operative_config"], "the work directory is a placeholder"
    assert "compilation_cache_dir" not in config and work_dir not in config, "config.gin leaves out the machine's cache"
    assert model["operative_config"] == config.replace(work_dir, "<work_dir>").replace(sys.prefix, "<python>")
    assert model["steps"] == 20 and model["gin_files"] == TINY
    assert model["bindings"][:len(BINDINGS)] == BINDINGS
    assert model["bindings"][len(BINDINGS)] == "train.compilation_cache_dir = '<work_dir>/xla'"


def test_the_record_keeps_tacos_statistics_at_every_logged_step(taco_run):
    model = training_record(taco_run)["model"]
    with open(os.path.join(taco_run, "model", "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    statistics = model["method_statistics"]
    assert statistics["steps"] == [r["step"] for r in logged], "one entry per logged step"
    for k in range(2):  # RandomBatches' two tasks
        assert statistics["values"][f"taco/median/{k}"] == [r[f"taco/median/{k}"] for r in logged]
        assert statistics["values"][f"taco/zero_fraction/{k}"] == [r[f"taco/zero_fraction/{k}"] for r in logged]
    assert not any(name.startswith("loss") for name in statistics["values"]), "the trainer's own scalars stay out"


def test_the_recorded_specialisation_is_the_final_states(taco_run):
    model = training_record(taco_run)["model"]
    saved = load_state_npz(state_file(os.path.join(taco_run, "model")))
    expected = summarize(saved.arrays, saved.task_names, saved.hyperparams["tau"])
    recorded = model["specialisation"]
    for key in ("task_specific_fraction", "not_activated_fraction", "mean_entropy", "max_entropy", "tau", "num_params"):
        assert recorded[key] == expected[key], key
    assert recorded["task_names"] == saved.task_names
    assert recorded["tasks"] == {n: {k: t[k] for k in ("task_specific_fraction", "mean_weight")}
                                 for n, t in expected["tasks"].items()}


def test_the_specialisation_table_reads_the_run_from_its_record_alone(taco_run):
    record = RunRecord("taco_recipe_frozen", 0, 1.0, {}, {}, {}, training_record(taco_run))
    spec = run_specialisation(record)
    assert spec is not None and spec.model == "model"
    assert ran_as_defined(spec) is True, spec.medians
    table = specialisation_table({"taco_recipe_frozen": [record]})
    assert "| 1 | 2 | 1 of 1 runs; smallest" in table, table
    # A median of 0 at one logged step is what the table must report as not TACO.
    values = record.training["model"]["method_statistics"]["values"]
    values["taco/median/1"][-1] = 0.0
    assert ran_as_defined(run_specialisation(record)) is False
    assert "| 0 of 1 runs; smallest 0.0e+00 |" in specialisation_table({"taco_recipe_frozen": [record]})


def test_a_negative_temperature_weights_each_parameter_toward_its_least_sensitive_task():
    """The paper's temperature ablation: tau -2 gives each parameter the weights tau 2 gives it, task
    for task reversed, and its specialisation is analysed with that tau."""
    params = {"w": jnp.ones([4])}
    # Task 1 is 4x as sensitive as task 0 at parameter 0, task 0 4x as task 1 at parameter 2.
    grads = {"w": jnp.array([[1.0, 1.0, 4.0, 1.0], [4.0, 1.0, 1.0, 1.0]])}
    updates = {}
    for tau in (2.0, -2.0):
        tx = taco(num_tasks=2, total_steps=10, burn_in_fraction=0.0, beta=0.0, tau=tau)
        updates[tau], state = tx.update(grads, tx.init(params), params)
    w1 = 1 / (1 + np.exp(-3.0 / 2))  # softmax over tasks of the normalised sensitivities (1, 4) / 2
    np.testing.assert_allclose(updates[2.0]["w"][0], ((1 - w1) * 1 + w1 * 4) / 2, rtol=1e-6)
    np.testing.assert_allclose(updates[-2.0]["w"][0], (w1 * 1 + (1 - w1) * 4) / 2, rtol=1e-6)
    summary = summarize(state.ema, ["a", "b"], -2.0)
    assert summary["tau"] == -2.0 and 0.0 < summary["mean_entropy"] < summary["max_entropy"]


def test_committed_taco_records_ran_as_defined_at_every_logged_step():
    """Every committed record of a run that kept a TACO state (format 2) shows each task's median
    positive at every logged step after the first update, and a summary that adds up."""
    checked = 0
    for runs in read_records(RECORDS).values():
        for run in runs:
            spec = run_specialisation(run)
            if spec is None or spec.medians is None:
                continue
            checked += 1
            assert ran_as_defined(spec), f"{run.file_name}: a median of 0 at a logged step: {spec.medians.min()}"
            tasks = spec.summary["tasks"]
            assert np.isclose(sum(t["task_specific_fraction"] for t in tasks.values()),
                              spec.summary["task_specific_fraction"]), run.file_name
            assert np.isclose(sum(t["mean_weight"] for t in tasks.values()), 1.0), run.file_name
    assert checked, "no committed record holds TACO's statistics (the warm-up curve's records do)"


def test_the_curve_prints_taco_minus_naive_with_its_interval_and_both_sides_specialisation():
    """A warm-up point from the committed 1-epoch TACO record, against a naive run that scored 0 on
    every query: the difference is TACO's own mean, its interval excludes 0, and both sides print
    their specialisation; a point without its naive run prints TACO's side alone."""
    (taco_run,) = read_records(RECORDS)["taco_recipe_frozen_warmup_1ep"]
    zeros = {task: {key: np.zeros_like(values) for key, values in metrics.items()}
             for task, metrics in taco_run.per_query.items()}
    naive_run = dataclasses.replace(taco_run, row="naive_recipe_frozen_warmup_1ep", per_query=zeros)
    records = {"taco_recipe_frozen_warmup_1ep": [taco_run], "naive_recipe_frozen_warmup_1ep": [naive_run]}
    assert curve_count(records) == 1
    (line,) = curve_table(records, m=1).splitlines()[2:]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:2] == ["1 (273 steps)", "1 / 1"], cells
    assert cells[4].startswith(f"{taco_run.mean('Rprec'):+.3f} [") and cells[4].endswith(" *"), cells
    assert cells[6] == "yes" and cells[7] == cells[8] and cells[7].endswith("%, 1.713"), cells
    alone = curve_table({"taco_recipe_frozen_warmup_1ep": [taco_run]}, m=0).splitlines()[2]
    assert "| 1 / 0 |" in alone and "| — | — | — |" in alone, alone
