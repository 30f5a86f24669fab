"""The contract every multi-task transform keeps, checked for each of them the same way.

Per-task gradients (leaves [K, ...]) in, an ordinary gradient (the params' shapes and dtypes) out;
it chains with clipping and AdamW under jit; its state keeps its structure, shapes and dtypes across
updates; it is deterministic; a step the train step skips leaves its state as it was; and its state
gets shardings from `sharding.opt_state_shardings`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from t5_retrieval import multitask, sharding
from t5_retrieval.train_step import all_finite, select_tree

K = 3
# One bfloat16 leaf: the output must keep each leaf's dtype, not promote it.
PARAMS = {"dense": {"kernel": jnp.zeros((3, 4), jnp.float32), "bias": jnp.zeros((4,), jnp.float32)},
          "norm": jnp.zeros((2, 3), jnp.bfloat16)}

TRANSFORMS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "naive_sum": multitask.naive_sum,
    "taco": lambda: multitask.taco(num_tasks=K, burn_in_steps=1, beta=0.5),
    "taco_bf16_approx_nonzero": lambda: multitask.taco(num_tasks=K, burn_in_steps=0, beta=0.5, median="approx",
                                                       median_samples=8, median_over="nonzero",
                                                       keep_naive_scale=True, state_dtype=jnp.bfloat16),
    "pcgrad": lambda: multitask.pcgrad(seed=1),
    "cgd": lambda: multitask.cgd(num_tasks=K),
    "gradnorm": lambda: multitask.gradnorm(num_tasks=K),
    "uncertainty_weighting": lambda: multitask.uncertainty_weighting(num_tasks=K),
}
each_transform = pytest.mark.parametrize("name", sorted(TRANSFORMS))


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
    taco_state = multitask.find_taco_state(shardings)
    if taco_state is not None:
        ema_specs = jax.tree.map(lambda s: s.spec, taco_state.ema)
        assert ema_specs == {"dense": {"kernel": PartitionSpec(None, "data", None), "bias": PartitionSpec(None, None)},
                             "norm": PartitionSpec(None, None, "data")}, ema_specs
        assert taco_state.step.spec == PartitionSpec()
    state = jax.jit(tx.init, out_shardings=shardings)(PARAMS)
    for s, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(state)):
        assert isinstance(s, NamedSharding) and x.sharding.is_equivalent_to(s, x.ndim)
