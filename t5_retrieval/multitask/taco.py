"""TACO: per-parameter softmax weighting of task gradients by their EMA sensitivity.

Zhang et al., "Improving Multitask Retrieval by Promoting Task Specialization", TACL 2023. Per
step, with per-task gradients G_k and params theta (the authors' code)::

    S_k  = |theta * G_k| / (median over ALL params of |theta * G_k| + 1e-12)
    ema  = beta * ema + (1 - beta) * S                              (zero init, no bias fix)
    g    = sum_k G_k                      if step < burn_in_steps
           sum_k softmax_k(ema / tau) G_k otherwise
    return g / K

`update_fn` follows it step by step (the EMA and the weighted sum per leaf, in `_taco_leaf`).
What the paper does not have is kept apart, in the section "Additions" at the end: the
approximate median and the median over nonzero values (`_median`), the scale switch
(`_output_scales`) and a bfloat16 EMA written with stochastic rounding (`_ema_writer`). All
default to the paper's behaviour.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5_retrieval.errors import ConfigError
from t5_retrieval.multitask.bf16 import stochastic_round_bfloat16
from t5_retrieval.multitask.median import MEDIAN_OVER, taco_global_median, zero_fraction
from t5_retrieval.multitask.state import MultitaskProblem, hyperparameter_arrays
from t5_retrieval.multitask.task_axis import num_tasks as task_count
from t5_retrieval.multitask.task_axis import softmax_tasks, sum_tasks

MEDIAN_EPS = 1e-12  # added to the global median before dividing (reference value)
DEFAULT_TAU = 2.0  # the paper's softmax temperature, `taco`'s default


class TacoState(NamedTuple):
    """TACO state. ``ema`` is K x (params): leaves [K, *param.shape], a leading 'tasks' axis.

    ``hyperparams`` holds the numeric hyperparameters the update ran with (``beta``,
    ``burn_in_steps``, ``median_samples``, ``median_seed``, ``tau``, ``zero_median_fatal``): with
    ``tau`` the weights can be recomputed exactly from the state alone (for logging with
    `statistics` and for the analysis) without the update paying for statistics every step.

    ``median`` and ``zero_fraction`` describe the normaliser of the last update: each task's median
    of |theta * G_k| (before the epsilon) and the fraction of its sensitivities that are exactly 0.
    A median of 0 means the update divided by 1e-12 alone (see `problems`).
    """

    step: jax.Array  # int32 []: updates since the last reset
    ema: Any  # leaves [K, *param.shape] in the configured state dtype
    active: jax.Array  # bool []: whether the last step used the softmax weights (step >= burn-in)
    median: jax.Array  # f32 [K]: the median each task's sensitivities were divided by (plus 1e-12)
    zero_fraction: jax.Array  # f32 [K]: fraction of each task's sensitivities that are exactly 0
    hyperparams: dict[str, jax.Array]  # scalars: beta, burn_in_steps, median_samples, median_seed, tau, ...

    def metrics(self) -> dict[str, jax.Array]:
        """``taco/active`` (whether the last update used the weights), ``taco/step``, and per task
        ``taco/median/{k}`` and ``taco/zero_fraction/{k}`` (the normaliser of the last update)."""
        k = self.median.shape[0]
        return {"taco/active": self.active, "taco/step": self.step,
                **{f"taco/median/{i}": self.median[i] for i in range(k)},
                **{f"taco/zero_fraction/{i}": self.zero_fraction[i] for i in range(k)}}

    def problems(self, task_names: Sequence[str]) -> list[MultitaskProblem]:
        """One per task whose last median was 0: its sensitivities were divided by 1e-12, so the
        EMA is ~1e12 times them and softmax(EMA / tau) is a per-parameter argmax over tasks, which
        is not TACO. Fatal unless the transform was built with ``allow_zero_median=True``."""
        if int(self.step) == 0:  # no update yet: nothing was divided
            return []
        median, zeros = np.asarray(jax.device_get(self.median)), np.asarray(jax.device_get(self.zero_fraction))
        fatal = bool(int(self.hyperparams["zero_median_fatal"]))
        return [MultitaskProblem(
            f"TACO: task {name!r} has {zeros[i]:.1%} of its sensitivities |theta * G| exactly 0, so the median "
            "it divides by is 0 and its weights collapse to a per-parameter argmax over tasks; freeze the "
            "untouched embedding tables (make_optimizer.frozen = [...], docs/taco.md) or set "
            "multitask.taco.median_over = 'nonzero'" + ("" if fatal else " (allowed: multitask.taco.allow_zero_median)"),
            fatal, f"taco/zero_median/{name}") for i, name in enumerate(task_names) if median[i] == 0]

    def statistics(self) -> dict[str, jax.Array]:
        """Statistics of the weights W = softmax_k(ema / tau) the last update used.

        ``taco/mean_entropy`` (mean over parameters of the per-parameter task entropy, natural log;
        log K for uniform weights) and ``taco/weight_mean/{k}`` (each task's mean weight). They cost
        a pass over the K x P state, so the trainer computes them at logging steps, not in the update.
        """
        k = jax.tree_util.tree_leaves(self.ema)[0].shape[0]
        total, entropy, weight_mean = 0, jnp.zeros([]), jnp.zeros([k])
        for e in jax.tree_util.tree_leaves(self.ema):
            w, log_w = softmax_tasks(e.astype(jnp.float32) / self.hyperparams["tau"])
            total += e[0].size
            entropy += -jnp.sum(w * log_w)
            weight_mean += jnp.sum(w.reshape(k, -1), axis=1)
        weight_mean = weight_mean / total
        return {"taco/mean_entropy": entropy / total, **{f"taco/weight_mean/{i}": weight_mean[i] for i in range(k)}}

    def exported(self) -> Any:
        """The EMA of normalised sensitivities, which `t5r analyze` turns into Fig. 1-2 of the paper."""
        return self.ema

    def reset(self) -> TacoState:
        """Zero EMA, step 0 (a new burn-in), dtypes and shardings kept."""
        return self._replace(step=jnp.zeros_like(self.step), ema=jax.tree_util.tree_map(jnp.zeros_like, self.ema),
                             active=jnp.zeros_like(self.active), median=jnp.zeros_like(self.median),
                             zero_fraction=jnp.zeros_like(self.zero_fraction))


@gin.register(module="multitask")
def taco(
    num_tasks: int,
    total_steps: int,
    burn_in_fraction: float = 0.1,
    beta: float = 0.999,
    tau: float = DEFAULT_TAU,
    median: str = "exact",
    median_samples: int = 1 << 18,
    median_seed: int = 0,
    median_over: str = "all",
    keep_naive_scale: bool = False,
    state_dtype: Any = jnp.float32,
    allow_zero_median: bool = False,
) -> optax.GradientTransformation:
    """TACO (Zhang et al., TACL 2023): per-parameter softmax weights over tasks from an EMA of
    normalised sensitivities.

    ``update(per_task_grads, state, params)`` with gradients G (leaves [K, ...]) and the current
    params theta returns an ordinary gradient::

        S_k = |theta * G_k| / (median over all params of |theta * G_k| + 1e-12)
        ema = beta * ema + (1 - beta) * S
        return sum_k G_k / K                       while step < burn_in_steps
               sum_k softmax_k(ema / tau) G_k / K  after

    Args:
      num_tasks: K, the size of the leading task axis of the gradients.
      total_steps: the run's (or ANCE episode's) optimiser steps, which the burn-in is a fraction of.
      burn_in_fraction: burn_in_steps = round(burn_in_fraction * total_steps) steps use the plain
        sum while the EMA warms up (the reference uses 10% of the episode's steps). The EMA is
        updated during burn-in too.
      beta: EMA decay of the normalised sensitivities.
      tau: softmax temperature over tasks. Positive weights each parameter toward the tasks it is
        most sensitive to (specialisation); negative toward the least sensitive, which
        discourages specialisation (the paper's temperature ablation).
      median: ``"exact"`` (radix select over all K x P values) or ``"approx"`` (lower median of
        a fixed random sample of ``median_samples`` parameter positions drawn from
        ``median_seed``; exact when the model has at most that many parameters). See
        docs/taco.md for the measured agreement and cost.
      median_over: ``"all"`` parameters (the paper's reference code) or each task's ``"nonzero"``
        sensitivities only. Not the paper's method: with "all", a model whose parameters are mostly
        untouched by a batch (a large word-embedding table: 52% of MiniLM) gets a median of 0, so
        S_k = |theta * G_k| / 1e-12 and the softmax over tasks is one-hot (docs/taco.md, "Pitfall").
      keep_naive_scale: False divides by K in every branch, as the reference code does (so the
        gradient shrinks ~K-fold when burn-in ends). True returns sum_k G_k in burn-in and
        K * sum_k W_k G_k afterwards, keeping the scale of the naive sum throughout.
      state_dtype: dtype of the EMA: float32, or bfloat16 (half the K x P memory), which is
        written with stochastic rounding (`stochastic_round_bfloat16`): rounded to nearest, an EMA
        with beta 0.999 stalls at a quarter of its value. Maths runs in float32.
      allow_zero_median: a task's median of 0 (more than half its sensitivities exactly 0) makes the
        weights a per-parameter argmax, which is not the paper's method; the trainer stops the run at
        the first such step (`TacoState.problems`) unless this is True, when it only warns. True
        reproduces a collapsed run on purpose (the `taco` row of docs/RESULTS.md).

    A step with non-finite gradients is not this transform's concern: the train step discards
    the whole optimiser state of such a step, so ``step`` counts applied updates only. The update
    computes with the Python values above; the state records the numeric ones (``hyperparams``).
    """
    _check_arguments(num_tasks, total_steps, burn_in_fraction, beta, tau, median, median_over, state_dtype)
    burn_in_steps = int(round(burn_in_fraction * total_steps))
    burn_in_scale, active_scale = _output_scales(num_tasks, keep_naive_scale)
    write_ema = _ema_writer(state_dtype)

    def recorded() -> dict[str, jax.Array]:
        return hyperparameter_arrays(beta=float(beta), burn_in_steps=burn_in_steps, median_samples=median_samples,
                                     median_seed=median_seed, tau=float(tau),
                                     zero_median_fatal=int(not allow_zero_median))

    def init_fn(params: Any) -> TacoState:
        ema = jax.tree_util.tree_map(
            lambda p: jnp.zeros((num_tasks,) + jnp.shape(p), state_dtype), params)
        return TacoState(step=jnp.zeros([], jnp.int32), ema=ema, active=jnp.zeros([], bool),
                         median=jnp.zeros([num_tasks], jnp.float32), zero_fraction=jnp.zeros([num_tasks], jnp.float32),
                         hyperparams=recorded())

    def update_fn(updates: Any, state: TacoState, params: Any = None) -> tuple[Any, TacoState]:
        if params is None:
            raise ValueError("taco needs the current params: call update(grads, state, params)")
        k = task_count(updates)
        if k != num_tasks:
            raise ValueError(f"taco was built for {num_tasks} tasks, got gradients with K={k}")
        grad_leaves, treedef = jax.tree_util.tree_flatten(updates)
        # jaxlib's PyTreeDef has no type stub: mypy does not know its methods.
        param_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
        ema_leaves = treedef.flatten_up_to(state.ema)  # type: ignore[attr-defined]

        # S_k = |theta * G_k| / (median_k + eps). |theta * G| is recomputed wherever it is needed
        # (XLA fuses it into each consumer) rather than materialised as a K x P array.
        sensitivity = [jnp.abs(p.astype(jnp.float32)[None] * g.astype(jnp.float32))
                       for g, p in zip(grad_leaves, param_leaves)]
        medians = _median(sensitivity, median, median_samples, median_seed, median_over)
        inv_median = 1.0 / (medians + MEDIAN_EPS)
        active = state.step >= burn_in_steps
        combined, new_ema = [], []
        for leaf, (g, p, e) in enumerate(zip(grad_leaves, param_leaves, ema_leaves)):
            ema, weighted_sum = _taco_leaf(g, p.astype(jnp.float32), e, inv_median, beta, tau)
            plain_sum = sum_tasks(g.astype(jnp.float32)) * burn_in_scale
            combined.append(jnp.where(active, weighted_sum * active_scale, plain_sum).astype(g.dtype))
            new_ema.append(write_ema(ema, state.step, leaf))
        return jax.tree_util.tree_unflatten(treedef, combined), TacoState(
            step=state.step + 1, ema=jax.tree_util.tree_unflatten(treedef, new_ema), active=active, median=medians,
            zero_fraction=zero_fraction(sensitivity), hyperparams=recorded())

    return optax.GradientTransformation(init_fn, update_fn)


def _taco_leaf(g: jax.Array, theta: jax.Array, ema: jax.Array, inv_median: jax.Array,
               beta: float, tau: float) -> tuple[jax.Array, jax.Array]:
    """One leaf of the TACO update: (new EMA [K, ...] in f32, sum_k softmax_k(ema / tau) * g_k).

    The EMA is one whole-leaf expression (updated in place when the state is donated); the
    softmax-weighted sum reads its task slices in one fused pass as sum_k e_k g_k / sum_k e_k
    with e_k = exp(z_k - max_k z_k): K exps per parameter and no other [K, ...] intermediate.
    On XLA:CPU this is ~5x faster than a stacked softmax with separate weights.
    """
    k = g.shape[0]
    per_task = (k,) + (1,) * (g.ndim - 1)
    new_ema = (beta * ema.astype(jnp.float32)
               + (1.0 - beta) * jnp.abs(theta[None] * g.astype(jnp.float32)) * inv_median.reshape(per_task))
    z = [new_ema[i] * (1.0 / tau) for i in range(k)]
    z_max = functools.reduce(jnp.maximum, z)
    e = [jnp.exp(z_i - z_max) for z_i in z]
    numerator = functools.reduce(jnp.add, [e_i * g[i].astype(jnp.float32) for i, e_i in enumerate(e)])
    return new_ema, numerator / functools.reduce(jnp.add, e)


def _check_arguments(num_tasks: int, total_steps: int, burn_in_fraction: float, beta: float, tau: float,
                     median: str, median_over: str, state_dtype: Any) -> None:
    if num_tasks < 1:
        raise ConfigError(f"taco: num_tasks must be >= 1, got {num_tasks}")
    if total_steps < 1:
        raise ConfigError(f"taco: total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= burn_in_fraction <= 1.0:
        raise ConfigError(f"taco: burn_in_fraction must be in [0, 1], got {burn_in_fraction}")
    if not 0.0 <= beta < 1.0:
        raise ConfigError(f"taco: beta must be in [0, 1), got {beta}")
    if tau == 0 or not np.isfinite(tau):
        raise ConfigError(f"taco: tau must be finite and nonzero (negative discourages specialisation), got {tau}")
    if median not in ("exact", "approx"):
        raise ConfigError(f"taco: median must be 'exact' or 'approx', got {median!r}")
    if median_over not in MEDIAN_OVER:
        raise ConfigError(f"taco: median_over must be one of {MEDIAN_OVER}, got {median_over!r}")
    if jnp.dtype(state_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ConfigError(f"taco: state_dtype must be float32 or bfloat16, got {jnp.dtype(state_dtype).name}")


# --------------------------------------------------------------------------------------------
# Additions to the paper (each defaults to the paper's behaviour).
# --------------------------------------------------------------------------------------------


def _median(sensitivity: list[jax.Array], mode: str, samples: int, seed: int, over: str) -> jax.Array:
    """The per-task global median: exact over all values as in the paper, or (additions) over a
    fixed sample of positions (``median="approx"``) or over nonzero values (``median_over``)."""
    return taco_global_median(sensitivity, mode, samples, seed, over)


def _output_scales(k: int, keep_naive_scale: bool) -> tuple[float, float]:
    """(burn-in scale, weighted scale): the paper's 1/K for both, or (addition) 1 and K, which
    keeps the naive sum's scale across the end of burn-in."""
    if keep_naive_scale:
        return 1.0, float(k)
    return 1.0 / k, 1.0 / k


def _ema_writer(state_dtype: Any) -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """(float32 EMA, step, leaf index) -> the stored EMA: as is in float32 (the paper), or
    (addition) stochastically rounded to bfloat16 with bits salted by step and leaf."""
    if jnp.dtype(state_dtype) == jnp.dtype(jnp.float32):
        return lambda ema, step, leaf: ema
    return lambda ema, step, leaf: stochastic_round_bfloat16(
        ema, step.astype(jnp.uint32) * np.uint32(0x27D4EB2F) + np.uint32(leaf))
