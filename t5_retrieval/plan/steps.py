"""The train step `t5r train` jits and the KB encode step of `t5r encode`, over abstract arrays.

Parameters, optimiser state and batches are `jax.ShapeDtypeStruct`s carrying their shardings
(from `jax.eval_shape`), so a T5-XXL plan allocates nothing. The batch's shapes come from the
mixture alone (its declared rates and query lengths), so no data directory is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5_retrieval import gin_utils, sharding
from t5_retrieval.data.batching.batches import task_query_lens
from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.mixing import sizes_from_rates
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.inference import ACCELERATOR_ENCODE_BATCH_PER_SHARD, DualEncoderInference
from t5_retrieval.multitask import multitask_metrics
from t5_retrieval.optim import make_optimizer
from t5_retrieval.train_step import GatheredPasses, TrainState, make_gradient_update, make_train_step, task_loss_fn


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """What of `train` and `make_train_iterator`'s gin bindings shapes the compiled step."""
    mixture: str | Sequence[str]
    query_len: int | Mapping[str, int] | None
    passage_len: int
    num_negatives: int
    per_device_batch: int
    multitask: Callable[..., optax.GradientTransformation] | None
    num_steps: int
    stop_passage_gradient: bool = False
    max_nonfinite_in_a_row: int = 10
    stored_passage_embeddings: bool = False
    task_module: str | Sequence[str] | None = None
    task_module_path: Sequence[str] = ()
    gather_params_once: bool = False


@dataclasses.dataclass(frozen=True)
class TaskShape:
    """A task of the planned step: its `TaskSpec` at the query length the step reads it at (as
    training records it), its per-device rows and the training examples its source declares."""
    spec: TaskSpec
    rows: int       # per data shard (the per-device sub-batch)
    train_examples: int | None  # what its source declares (None: not declared)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def query_len(self) -> int:
        return self.spec.query_input().length


def task_shapes(settings: TrainSettings) -> list[TaskShape]:
    """Each task's per-device sub-batch and query length, as `make_train_iterator` computes them."""
    gin_utils.import_modules(settings.task_module, settings.task_module_path)
    tasks_and_rates = retrieval_tasks.resolve(settings.mixture)
    infos = [retrieval_tasks.describe(task) for task, _ in tasks_and_rates]
    sizes = sizes_from_rates([rate for _, rate in tasks_and_rates], settings.per_device_batch)
    lengths = task_query_lens(infos, settings.query_len)
    declared = [task.num_input_examples("train") for task, _ in tasks_and_rates]
    return [TaskShape(dataclasses.replace(info, query_len=length), size, examples)
            for info, size, length, examples in zip(infos, sizes, lengths, declared)]


def abstract_batch(tasks: Sequence[TaskShape], settings: TrainSettings, data_shards: int, embedding_dim: int
                   ) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """The global batch of one step: per task, queries, 1 + num_negatives passages per query, task ids."""
    batch = {}
    for task in tasks:
        rows = task.rows * data_shards
        passages = rows * (1 + settings.num_negatives)
        passage = (jax.ShapeDtypeStruct((passages, embedding_dim), jnp.float32)
                   if settings.stored_passage_embeddings else jax.ShapeDtypeStruct((passages, settings.passage_len),
                                                                                   jnp.int32))
        batch[task.name] = {"query_tokens": jax.ShapeDtypeStruct((rows, task.query_len), jnp.int32),
                            "passage_embeddings" if settings.stored_passage_embeddings else "passage_tokens": passage,
                            "task_ids": jax.ShapeDtypeStruct((rows,), jnp.int32)}
    return batch


def with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_params(model: nn.Module, mesh: Mesh, rules: sharding.Rules) -> tuple[Any, Any]:
    """(params as ShapeDtypeStructs, their shardings): `models.build.init_params` without the init."""
    boxed = jax.eval_shape(lambda key: model.init({"params": key}, jnp.ones((1, 4), jnp.int32))["params"],
                           jax.random.PRNGKey(0))
    shardings = sharding.tree_shardings(mesh, rules, nn.get_partition_spec(boxed))
    return nn.unbox(boxed), shardings


