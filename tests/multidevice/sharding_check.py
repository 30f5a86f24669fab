"""Run with 8 forced CPU devices (by tests/test_sharding.py): prints a JSON report comparing one
sharded train step per layout with the same step on one device, and where parameters landed.

Every layout runs the naive path (all tasks in one model call); PER_TASK_LAYOUTS also run the
per-task path (one `lax.scan` over the tasks, K gradients summed by `multitask.naive_sum`), which
must give the same update as the 1-device naive step."""

import dataclasses
import json
import os
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), "needs 8 CPU devices"

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.experimental.pallas import tpu as pltpu

from t5_retrieval import multitask, sharding
from t5_retrieval.data.batching.random_batches import RandomBatches
from t5_retrieval.models.build import init_params
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.plan import hlo
from t5_retrieval.train_step import GatheredPasses, TrainState, make_train_step

CFG = T5Config(vocab_size=128, d_model=32, num_heads=4, d_kv=8, d_ff=64, num_encoder_layers=1,
               num_decoder_layers=1, dropout_rate=0.0)
TASKS = ["a", "b"]
LAYOUTS = {"data_parallel": 1, "fsdp": 1, "tensor_parallel": 2, "fsdp_tensor_parallel": 2}
# The per-task step across devices (in-batch negatives gathered inside the scan) on the plainest
# layout and on the one that shards everything; each costs a compile, so not on all four.
PER_TASK_LAYOUTS = ("data_parallel", "fsdp_tensor_parallel")
GATHERED_LAYOUT = "fsdp"  # the per-task step with `gathered_passes`, and without for its collectives
# The 'pallas_tpu_short' kernels (interpret mode) in a shard_map over the batch and the heads: on the
# layout that splits both, against the 1-device XLA step (its bias gradient summed across shards).
SHORT_ATTENTION_LAYOUT = "fsdp_tensor_parallel"
# SGD with lr 1: the step's parameter change is exactly minus the gradient, so comparing parameters
# after one step compares gradients (Adam's first step would be ~sign(g), hiding differences).
OPTIMIZER = optax.sgd(1.0, momentum=0.9)
PER_TASK_OPTIMIZER = optax.chain(multitask.naive_sum(num_tasks=len(TASKS), total_steps=1), OPTIMIZER)


def spec(x) -> list:
    """PartitionSpec as a list without trailing Nones (P() and P(None, None) are the same layout)."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return entries


def batch_for(data_devices: int) -> dict:
    # The global batch is the same for every mesh: 8 queries per task.
    return next(RandomBatches(per_device_batch=16 // data_devices, local_data_devices=data_devices,
                              task_names=TASKS, vocab_size=128, query_len=8, passage_len=12, num_negatives=1))


# Initial parameters per (mesh, layout, model): a layout's steps (naive, per-task, gathered) start
# from the one initialisation instead of each tracing and loading the initialiser again (the steps
# never donate them). Each layout and model still initialises into its own shardings once.
_INITIALISED: dict = {}


def initialised(mesh, rules, model):
    """`init_params(model, PRNGKey(0), mesh, rules)`, once per (mesh, rules, model)."""
    key = (mesh, id(rules), id(model))
    if key not in _INITIALISED:
        _INITIALISED[key] = (init_params(model, jax.random.PRNGKey(0), mesh, rules), rules, model)
    return _INITIALISED[key][0]


def step_on(mesh, rules, model, per_task: bool = False, gathered: bool = False):
    """One train step on `mesh`; with `gathered`, a per-task step that gathers the parameters once."""
    optimizer = PER_TASK_OPTIMIZER if per_task else OPTIMIZER
    params, param_shardings = initialised(mesh, rules, model)
    opt_shardings = sharding.opt_state_shardings(optimizer, params, param_shardings, mesh, rules)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    replicated = sharding.replicated(mesh)
    state = TrainState.create(params, opt_state, jax.random.PRNGKey(1))
    shardings = jax.tree.map(lambda _: replicated, state).replace(params=param_shardings, opt_state=opt_shardings)
    state = jax.device_put(state, shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        batch = sharding.global_batch(mesh, batch_for(mesh.shape["data"]))
        config = {"t5": dataclasses.asdict(model.t5_config)}  # what GatheredPasses reads of it
        gathered_passes = GatheredPasses.of_model(config, param_shardings) if gathered else None
        step = jax.jit(make_train_step(model, optimizer, TASKS, per_task=per_task, gathered_passes=gathered_passes),
                       in_shardings=(shardings, jax.tree.map(lambda x: x.sharding, batch)),
                       out_shardings=(shardings, replicated))
        all_gathers = hlo.collectives(step.lower(state, batch).compile().as_text()).get("all-gather", {})
        new_state, metrics = step(state, batch)
    return params, batch, new_state, metrics, all_gathers


def run_layout(layout: str, model_parallelism: int, reference: tuple) -> dict:
    model = DualEncoder(CFG)
    mesh = sharding.make_mesh(model_parallelism)
    params, batch, new_state, metrics, _ = step_on(mesh, sharding.LAYOUTS[layout], model)
    ref_params, ref_metrics = reference

    def max_diff(tree) -> float:
        return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(ref_params)))

    per_task = {}
    if layout in PER_TASK_LAYOUTS:
        _, _, per_task_state, per_task_metrics, _ = step_on(mesh, sharding.LAYOUTS[layout], model, per_task=True)
        per_task = {"per_task_losses": [float(per_task_metrics[f"loss/{t}"]) for t in TASKS],
                    "per_task_param_max_abs_diff_after_step": max_diff(per_task_state.params)}
    if layout == GATHERED_LAYOUT:  # the per-task step with and without gathering the parameters once
        _, _, plain_state, _, plain_gathers = step_on(mesh, sharding.LAYOUTS[layout], model, per_task=True)
        _, _, gathered_state, gathered_metrics, gathers = step_on(mesh, sharding.LAYOUTS[layout], model,
                                                                  per_task=True, gathered=True)
        # bfloat16 compute: the passes read a bfloat16 copy (all but the norm scales and position biases)
        bf16 = DualEncoder(dataclasses.replace(CFG, dtype="bfloat16"))
        _, _, bf16_plain, bf16_plain_metrics, _ = step_on(mesh, sharding.LAYOUTS[layout], bf16, per_task=True)
        _, _, bf16_gathered, bf16_metrics, _ = step_on(mesh, sharding.LAYOUTS[layout], bf16, per_task=True,
                                                       gathered=True)
        per_task = {"gathered_losses": [float(gathered_metrics[f"loss/{t}"]) for t in TASKS],
                    "gathered_param_max_abs_diff_after_step": max_diff(gathered_state.params),
                    "gathered_sharding_kept": all(spec(a) == spec(b) for a, b in zip(
                        jax.tree.leaves(plain_state.params), jax.tree.leaves(gathered_state.params))),
                    "gathered_dtypes_kept": [str(a.dtype) for a in jax.tree.leaves(bf16_gathered.params)]
                    == [str(a.dtype) for a in jax.tree.leaves(bf16_plain.params)],
                    "bf16_losses": {"per_pass": [float(bf16_plain_metrics[f"loss/{t}"]) for t in TASKS],
                                    "once": [float(bf16_metrics[f"loss/{t}"]) for t in TASKS]},
                    "bf16_gathered_vs_per_pass_max_abs_diff": max(
                        float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                        for a, b in zip(jax.tree.leaves(bf16_gathered.params), jax.tree.leaves(bf16_plain.params))),
                    "all_gathers": {"per_pass": plain_gathers.get("count", 0), "once": gathers.get("count", 0)}}

    if layout == SHORT_ATTENTION_LAYOUT:
        with pltpu.force_tpu_interpret_mode(True):
            short = DualEncoder(dataclasses.replace(CFG, attention="pallas_tpu_short"))
            _, _, short_state, short_metrics, _ = step_on(mesh, sharding.LAYOUTS[layout], short)
        per_task["short_attention_losses"] = [float(short_metrics[f"loss/{t}"]) for t in TASKS]
        per_task["short_attention_param_max_abs_diff_after_step"] = max_diff(short_state.params)

    t5 = params["t5"]
    kernel = ("t5", "encoder", "layers_0", "mlp", "wi_0", "kernel")

    def at(tree, path):
        for key in path:
            tree = tree[key]
        return tree

    return {
        "losses": [float(metrics[f"loss/{t}"]) for t in TASKS],
        "ref_losses": [float(ref_metrics[f"loss/{t}"]) for t in TASKS],
        "param_max_abs_diff_after_step": max_diff(new_state.params),
        **per_task,
        "param_sharding_kept": all(spec(a) == spec(b) for a, b in zip(jax.tree.leaves(params),
                                                                         jax.tree.leaves(new_state.params))),
        "momentum_spec": spec(at(new_state.opt_state[0].trace, kernel)),
        "specs": {
            "embedding": spec(t5["token_embedder"]["embedding"]),
            "wi_0": spec(t5["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]),
            "query": spec(t5["encoder"]["layers_0"]["attention"]["query"]),
            "batch": spec(batch["a"]["passage_tokens"]),
        },
    }


def main() -> None:
    assert jax.device_count() == 8
    one_device = sharding.make_mesh(devices=jax.devices()[:1])
    _, _, ref_state, ref_metrics, _ = step_on(one_device, sharding.LAYOUTS["data_parallel"], DualEncoder(CFG))
    reference = (jax.device_get(ref_state.params), jax.device_get(ref_metrics))
    report = {name: run_layout(name, mp, reference) for name, mp in LAYOUTS.items()}
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
