"""TACO's task sensitivities of any trained model, measured without training it.

The specialisation analysis (TACO paper Fig. 2: the share of task-specific parameters of naive
multi-task training vs TACO) needs the same statistic for models that were not trained with TACO.
`probe_sensitivities` runs the `taco` transform itself on the per-task gradients of a few training
batches at the model's fixed parameters and discards its updates, so the EMA it returns is exactly
the state a TACO run would hold after those steps at those parameters; every model probed with the
same batches and beta is measured the same way.

It sits above `train_step` (whose per-task gradients and non-finite rule it reuses), not in
`multitask`, which the train step builds on.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
from tqdm import tqdm

from t5_retrieval import sharding
from t5_retrieval.multitask import ExportedState, exported_state, taco
from t5_retrieval.optim import freeze
from t5_retrieval.train_step import all_finite, per_task_gradients, select_tree, task_groups, task_loss_fn


def probe_sensitivities(model: nn.Module, params: Any, batches: Iterator[dict[str, dict[str, Any]]],
                        task_names: Sequence[str], num_batches: int, beta: float, logit_scale: float,
                        mesh: jax.sharding.Mesh, seed: int = 0, progress: bool = True,
                        frozen: Sequence[str] = ()) -> ExportedState:
    """The TACO EMA (``arrays``, leaves [K, *param.shape]) after `num_batches` batches at fixed
    `params`, with the hyperparameters of the TACO state that measured it (tau for the analysis).

    A batch with non-finite gradients leaves the state as it was, as the train step would.
    `frozen` (the run's `make_optimizer.frozen`) leaves those parameters out, as in training.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    transform = freeze(taco(num_tasks=len(task_names), total_steps=num_batches, burn_in_fraction=0.0, beta=beta,
                            median="approx"), frozen)
    loss_fn = task_loss_fn(model, logit_scale)

    @jax.jit
    def step(state, params, batch, rng):
        grads, _, _ = per_task_gradients(loss_fn, params, batch, task_names, rng,
                                         task_groups(model, batch, task_names))
        return select_tree(all_finite(grads), transform.update(grads, state, params)[1], state)

    rng = jax.random.PRNGKey(seed)
    with jax.set_mesh(mesh), nn.logical_axis_rules(sharding.logical_axis_rules()):
        state = jax.jit(transform.init)(params)
        for i in tqdm(range(num_batches), desc="sensitivity probe", disable=not progress, mininterval=5.0):
            state = step(state, params, next(batches), jax.random.fold_in(rng, i))
    return jax.device_get(exported_state(state))
