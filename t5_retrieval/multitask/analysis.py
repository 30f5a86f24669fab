"""TACO task-specialisation analysis (TACO paper Fig. 1-2): figures and numbers from an EMA state.

From the EMA of normalised sensitivities (leaves with a leading task axis K) this computes, per
parameter, the task weights W = softmax_k(ema / tau) and their entropy (natural log), then
writes:

  entropy_histogram.png         histogram of per-parameter task entropy, with the "task specific"
                                (entropy < 0.3) and "not activated" (all sensitivities ~0) bins
  sensitivity_distributions.png per-task distribution of log10 sensitivity (activated params)
  analysis.json                 the same numbers

``t5r analyze --state_npz STATE.npz --out DIR`` runs it on a file written by
:func:`save_state_npz` (one array per flattened EMA leaf path, ``task_names`` and the
``hyperparams`` of the state); the trainer writes one as `<model_dir>/multitask_state.npz`.
tau comes from the file, or for a file written before it held hyperparameters
(`taco_state.npz`) from the model's config.gin beside it, else TACO's default (`saved_tau`).
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from t5_retrieval import gin_utils
from t5_retrieval.data.records import DataError
from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.multitask.taco import DEFAULT_TAU
from t5_retrieval.sharding import param_path

log = logging.getLogger(__name__)
TASK_NAMES_KEY = "task_names"
HYPERPARAMS_KEY = "hyperparams"  # a JSON object: {name: number}
RESERVED_KEYS = (TASK_NAMES_KEY, HYPERPARAMS_KEY)
ENTROPY_BINS = 50
STATE_FILE = "multitask_state.npz"  # what `t5r train` writes into the model directory
TACO_STATE_FILE = "taco_state.npz"  # what it wrote before (arrays and task names, no hyperparameters)
CONFIG_FILE = "config.gin"  # the operative gin config `t5r train` writes beside it


class SavedState(NamedTuple):
    """A file written by :func:`save_state_npz`."""

    arrays: dict[str, np.ndarray]  # {leaf path: [K, ...]}
    task_names: list[str]
    hyperparams: dict[str, float]  # empty in a file written before they were saved


def state_file(model_dir: str) -> str | None:
    """The exported multi-task state of a model directory, under today's name or the earlier one."""
    for name in (STATE_FILE, TACO_STATE_FILE):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            return path
    return None


def save_state_npz(arrays: Any, task_names: Sequence[str], path: str,
                   hyperparams: Mapping[str, Any] | None = None) -> None:
    """Writes a pytree (leaves [K, ...]) as one float32 array per leaf path, plus the task names
    and the numeric hyperparameters that produced it."""
    flat = jax.tree_util.tree_flatten_with_path(arrays)[0]
    named = {param_path(p): np.asarray(x, np.float32) for p, x in flat}
    for reserved in RESERVED_KEYS:
        if reserved in named:
            raise ValueError(f"a state leaf is named {reserved!r}, which is reserved")
    for name, x in named.items():
        if x.ndim == 0 or x.shape[0] != len(task_names):
            raise ValueError(f"state leaf {name!r} has shape {x.shape}; expected a leading task axis "
                             f"of {len(task_names)} ({', '.join(task_names)})")
    numbers = {k: np.asarray(v).item() for k, v in (hyperparams or {}).items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    arrays = {**named, TASK_NAMES_KEY: np.array(list(task_names)), HYPERPARAMS_KEY: np.array(json.dumps(numbers))}
    np.savez(path, **arrays)


def load_state_npz(path: str) -> SavedState:
    """Reads a file written by :func:`save_state_npz` (or by the trainer before it saved hyperparameters)."""
    if not zipfile.is_zipfile(path):  # np.load would read an .npy or try a pickle instead
        raise DataError(f"{path}: not an .npz file; pass the state written by save_state_npz")
    try:
        with np.load(path) as data:
            names = [str(n) for n in data[TASK_NAMES_KEY]] if TASK_NAMES_KEY in data else None
            hyperparams = json.loads(str(data[HYPERPARAMS_KEY])) if HYPERPARAMS_KEY in data else {}
            arrays = {k: data[k] for k in data.files if k not in RESERVED_KEYS}
    except (ValueError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: damaged .npz ({type(e).__name__}: {e})") from None
    if names is None:
        raise DataError(f"{path}: no {TASK_NAMES_KEY!r} array; was it written by save_state_npz?")
    if not arrays:
        raise DataError(f"{path}: holds task names but no state leaf")
    for leaf, x in arrays.items():
        if x.ndim == 0 or x.shape[0] != len(names):
            raise DataError(f"{path}: leaf {leaf!r} has shape {x.shape}, expected leading axis "
                            f"{len(names)} (one per task in {TASK_NAMES_KEY})")
    return SavedState(arrays, names, hyperparams)


def saved_tau(path: str, saved: SavedState) -> float:
    """The tau the state at `path` was trained with: saved with it, else (a file written before
    hyperparameters were saved) the `taco.tau` of the model's config.gin beside it, else TACO's
    default. Logs where it came from."""
    if "tau" in saved.hyperparams:
        log.info("%s: tau %g, saved with the state", path, saved.hyperparams["tau"])
        return float(saved.hyperparams["tau"])
    config = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG_FILE)
    values = set(gin_utils.operative_values(config, "multitask.taco", "tau")) if os.path.exists(config) else set()
    if len(values) > 1:
        raise UserError(f"{config} binds taco.tau to {sorted(values)} in different scopes; say which with --tau")
    if values:
        tau = float(values.pop())
        log.warning("%s holds no tau (written before states saved their hyperparameters): tau %g from %s",
                    path, tau, config)
        return tau
    log.warning("%s holds no tau and %s binds none: TACO's default tau %g", path, config, DEFAULT_TAU)
    return DEFAULT_TAU


def _flat_ema(ema: Any) -> np.ndarray:
    leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(ema)]
    if not leaves:
        raise ValueError("empty EMA state")
    k = leaves[0].shape[0]
    return np.concatenate([x.reshape(k, -1) for x in leaves], axis=1)


