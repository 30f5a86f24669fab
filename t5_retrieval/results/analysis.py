"""The task-specialisation analysis (TACO paper Fig. 1-2) of the finished rows, and its table."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from t5_retrieval.results.minilm_rows import RECIPE_EPISODES
from t5_retrieval.results.rows import ROWS
from t5_retrieval.stages import DONE

# The specialisation analysis compares these (with all parameters trained, and with the embedding tables frozen).
PROBE_ROWS = ("naive_noprefix", "naive_prefix", "taco", "naive_prefix_frozen_embeddings", "taco_frozen_embeddings")


LAST_EPISODE_MODEL = os.path.join("ance", f"episode_{RECIPE_EPISODES}", "model")  # a recipe row's model

# The rows whose training kept TACO's EMA (the TACO rows, and the naive controls of the both-tower and
# recipe rows, which track it without applying it) are analysed from that final EMA as well:
# {row: its model directory in the row's}.
TRAINING_EMA_ROWS = {"taco": "model", "taco_nonzero_median": "model", "taco_frozen_embeddings": "model",
                     "naive_prefix_frozen_embeddings_both_towers": "model", "taco_frozen_embeddings_both_towers": "model",
                     "taco_recipe_frozen": LAST_EPISODE_MODEL, "naive_recipe_frozen": LAST_EPISODE_MODEL}
PROBE_BATCHES, PROBE_BETA, PROBE_SEED = 50, 0.98, 1  # EMA at 1 - 0.98^50 = 64% of its signal


def sensitivity_analysis(work_dir: str) -> None:
    """TACO paper Fig. 1-2 for the finished rows of PROBE_ROWS: each trained model's task
    sensitivities probed on the same 50 training batches (`t5_retrieval.probe`), plus the final EMA
    of the TRAINING_EMA_ROWS runs (the weights TACO trained with, or would have); figures and analysis.json
    in `<work_dir>/analysis/<name>`."""
    from t5_retrieval.multitask.analysis import state_file
    from t5_retrieval.stages import is_done, stage

    for name in PROBE_ROWS:
        model_dir = os.path.join(work_dir, name, "model")
        if is_done(model_dir):
            out = os.path.join(work_dir, "analysis", name)
            stage(out, f"sensitivity probe {name}", functools.partial(probe_model, model_dir, out))
    for name, model in TRAINING_EMA_ROWS.items():
        saved = state_file(os.path.join(work_dir, name, model))
        if saved is not None:
            out = os.path.join(work_dir, "analysis", f"{name}_training")
            stage(out, f"{name} training state analysis", functools.partial(analyse_saved_state, saved, out))


def analyse_saved_state(path: str, out_dir: str) -> dict[str, Any]:
    """The analysis of a state file, with the tau it was trained with (`saved_tau`)."""
    from t5_retrieval.multitask.analysis import load_state_npz, saved_tau, write_analysis

    saved = load_state_npz(path)
    return analysis_numbers(write_analysis(saved.arrays, saved.task_names, saved_tau(path, saved), out_dir=out_dir))


def probe_model(model_dir: str, out_dir: str) -> dict[str, Any]:
    """Probes a row's trained model on batches of its own training data (seed PROBE_SEED)."""
    import gin

    from t5_retrieval import gin_utils, sharding
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.inference import load_dual_encoder
    from t5_retrieval.multitask.analysis import save_state_npz
    from t5_retrieval.probe import probe_sensitivities
    from t5_retrieval.stages import DONE

    with open(os.path.join(model_dir, DONE)) as f:
        trained = json.load(f)
    gin.clear_config()
    try:
        gin_utils.parse_gin(trained["gin_files"], trained["bindings"])
        batches = make_train_iterator(per_device_batch=gin.query_parameter("%PER_DEVICE_BATCH"), seed=PROBE_SEED)
        try:  # the parameters the run kept frozen are left out of the probe too
            frozen = tuple(gin.query_parameter("make_optimizer.frozen"))
        except ValueError:
            frozen = ()
    finally:
        gin.clear_config()
    encoder = load_dual_encoder(model_dir)
    probed = probe_sensitivities(encoder.model, encoder.params, batches, batches.task_names, PROBE_BATCHES,
                                 PROBE_BETA, encoder.config["dual_encoder"]["logit_scale"], sharding.make_mesh(),
                                 frozen=frozen)
    path = os.path.join(out_dir, "probe_state.npz")
    save_state_npz(probed.arrays, batches.task_names, path, probed.hyperparams)
    return analyse_saved_state(path, out_dir)


def analysis_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("task_specific_fraction", "not_activated_fraction", "mean_entropy", "max_entropy")}


def analysis_table(work_dir: str) -> str:
    """One line per analysed model: specialised / not-activated share and mean task entropy."""
    lines = []
    analysed = [(n, n, f"probe, {PROBE_BATCHES} batches, beta {PROBE_BETA}") for n in PROBE_ROWS]
    analysed += [(f"{n}_training", n, "its training EMA") for n in TRAINING_EMA_ROWS]
    for name, row, source in analysed:
        path = os.path.join(work_dir, "analysis", name, DONE)
        if os.path.exists(path):
            with open(path) as f:
                a = json.load(f)
            title = ROWS[row][0]
            lines.append(f"| {title} | {source} | {100 * a['task_specific_fraction']:.2f}% | "
                         f"{100 * a['not_activated_fraction']:.2f}% | {a['mean_entropy']:.3f} ({a['max_entropy']:.3f}) |")
    if not lines:
        return ""
    return "\n".join(["| model | sensitivities | task specific (entropy < 0.3) | not activated | mean entropy (max) |",
                      "|---|---|---|---|---|", *lines]) + "\n"
