"""Multi-task gradient combiners (TACO and baselines) as optax transforms, plus TACO analysis.

Every transform receives *per-task* gradients — a pytree shaped like the params whose leaves
carry a leading task axis K — and returns one ordinary gradient pytree, so it composes like any
other optax transform::

    tx = optax.chain(taco(num_tasks=6, burn_in_steps=500), optax.clip_by_global_norm(1.0),
                     optax.adamw(5e-6))
    state = tx.init(params)                                    # ordinary params, no K axis
    grads, state = tx.update(per_task_grads, state, params)    # leaves [K, ...] in, [...] out

Transforms that learn from the per-task losses (CGD, GradNorm, uncertainty weighting) take them as
``update(..., task_losses=losses)`` with ``losses`` of shape [K]; they are
``optax.GradientTransformationExtraArgs`` so ``optax.chain`` forwards the keyword.

One module per algorithm (`naive`, `taco`, `pcgrad`, `cgd`, `gradnorm`, `uncertainty`), helpers
beside them (`task_axis`, `median`, `bf16`), and `state` to read or reset a chain's multi-task
state. The transforms are pure: skipping a step with non-finite values is the train step's job.
They know nothing of gin; they are registered here so that run files can configure them, e.g.
``multitask.taco.tau = 2.0`` or ``multitask.pcgrad.seed = 1``.
"""

import gin

from t5_retrieval.multitask.cgd import CGDState, cgd
from t5_retrieval.multitask.gradnorm import GradNormState, gradnorm
from t5_retrieval.multitask.naive import naive_sum
from t5_retrieval.multitask.pcgrad import PCGradState, pcgrad
from t5_retrieval.multitask.state import find_taco_state, multitask_metrics, reset_taco, taco_metrics
from t5_retrieval.multitask.taco import TacoState, taco
from t5_retrieval.multitask.uncertainty import UncertaintyState, uncertainty_weighting

for _fn in (taco, naive_sum, pcgrad, cgd, gradnorm, uncertainty_weighting):
    gin.external_configurable(_fn, module="multitask")
del _fn

__all__ = [
    "CGDState", "GradNormState", "PCGradState", "TacoState", "UncertaintyState", "cgd",
    "find_taco_state", "gradnorm", "multitask_metrics", "naive_sum", "pcgrad", "reset_taco",
    "taco", "taco_metrics", "uncertainty_weighting",
]