@dataclasses.dataclass
class LoweredStep:
    lowered: jax.stages.Lowered
    state: Any             # the abstract arguments besides the batch (train: TrainState; encode: params)
    state_shardings: Any
    batch: Any
    batch_shardings: Any


@dataclasses.dataclass
class AbstractTraining:
    """What `train.train` builds before its first step, abstract: the optimiser and the state with
    its shardings (and how many objectives the optimiser's multi-task transform combines)."""
    optimizer: optax.GradientTransformationExtraArgs
    state: TrainState
    state_shardings: Any
    num_objectives: int


def abstract_training(model: nn.Module, settings: TrainSettings, num_tasks: int, mesh: Mesh,
                      rules: sharding.Rules) -> AbstractTraining:
    params, param_shardings = abstract_params(model, mesh, rules)
    num_objectives = 2 if model.config.query_generation else num_tasks
    optimizer = make_optimizer(total_steps=settings.num_steps, num_tasks=num_objectives,
                               multitask=settings.multitask)
    opt_shardings = sharding.opt_state_shardings(optimizer, params, param_shardings, mesh, rules)
    opt_state = jax.eval_shape(optimizer.init, params)
    state = jax.eval_shape(TrainState.create, params, opt_state, jax.random.PRNGKey(0))
    state_shardings = jax.tree.map(lambda _: sharding.replicated(mesh), state).replace(
        params=param_shardings, opt_state=opt_shardings)
    return AbstractTraining(optimizer, state, state_shardings, num_objectives)


def lower_train_step(model: nn.Module, config: dict[str, Any], settings: TrainSettings, task_names: Sequence[str],
                     batch: Any, mesh: Mesh, rules: sharding.Rules) -> tuple[LoweredStep, Any]:
    """The jitted step of `train.train` (same optimiser, shardings and donation), lowered for `mesh`.
    Also returns the multi-task transform's own abstract state and shardings (None without one)."""
    training = abstract_training(model, settings, len(task_names), mesh, rules)
    state, state_shardings = training.state, training.state_shardings
    replicated = sharding.replicated(mesh)
    step_fn = make_train_step(model, training.optimizer, task_names, per_task=settings.multitask is not None,
                              logit_scale=config["dual_encoder"]["logit_scale"],
                              extra_metrics=None if settings.multitask is None else multitask_metrics,
                              max_nonfinite_in_a_row=settings.max_nonfinite_in_a_row,
                              stop_passage_gradient=settings.stop_passage_gradient,
                              gathered_passes=GatheredPasses.of_model(config, state_shardings.params)
                              if settings.gather_params_once else None)
    batch_shardings = jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim), batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jitted = jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        lowered = jitted.lower(state, batch)
    multitask_state = None
    if settings.multitask is not None:
        transform = settings.multitask(num_tasks=training.num_objectives, total_steps=settings.num_steps)
        params, param_shardings = state.params, state_shardings.params
        multitask_state = (jax.eval_shape(transform.init, params),
                           sharding.opt_state_shardings(transform, params, param_shardings, mesh, rules))
    return LoweredStep(lowered, state, state_shardings, batch, batch_shardings), multitask_state


