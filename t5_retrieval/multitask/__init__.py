"""Multi-task gradient combiners (TACO and baselines) as optax transforms, plus TACO analysis.

The transforms themselves know nothing of gin; they are registered here so that run files can
configure them, e.g. ``multitask.taco.tau = 2.0`` or ``multitask.pcgrad.seed = 1``.
"""

import gin

from t5_retrieval.multitask.transforms import (
    CGDState,
    GradNormState,
    PCGradState,
    TacoState,
    UncertaintyState,
    cgd,
    find_taco_state,
    gradnorm,
    multitask_metrics,
    naive_sum,
    pcgrad,
    reset_taco,
    taco,
    taco_metrics,
    taco_state_sharding,
    uncertainty_weighting,
)

for _fn in (taco, naive_sum, pcgrad, cgd, gradnorm, uncertainty_weighting):
    gin.external_configurable(_fn, module="multitask")
del _fn

__all__ = [
    "CGDState", "GradNormState", "PCGradState", "TacoState", "UncertaintyState", "cgd",
    "find_taco_state", "gradnorm", "multitask_metrics", "naive_sum", "pcgrad", "reset_taco",
    "taco", "taco_metrics", "taco_state_sharding", "uncertainty_weighting",
]
