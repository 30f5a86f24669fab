"""The contract every multi-task transform keeps, checked for each of them the same way.

It is built from the run-level `num_tasks` and `total_steps` alone (everything else has a default
or comes from gin), as `make_optimizer` builds it; per-task gradients (leaves [K, ...]) in, an
ordinary gradient (the params' shapes and dtypes) out; it chains with clipping and AdamW under jit;
its state keeps its structure, shapes and dtypes across updates; it is deterministic; a step the
train step skips leaves its state as it was; its state gets shardings from
`sharding.opt_state_shardings`; and a stateful one's state is a `multitask.MultitaskState` (its
hyperparameters saved in it, found by name; its metrics, exported arrays and reset) that the
trainer reads without knowing the algorithm. A new algorithm adds its case to TRANSFORMS.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from t5_retrieval import multitask, sharding
from t5_retrieval.optim import make_optimizer
from t5_retrieval.train_step import all_finite, select_tree

K = 3
TOTAL_STEPS = 10  # the run's length the factories are built for
# One bfloat16 leaf: the output must keep each leaf's dtype, not promote it.
PARAMS = {"dense": {"kernel": jnp.zeros((3, 4), jnp.float32), "bias": jnp.zeros((4,), jnp.float32)},
          "norm": jnp.zeros((2, 3), jnp.bfloat16)}

# Each case: the factory with what gin would bind (the run-level num_tasks and total_steps come later).
FACTORIES: dict[str, Callable[..., optax.GradientTransformation]] = {
    "naive_sum": multitask.naive_sum,
    "taco": functools.partial(multitask.taco, burn_in_fraction=0.1, beta=0.5),
    "taco_bf16_approx_nonzero": functools.partial(multitask.taco, burn_in_fraction=0.0, beta=0.5, median="approx",
                                                  median_samples=8, median_over="nonzero", keep_naive_scale=True,
                                                  state_dtype=jnp.bfloat16),
    "pcgrad": functools.partial(multitask.pcgrad, seed=1),
    "cgd": multitask.cgd,
    "gradnorm": multitask.gradnorm,
    "uncertainty_weighting": multitask.uncertainty_weighting,
}
TRANSFORMS: dict[str, Callable[[], optax.GradientTransformation]] = {
    name: functools.partial(factory, num_tasks=K, total_steps=TOTAL_STEPS) for name, factory in FACTORIES.items()}
STATELESS = {"naive_sum"}  # nothing to record, log or export
each_transform = pytest.mark.parametrize("name", sorted(TRANSFORMS))
each_stateful_transform = pytest.mark.parametrize("name", sorted(set(TRANSFORMS) - STATELESS))


def params(seed: int) -> Any:
    leaves, treedef = jax.tree.flatten(PARAMS)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return treedef.unflatten([jax.random.normal(key, x.shape).astype(x.dtype) for key, x in zip(keys, leaves)])


def task_grads(seed: int) -> Any:
    leaves, treedef = jax.tree.flatten(PARAMS)
    keys = jax.random.split(jax.random.PRNGKey(1000 + seed), len(leaves))
    return treedef.unflatten([jax.random.normal(key, (K,) + x.shape).astype(x.dtype) for key, x in zip(keys, leaves)])


def task_losses(seed: int) -> jax.Array:
    return 1.0 + jax.random.uniform(jax.random.PRNGKey(2000 + seed), (K,))


def shapes_and_dtypes(tree: Any) -> Any:
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype).name), tree)


def chained(name: str) -> optax.GradientTransformationExtraArgs:
    return optax.chain(TRANSFORMS[name](), optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.0))


def run(tx: optax.GradientTransformation, steps: int) -> tuple[list[Any], list[Any]]:
    """(outputs, states) of `steps` jitted updates from a fresh state, at moving params."""
    update = jax.jit(lambda g, s, p, losses: tx.update(g, s, p, task_losses=losses))
    state, outs, states = tx.init(params(0)), [], []
    for t in range(steps):
        out, state = update(task_grads(t), state, params(t), task_losses(t))
        outs.append(out)
        states.append(state)
    return outs, states


@each_transform
def test_output_is_an_ordinary_gradient_with_the_params_shapes_and_dtypes(name):
    tx = optax.with_extra_args_support(TRANSFORMS[name]())
    outs, _ = run(tx, steps=2)
    for t, out in enumerate(outs):
        assert jax.tree.structure(out) == jax.tree.structure(PARAMS), f"{name}: output tree differs from the params'"
        assert shapes_and_dtypes(out) == shapes_and_dtypes(PARAMS), (
            f"{name} step {t}: expected {shapes_and_dtypes(PARAMS)} (no task axis), got {shapes_and_dtypes(out)}")
        assert all_finite(out), f"{name} step {t}: non-finite output from finite gradients"


@each_transform
def test_state_keeps_its_structure_shapes_and_dtypes_across_updates(name):
    tx = optax.with_extra_args_support(TRANSFORMS[name]())
    initial = tx.init(params(0))
    _, states = run(tx, steps=3)
    for t, state in enumerate(states):
        assert jax.tree.structure(state) == jax.tree.structure(initial), f"{name}: state tree changed at step {t}"
        assert shapes_and_dtypes(state) == shapes_and_dtypes(initial), (
            f"{name} step {t}: state shapes/dtypes {shapes_and_dtypes(state)}, expected {shapes_and_dtypes(initial)}")


@each_transform
def test_chains_with_clip_and_adamw_under_jit_and_moves_the_params(name):
    tx = chained(name)

    @jax.jit
    def step(p, state, grads, losses):
        updates, state = tx.update(grads, state, p, task_losses=losses)
        return optax.apply_updates(p, updates), state

    p, state = params(0), tx.init(params(0))
    for t in range(3):
        p, state = step(p, state, task_grads(t), task_losses(t))
    assert shapes_and_dtypes(p) == shapes_and_dtypes(PARAMS), f"{name}: the chain changed the params' shapes"
    assert all_finite(p), f"{name}: non-finite params after 3 chained steps"
    moved = [not np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(params(0)))]
    assert all(moved), f"{name}: every parameter should move, moved: {moved}"


@each_transform
def test_is_deterministic(name):
    first_outs, first_states = run(chained(name), steps=2)
    second_outs, second_states = run(chained(name), steps=2)
    for a, b in zip(jax.tree.leaves((first_outs, first_states)), jax.tree.leaves((second_outs, second_states))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"{name}: two runs from the same inputs differ")


@each_transform
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_nonfinite_task_gradient_reaches_the_update_so_the_train_step_keeps_the_state(name, bad):
    """The train step skips a step when `all_finite(losses, updates)` fails and then keeps the
    whole optimiser state (`select_tree`); the transforms rely on that. One bad value in one task's
    gradient, with finite losses, must therefore make the chained update non-finite."""
    tx = chained(name)
    p = params(0)

    @jax.jit
    def train_step_rule(state, grads, losses):
        updates, new_state = tx.update(grads, state, p, task_losses=losses)
        finite = all_finite(losses, updates)
        return finite, select_tree(finite, new_state, state)

    _, state = train_step_rule(tx.init(p), task_grads(0), task_losses(0))
    grads = task_grads(1)
    grads["dense"]["kernel"] = grads["dense"]["kernel"].at[1, 2, 0].set(bad)
    finite, kept = train_step_rule(state, grads, task_losses(1))
    assert not bool(finite), f"{name}: a {bad} in task 1's gradient did not reach the update"
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(kept)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"{name}: skipped step changed the state at {jax.tree_util.keystr(path)}")


@each_transform
def test_opt_state_shardings_follow_the_params_with_a_leading_tasks_axis(name):
    """Per-parameter state leaves get the parameter's sharding ([K, ...] ones behind the 'tasks'
    axis, which the rules leave unsharded); everything else is replicated."""
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    rules = sharding.logical_axis_rules("fsdp")
    logical = {"dense": {"kernel": PartitionSpec("embed", "mlp"), "bias": PartitionSpec("mlp")},
               "norm": PartitionSpec(None, "embed")}
    param_shardings = sharding.tree_shardings(mesh, rules, logical)
    tx = chained(name)
    shardings = sharding.opt_state_shardings(tx, PARAMS, param_shardings, mesh, rules)
    abstract = jax.eval_shape(tx.init, PARAMS)
    assert jax.tree.structure(shardings) == jax.tree.structure(abstract), f"{name}: one sharding per state leaf"
    adam_mu = shardings[2][0].mu  # AdamW's first moment mirrors the params
    assert jax.tree.map(lambda s: s.spec, adam_mu) == jax.tree.map(lambda s: s.spec, param_shardings)
    taco_state = optax.tree_utils.tree_get(shardings, "TacoState")  # found by its NamedTuple's name
    if taco_state is not None:
        ema_specs = jax.tree.map(lambda s: s.spec, taco_state.ema)
        assert ema_specs == {"dense": {"kernel": PartitionSpec(None, "data", None), "bias": PartitionSpec(None, None)},
                             "norm": PartitionSpec(None, None, "data")}, ema_specs
        assert taco_state.step.spec == PartitionSpec()
    state = jax.jit(tx.init, out_shardings=shardings)(PARAMS)
    for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(state)):
        assert isinstance(s, NamedSharding) and x.sharding.is_equivalent_to(s, x.ndim)


@each_transform
def test_make_optimizer_builds_it_from_num_tasks_and_total_steps_alone(name):
    """What `train.multitask = @multitask.<name>` gives the trainer: a factory it calls with the run's
    number of tasks and steps only, then chains and updates like any other."""
    tx = make_optimizer(total_steps=TOTAL_STEPS, num_tasks=K, learning_rate=1e-2, multitask=FACTORIES[name])
    state = tx.init(params(0))
    updates, _ = jax.jit(lambda g, s, p, losses: tx.update(g, s, p, task_losses=losses))(
        task_grads(0), state, params(0), task_losses(0))
    assert shapes_and_dtypes(updates) == shapes_and_dtypes(PARAMS), f"{name}: built by make_optimizer, wrong output"


@each_stateful_transform
def test_its_state_is_one_multitask_state_the_trainer_reads_by_name(name):
    """The trainer finds the state in the chain by protocol, logs its metrics (scalars, every step)
    and statistics (scalars, at logging steps), and exports what it marks (leaves [K, ...])."""
    _, states = run(chained(name), steps=2)
    found = multitask.multitask_states(states[-1])
    assert len(found) == 1 and isinstance(found[0], multitask.MultitaskState), f"{name}: found {found}"
    scalars = {**multitask.multitask_metrics(states[-1]), **multitask.multitask_statistics(states[-1])}
    for metric, value in scalars.items():
        assert metric.count("/") >= 1 and jnp.shape(value) == (), f"{name}: {metric} = {value} is not a named scalar"
    exported = multitask.exported_state(states[-1])
    if exported is not None:
        for leaf in jax.tree.leaves(exported.arrays):
            assert leaf.shape[0] == K, f"{name}: an exported leaf of shape {leaf.shape} has no task axis of {K}"


@each_stateful_transform
def test_its_numeric_hyperparameters_are_saved_in_its_state_and_found_by_name(name):
    tx = chained(name)
    initial = tx.init(params(0))
    hyperparams = optax.tree_utils.tree_get(initial, "hyperparams")
    assert hyperparams and all(jnp.shape(v) == () for v in hyperparams.values()), f"{name}: {hyperparams}"
    _, states = run(tx, steps=2)
    for key, value in hyperparams.items():
        np.testing.assert_array_equal(optax.tree_utils.tree_get(states[-1], key), value,
                                      err_msg=f"{name}: hyperparameter {key} changed in the state across updates")
    if name.startswith("taco"):
        assert float(optax.tree_utils.tree_get(initial, "tau")) == 2.0, "taco's tau is found by name in the state"


@each_stateful_transform
def test_reset_starts_the_multitask_state_over_and_leaves_the_rest(name):
    tx = chained(name)
    initial = tx.init(params(0))
    _, states = run(tx, steps=2)
    reset = multitask.reset_multitask(states[-1])
    assert jax.tree.structure(reset) == jax.tree.structure(initial)
    for (path, got), want, kept in zip(jax.tree_util.tree_flatten_with_path(multitask.multitask_states(reset))[0],
                                       jax.tree.leaves(multitask.multitask_states(initial)),
                                       jax.tree.leaves(multitask.multitask_states(states[-1]))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=(
            f"{name}: reset state differs from a fresh init at {jax.tree_util.keystr(path)}"))
        assert got.dtype == kept.dtype
    for got, kept in zip(jax.tree.leaves(reset[1:]), jax.tree.leaves(states[-1][1:])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(kept),
                                      err_msg=f"{name}: reset must not touch clipping's or AdamW's state")
