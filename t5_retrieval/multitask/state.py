"""Reading and resetting the multi-task part of a (chained) optimiser state.

Logging and the ANCE episodes need the TACO state wherever it sits in an optax chain; these
functions find the multi-task states by type, so they work on a bare state or any chain.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from t5_retrieval.multitask.cgd import CGDState
from t5_retrieval.multitask.gradnorm import GradNormState
from t5_retrieval.multitask.pcgrad import PCGradState
from t5_retrieval.multitask.taco import TacoState
from t5_retrieval.multitask.task_axis import softmax_tasks
from t5_retrieval.multitask.uncertainty import UncertaintyState

_MULTITASK_STATES = (TacoState, PCGradState, CGDState, GradNormState, UncertaintyState)


def _is_multitask_state(x: Any) -> bool:
    return isinstance(x, _MULTITASK_STATES)


def reset_taco(opt_state: Any) -> Any:
    """Returns ``opt_state`` with every TacoState re-initialised (zero EMA, step 0).

    Works on a bare TacoState or any optax chain state holding one; ANCE episodes call it so
    each episode gets its own burn-in. Dtypes and shardings of the arrays are kept.
    """
    def reset(x):
        if not isinstance(x, TacoState):
            return x
        return x._replace(step=jnp.zeros_like(x.step),
                          ema=jax.tree_util.tree_map(jnp.zeros_like, x.ema),
                          active=jnp.zeros_like(x.active))
    return jax.tree_util.tree_map(reset, opt_state, is_leaf=_is_multitask_state)


def find_taco_state(opt_state: Any) -> TacoState | None:
    """The (first) TacoState inside an optimiser state, or None."""
    for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_multitask_state):
        if isinstance(x, TacoState):
            return x
    return None


def multitask_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Cheap scalars for per-step logging from whichever multi-task state ``opt_state`` holds.

    TACO: ``taco/active`` (step >= burn-in at the last update) and ``taco/step``; the weight
    statistics cost a pass over the state and come from :func:`taco_metrics`. CGD, GradNorm and
    uncertainty weighting report their per-task weights (``sigma`` for the latter).
    """
    metrics: dict[str, jax.Array] = {}
    for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_multitask_state):
        if isinstance(x, TacoState):
            metrics["taco/active"] = x.active
            metrics["taco/step"] = x.step
            continue
        if isinstance(x, (CGDState, GradNormState)):
            vector, name = x.weights, f"{type(x).__name__.removesuffix('State').lower()}/weight"
        elif isinstance(x, UncertaintyState):
            vector, name = x.sigma, "uncertainty/sigma"
        else:
            continue
        metrics.update({f"{name}/{k}": vector[k] for k in range(vector.shape[0])})
    return metrics


def taco_weight_statistics(state: TacoState) -> dict[str, jax.Array]:
    """Logging statistics of the weights W = softmax_k(ema / tau) the last update used.

    ``mean_entropy`` (mean over parameters of the per-parameter task entropy, natural log; log K
    for uniform weights) and ``task_weight_mean`` [K] (each task's mean weight). They cost a pass
    over the K x P state, so the trainer computes them at logging steps, not inside the update.
    """
    k = jax.tree_util.tree_leaves(state.ema)[0].shape[0]
    total, entropy, weight_mean = 0, 0.0, 0.0
    for e in jax.tree_util.tree_leaves(state.ema):
        w, log_w = softmax_tasks(e.astype(jnp.float32) / state.tau)
        total += e[0].size
        entropy += -jnp.sum(w * log_w)
        weight_mean += jnp.sum(w.reshape(k, -1), axis=1)
    return {"mean_entropy": entropy / total, "task_weight_mean": weight_mean / total}


def taco_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """TACO scalars for logging steps; empty when ``opt_state`` holds no TacoState.

    ``taco/active``, ``taco/step``, ``taco/mean_entropy`` (mean per-parameter task entropy of the
    weights the last update used, natural log) and ``taco/weight_mean/{k}`` (each task's mean
    weight). One pass over the K x P state: call it every logging step, not every step.
    """
    state = find_taco_state(opt_state)
    if state is None:
        return {}
    stats = taco_weight_statistics(state)
    k = stats["task_weight_mean"].shape[0]
    return {"taco/active": state.active, "taco/step": state.step,
            "taco/mean_entropy": stats["mean_entropy"],
            **{f"taco/weight_mean/{i}": stats["task_weight_mean"][i] for i in range(k)}}