def lower_task_gradient(model: nn.Module, config: dict[str, Any], settings: TrainSettings, task_batch: Any,
                        task_index: int, mesh: Mesh, rules: sharding.Rules) -> jax.stages.Lowered:
    """One task's loss and gradient, the pass a per-task step (TACO) makes once per task, lowered
    alone with the train step's shardings (gradients sharded as the parameters; the parameters
    read whole with `gather_params_once`, whose gather is `lower_param_gather`)."""
    params, param_shardings = abstract_params(model, mesh, rules)
    loss_fn = task_loss_fn(model, config["dual_encoder"]["logit_scale"], settings.stop_passage_gradient)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    replicated = sharding.replicated(mesh)
    read, read_shardings, pass_rules = params, param_shardings, rules
    if settings.gather_params_once:  # as `make_train_step(gathered_passes=...)` runs its passes
        read = jax.eval_shape(GatheredPasses.of_model(config, param_shardings).read, params)
        read_shardings, pass_rules = jax.tree.map(lambda _: replicated, param_shardings), sharding.batch_only(rules)

    def task_pass(p: Any, b: Any, rng: jax.Array) -> Any:
        value, grad = grad_fn(p, b, rng, task_index)
        grad = jax.lax.with_sharding_constraint(grad, param_shardings)
        return value, jax.tree.map(lambda g, stored: g.astype(stored.dtype), grad, params)

    batch_shardings = jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim), task_batch)
    with jax.set_mesh(mesh), nn.logical_axis_rules(pass_rules):
        jitted = jax.jit(task_pass, in_shardings=(read_shardings, batch_shardings, replicated),
                         out_shardings=((replicated, replicated), param_shardings))
        return jitted.lower(read, task_batch, jax.ShapeDtypeStruct((2,), jnp.uint32))


def lower_param_gather(model: nn.Module, config: dict[str, Any], mesh: Mesh, rules: sharding.Rules
                       ) -> jax.stages.Lowered:
    """The parameters gathered whole onto every device, as the network reads them: what a per-task
    step with `gather_params_once` does once per step before its task passes."""
    params, param_shardings = abstract_params(model, mesh, rules)
    replicated = sharding.replicated(mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jax.jit(GatheredPasses.of_model(config, param_shardings).read, in_shardings=(param_shardings,),
                       out_shardings=jax.tree.map(lambda _: replicated, param_shardings)).lower(params)


def lower_gradient_update(model: nn.Module, settings: TrainSettings, num_tasks: int, mesh: Mesh,
                          rules: sharding.Rules) -> jax.stages.Lowered:
    """The rest of a per-task step, from the K stacked task gradients to the next state
    (`make_gradient_update`: the multi-task transform, AdamW, the finite check), lowered alone."""
    training = abstract_training(model, settings, num_tasks, mesh, rules)
    state, state_shardings = training.state, training.state_shardings
    replicated = sharding.replicated(mesh)
    tasks_axis = sharding.tasks_mesh_axis(rules)
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct((training.num_objectives, *p.shape), p.dtype), state.params)
    grad_shardings = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(tasks_axis, *s.spec)),
                                  state_shardings.params)
    losses = jax.ShapeDtypeStruct((training.num_objectives,), jnp.float32)
    apply = make_gradient_update(training.optimizer, multitask_metrics, settings.max_nonfinite_in_a_row)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jitted = jax.jit(lambda st, g, losses, rng: apply(st, g, losses, {}, rng),
                         in_shardings=(state_shardings, grad_shardings, replicated, replicated),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        return jitted.lower(state, grads, losses, jax.ShapeDtypeStruct((2,), jnp.uint32))


def encode_batch_rows(data_shards: int) -> int:
    """Passages per call of `t5r encode` on an accelerator (`inference.default_encode_batch`)."""
    return ACCELERATOR_ENCODE_BATCH_PER_SHARD * data_shards


def lower_encode_step(model: nn.Module, config: dict[str, Any], passage_len: int, mesh: Mesh,
                      rules: sharding.Rules) -> LoweredStep:
    """`DualEncoderInference`'s jitted embedding call (what `t5r encode` runs per device batch) over
    one full-width batch of KB passages, lowered for `mesh`."""
    params, param_shardings = abstract_params(model, mesh, rules)
    rows = encode_batch_rows(mesh.shape["data"])
    encoder = DualEncoderInference(model, params, config, "plan", mesh, batch_size=rows)
    tokens = jax.ShapeDtypeStruct((rows, passage_len), jnp.int32)
    tokens_sharding = sharding.batch_sharding(mesh, 2)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        lowered = encoder._embed.lower(with_shardings(params, param_shardings),
                                       jax.ShapeDtypeStruct(tokens.shape, tokens.dtype, sharding=tokens_sharding),
                                       None)
    return LoweredStep(lowered, params, param_shardings, tokens, tokens_sharding)