def task_weights_and_entropy(ema: Any, tau: float) -> tuple[np.ndarray, np.ndarray]:
    """W = softmax_k(ema / tau) as [K, P] and its per-parameter entropy [P] (natural log)."""
    if tau == 0 or not np.isfinite(tau):
        raise ConfigError(f"tau must be finite and nonzero (TACO's softmax temperature), got {tau}")
    z = _flat_ema(ema).astype(np.float64) / tau
    z -= z.max(axis=0, keepdims=True)
    log_w = z - np.log(np.exp(z).sum(axis=0, keepdims=True))
    w = np.exp(log_w)
    return w, -(w * log_w).sum(axis=0)


def summarize(ema: Any, task_names: Sequence[str], tau: float,
              entropy_threshold: float = 0.3, inactive_threshold: float = 1e-6) -> dict[str, Any]:
    """The numbers behind the figures.

    "Not activated": every task's sensitivity is <= ``inactive_threshold`` (the EMA is normalised
    by the median, so typical values are ~1). "Task specific": activated and entropy below
    ``entropy_threshold``; each is attributed to its highest-weight task.
    """
    s = _flat_ema(ema)
    k, p = s.shape
    if len(task_names) != k:
        raise ValueError(f"{len(task_names)} task names for an EMA with {k} tasks")
    w, entropy = task_weights_and_entropy(ema, tau)
    inactive = np.all(s <= inactive_threshold, axis=0)
    specific = (~inactive) & (entropy < entropy_threshold)
    owner = np.argmax(w, axis=0)
    counts, edges = np.histogram(entropy, bins=ENTROPY_BINS, range=(0.0, max(np.log(k), 1e-9)))
    per_task = {}
    for i, name in enumerate(task_names):
        active_s = s[i][~inactive]
        log_s = np.log10(np.maximum(active_s, 1e-30))
        q = np.quantile(log_s, [0.01, 0.25, 0.5, 0.75, 0.99]) if log_s.size else [np.nan] * 5
        per_task[name] = {
            "mean_weight": float(w[i].mean()),
            "task_specific_fraction": float(np.mean(specific & (owner == i))),
            "log10_sensitivity_quantiles": dict(zip(["q01", "q25", "q50", "q75", "q99"],
                                                    map(float, q))),
        }
    return {
        "num_params": int(p),
        "num_tasks": int(k),
        "tau": float(tau),
        "entropy_threshold": float(entropy_threshold),
        "inactive_threshold": float(inactive_threshold),
        "max_entropy": float(np.log(k)),
        "mean_entropy": float(entropy.mean()),
        "task_specific_fraction": float(specific.mean()),
        "not_activated_fraction": float(inactive.mean()),
        "entropy_histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "tasks": per_task,
    }


def write_analysis(ema: Any, task_names: Sequence[str], tau: float, out_dir: str,
                   entropy_threshold: float = 0.3, inactive_threshold: float = 1e-6
                   ) -> dict[str, Any]:
    """Writes entropy_histogram.png, sensitivity_distributions.png and analysis.json to out_dir."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(ema, task_names, tau, entropy_threshold, inactive_threshold)
    s = _flat_ema(ema)
    _, entropy = task_weights_and_entropy(ema, tau)
    inactive = np.all(s <= inactive_threshold, axis=0)

    fig, ax = plt.subplots(figsize=(6, 4))
    edges = np.asarray(summary["entropy_histogram"]["edges"])
    ax.hist([entropy[~inactive], entropy[inactive]], bins=edges.tolist(), stacked=True,
            label=["activated", "not activated"], color=["tab:blue", "tab:gray"])
    ax.axvline(entropy_threshold, color="tab:red", linestyle="--",
               label=f"task specific (< {entropy_threshold:g}): "
                     f"{100 * summary['task_specific_fraction']:.1f}%")
    ax.set_xlabel("task entropy of parameter (nats)")
    ax.set_ylabel("parameters")
    ax.set_title(f"TACO task entropy (tau={tau:g}, not activated "
                 f"{100 * summary['not_activated_fraction']:.1f}%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "entropy_histogram.png"), dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, name in enumerate(task_names):
        values = np.log10(np.maximum(s[i][~inactive], 1e-30))
        if values.size:
            ax.hist(values, bins=60, histtype="step", density=True, label=name)
    ax.set_xlabel("log10 normalised sensitivity (EMA)")
    ax.set_ylabel("density")
    ax.set_title("Per-task parameter sensitivity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "sensitivity_distributions.png"), dpi=120)
    plt.close(fig)

    with open(os.path.join(out_dir, "analysis.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary
