"""Multi-task gradient combiners (TACO and baselines) as optax transforms, plus TACO analysis.

Every transform receives *per-task* gradients — a pytree shaped like the params whose leaves
carry a leading task axis K — and returns one ordinary gradient pytree, so it composes like any
other optax transform::

    tx = optax.chain(taco(num_tasks=6, total_steps=5000), optax.clip_by_global_norm(1.0),
                     optax.adamw(5e-6))
    state = tx.init(params)                                    # ordinary params, no K axis
    grads, state = tx.update(per_task_grads, state, params)    # leaves [K, ...] in, [...] out

Every factory takes the two run-level arguments ``num_tasks`` (K) and ``total_steps`` (the run's
or episode's optimiser steps), which `optim.make_optimizer` passes; the rest comes from gin, under
``multitask.<factory>`` (each module registers its factory: ``multitask.taco.tau = 2.0``,
``multitask.pcgrad.seed = 1``). Transforms that learn from the per-task losses (CGD, GradNorm,
uncertainty weighting) take them as ``update(..., task_losses=losses)`` with ``losses`` of shape
[K]; they are ``optax.GradientTransformationExtraArgs`` so ``optax.chain`` forwards the keyword.

One module per algorithm, imported below on one line each; helpers beside them (`task_axis`,
`median`, `bf16`), and `state`: the `MultitaskState` protocol every stateful transform's state
keeps (hyperparameters, metrics, exported arrays, reset), by which the trainer reads any of them.
The transforms are pure: skipping a step with non-finite values is the train step's job.
"""

# One line per algorithm (importing its module registers its factory with gin).
from t5_retrieval.multitask.cgd import CGDState, cgd
from t5_retrieval.multitask.gradnorm import GradNormState, gradnorm
from t5_retrieval.multitask.naive import naive_sum
from t5_retrieval.multitask.pcgrad import PCGradState, pcgrad
from t5_retrieval.multitask.state import (
    ExportedState,
    MultitaskProblem,
    MultitaskState,
    exported_state,
    multitask_metrics,
    multitask_problems,
    multitask_states,
    multitask_statistics,
    reset_multitask,
)
from t5_retrieval.multitask.taco import TacoState, taco
from t5_retrieval.multitask.uncertainty import UncertaintyState, uncertainty_weighting

__all__ = [
    "CGDState", "ExportedState", "GradNormState", "MultitaskProblem", "MultitaskState", "PCGradState", "TacoState",
    "UncertaintyState", "cgd", "exported_state", "gradnorm", "multitask_metrics", "multitask_problems",
    "multitask_states", "multitask_statistics", "naive_sum", "pcgrad", "reset_multitask", "taco",
    "uncertainty_weighting",
]
