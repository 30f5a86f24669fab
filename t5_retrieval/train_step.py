"""One training step over a multi-task batch: per-task losses, then one optimiser update.

A batch holds one sub-batch per task (dict keyed by task name). Each task's loss is the in-batch
softmax loss over that task's *global* sub-batch (its negatives come from every device, but never
from another task).

Two ways to get gradients, same losses:
- naive multi-task (no multi-task transform): all tasks' queries and passages go through the model
  in one pass of each stack, as groups of one shape each (the queries of each length, since tasks
  read their queries at their own lengths: `query_shape_groups`; the passages), the task losses are
  summed, and one backward pass gives the gradient of the sum. Few large matmuls instead of 2K
  small ones, and each layer's weights read once per step.
- per-task gradients (TACO, PCGrad, ...): tasks are processed one after another, so that only one
  task's activations are alive at a time: tasks with sub-batches of one shape by a `lax.scan` (one
  compiled backward pass for all of them), such groups chained by `optimization_barrier` (the
  next group's forward pass cannot start before the previous group's gradients exist); the K
  gradients are stacked on a leading task axis for the optimiser.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from t5_retrieval import sharding
from t5_retrieval.data.batching.batches import Batch
from t5_retrieval.errors import ConfigError
from t5_retrieval.losses import in_batch_softmax_loss, positive_rows, token_cross_entropy
from t5_retrieval.models.build import apply_params
from t5_retrieval.models.families import family_of

Params = Any


class GatheredPasses(NamedTuple):
    """How a per-task step's task passes read parameters gathered once per step
    (`train.gather_params_once`)."""
    shardings: Any  # the parameters' own shardings: each task's gradient is reduced back to them
    read: Callable[[Params], Params]  # the parameters as the network reads them (`ModelFamily.as_read`)

    @classmethod
    def of_model(cls, config: dict[str, Any], shardings: Any) -> GatheredPasses:
        """For the model `config` describes: its family's `as_read` copy."""
        return cls(shardings, functools.partial(family_of(config).as_read, config))


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data position.

    `skipped_steps` (total) and `nonfinite_in_a_row` (current streak) count steps whose loss or
    update was not finite (see `make_train_step`).
    """
    step: jax.Array
    params: Params
    opt_state: optax.OptState
    rng: jax.Array
    skipped_steps: jax.Array
    nonfinite_in_a_row: jax.Array

    @classmethod
    def create(cls, params: Params, opt_state: optax.OptState, rng: jax.Array) -> TrainState:
        """The state before the first step: step 0, nothing skipped (one buffer per counter, so
        the state can be donated)."""
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, rng=rng,
                   skipped_steps=jnp.zeros((), jnp.int32), nonfinite_in_a_row=jnp.zeros((), jnp.int32))


def query_tower(model: nn.Module, task_index: int) -> int | None:
    """The query encoder of a task: its own tower (per-task towers), the one separate query
    encoder, or None for the encoder shared with passages."""
    return model.config.query_tower(task_index)


def embed_groups(model: nn.Module, params: Params, groups: Sequence[jax.Array], rng: jax.Array,
                 tower: int | None = None) -> tuple[jax.Array, ...]:
    """Training-mode embeddings of each group of token ids, all in one pass of the model's stacks."""
    return cast(tuple[jax.Array, ...], model.apply({"params": params}, tuple(groups), deterministic=False,
                                                   rngs={"dropout": rng}, tower=tower, method="embed_groups"))


def passage_embeddings(model: nn.Module, params: Params, task_batch: dict[str, jax.Array], rng: jax.Array,
                       stop_gradient: bool) -> jax.Array:
    """The passage side of the loss: stored embeddings (a frozen passage encoder, so constants) when
    the batch carries them, else the model's embeddings of the passage tokens."""
    if "passage_embeddings" in task_batch:
        return task_batch["passage_embeddings"]
    passages = apply_params(model, params, task_batch["passage_tokens"], deterministic=False,
                           rngs={"dropout": rng})
    return jax.lax.stop_gradient(passages) if stop_gradient else passages


def query_and_passage_embeddings(model: nn.Module, params: Params, query_groups: Sequence[jax.Array],
                                 passage_batch: dict[str, jax.Array], rng: jax.Array, tower: int | None,
                                 stop_passage_gradient: bool) -> tuple[list[jax.Array], jax.Array]:
    """Embeddings of each group of queries (read by query tower `tower`) and of the passages.

    When one encoder reads both and the loss differentiates through the passages, the passages
    join the queries' pass (`embed_groups`): one pass of each stack instead of one per group.
    Stored passage embeddings, or passages whose gradient is stopped, are embedded apart, so the
    backward pass does not run through them.
    """
    if tower is None and "passage_tokens" in passage_batch and not stop_passage_gradient:
        *queries, passages = embed_groups(model, params, (*query_groups, passage_batch["passage_tokens"]), rng)
        return queries, passages
    query_rng, passage_rng = jax.random.split(rng)
    queries = list(embed_groups(model, params, query_groups, query_rng, tower))
    return queries, passage_embeddings(model, params, passage_batch, passage_rng, stop_passage_gradient)


def task_loss_fn(model: nn.Module, logit_scale: float, stop_passage_gradient: bool = False) -> Callable:
    """(params, task_batch, rng, task_index) -> (loss, metrics) for one task's sub-batch."""

    def loss_fn(params: Params, task_batch: dict[str, jax.Array], rng: jax.Array, task_index: int = 0):
        (queries,), passages = query_and_passage_embeddings(
            model, params, (task_batch["query_tokens"],), task_batch, rng, query_tower(model, task_index),
            stop_passage_gradient)
        return in_batch_softmax_loss(queries, passages, logit_scale, task_batch.get("query_groups"))

    return loss_fn


def task_groups(model: nn.Module, batch: Batch, task_names: Sequence[str]) -> list[list[int]]:
    """Tasks that can share one compiled forward/backward pass: same query tower and sub-batches of
    the same shapes and dtypes (equal mixture rates, or rates that round to the same size)."""
    groups: dict[tuple, list[int]] = {}
    for k, name in enumerate(task_names):
        arrays = tuple(sorted((key, x.shape, jnp.dtype(x.dtype).name) for key, x in batch[name].items()))
        groups.setdefault((query_tower(model, k), arrays), []).append(k)
    return list(groups.values())


def query_shape_groups(batch: Batch, task_names: Sequence[str]) -> list[list[str]]:
    """Tasks whose query sub-batches have one length (each task reads its queries at its own), in
    task order: the naive step encodes each group's queries in one model call."""
    groups: dict[int, list[str]] = {}
    for name in task_names:
        groups.setdefault(batch[name]["query_tokens"].shape[1], []).append(name)
    return list(groups.values())


def per_task_gradients(loss_fn: Callable, params: Params, batch: Batch, task_names: Sequence[str],
                       rng: jax.Array, groups: Sequence[Sequence[int]] | None = None,
                       gradient_shardings: Any = None) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """Each task's gradient, one task's activations alive at a time.

    ``groups`` (default: every task alone) lists tasks that `task_groups` found interchangeable:
    a group's sub-batches are stacked and its gradients computed by one `lax.scan`, so XLA
    compiles one forward/backward pass per group instead of one per task (compile time and
    program size grow with the number of distinct sub-batch shapes, not with K). Groups run one
    after another, chained by `optimization_barrier`; task i uses ``split(rng, K)[i]`` either way,
    so grouping does not change the result.

    ``gradient_shardings`` (a tree like ``params``): each task's gradient is reduced to these as soon
    as it exists (used when ``params`` were gathered whole for the passes).

    Returns (gradients stacked on a leading task axis in ``task_names`` order, losses [K], metrics).
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True, argnums=0)
    groups = [[k] for k in range(len(task_names))] if groups is None else [list(g) for g in groups]
    if sorted(k for g in groups for k in g) != list(range(len(task_names))):
        raise ValueError(f"groups {groups} must hold each of the {len(task_names)} task indices once")
    rngs = jax.random.split(rng, len(task_names))
    grads, losses, aux = [], [], []
    group_params = params
    for group in groups:
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *[batch[task_names[k]] for k in group])

        def task_gradient(_, xs, group_params=group_params, task_index=group[0]):
            task_batch, task_rng = xs
            (loss, task_aux), grad = grad_fn(group_params, task_batch, task_rng, task_index)
            if gradient_shardings is not None:
                grad = jax.lax.with_sharding_constraint(grad, gradient_shardings)
            return None, (grad, loss, task_aux)

        _, (grad, loss, group_aux) = jax.lax.scan(task_gradient, None, (stacked, rngs[jnp.asarray(group)]))
        # The next group reads params only after this group's gradients are complete.
        grad, group_params = jax.lax.optimization_barrier((grad, params))
        grads.append(grad)
        losses.append(loss)
        aux.append(group_aux)
    stacked_grads = jax.tree.map(lambda *g: jnp.concatenate(g), *grads)
    stacked_losses = jnp.concatenate(losses)
    stacked_aux = {key: jnp.concatenate([a[key] for a in aux]) for key in aux[0]}
    order = [k for g in groups for k in g]
    if order != sorted(order):  # groups interleave tasks: back to task order
        inverse = jnp.asarray([order.index(k) for k in range(len(task_names))])
        stacked_grads, stacked_losses, stacked_aux = jax.tree.map(lambda x: x[inverse],
                                                                  (stacked_grads, stacked_losses, stacked_aux))
    metrics = {}
    for k, name in enumerate(task_names):
        metrics[f"loss/{name}"] = stacked_losses[k]
        metrics.update({f"{key}/{name}": value[k] for key, value in stacked_aux.items()})
    return stacked_grads, stacked_losses, metrics


def summed_task_losses(model: nn.Module, logit_scale: float, batch: Batch, task_names: Sequence[str],
                       rng: jax.Array, stop_passage_gradient: bool = False) -> Callable:
    """params -> (sum of task losses, (losses [K], metrics)), every task's texts in one model call."""

    def total_loss(params: Params):
        key = "passage_embeddings" if "passage_embeddings" in batch[task_names[0]] else "passage_tokens"
        passages = {key: jnp.concatenate([batch[t][key] for t in task_names])}
        if model.config.query_towers:  # each task's queries through its own tower
            query_rng, passage_rng = jax.random.split(rng)
            query_emb = jnp.concatenate([
                apply_params(model, params, batch[t]["query_tokens"], deterministic=False,
                            rngs={"dropout": jax.random.fold_in(query_rng, k)}, tower=k)
                for k, t in enumerate(task_names)])
            passage_emb = passage_embeddings(model, params, passages, passage_rng, stop_passage_gradient)
        else:  # one group per query length (and the passages) in one pass, put back in task order
            shape_groups = query_shape_groups(batch, task_names)
            grouped, passage_emb = query_and_passage_embeddings(
                model, params, [jnp.concatenate([batch[t]["query_tokens"] for t in names]) for names in shape_groups],
                passages, rng, query_tower(model, 0), stop_passage_gradient)
            by_task: dict[str, jax.Array] = {}
            for names, embedded in zip(shape_groups, grouped, strict=True):
                rows = [batch[t]["query_tokens"].shape[0] for t in names]
                by_task.update(zip(names, jnp.split(embedded, list(itertools.accumulate(rows))[:-1])))
            query_emb = jnp.concatenate([by_task[t] for t in task_names])
        losses, metrics = [], {}
        q_start = p_start = 0
        for name in task_names:
            q_rows, p_rows = batch[name]["query_tokens"].shape[0], batch[name][key].shape[0]
            loss, aux = in_batch_softmax_loss(query_emb[q_start:q_start + q_rows],
                                              passage_emb[p_start:p_start + p_rows], logit_scale,
                                              batch[name].get("query_groups"))
            q_start, p_start = q_start + q_rows, p_start + p_rows
            losses.append(loss)
            metrics[f"loss/{name}"] = loss
            metrics.update({f"{key}/{name}": value for key, value in aux.items()})
        stacked = jnp.stack(losses)
        return jnp.sum(stacked), (stacked, metrics)

    return total_loss


def summed_gradient(model: nn.Module, logit_scale: float, params: Params, batch: Batch,
                    task_names: Sequence[str], rng: jax.Array, stop_passage_gradient: bool = False
                    ) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """Gradient of the sum of task losses. Returns (gradient, losses [K], metrics)."""
    total_loss = summed_task_losses(model, logit_scale, batch, task_names, rng, stop_passage_gradient)
    (_, (losses, metrics)), grad = jax.value_and_grad(total_loss, has_aux=True)(params)
    return grad, losses, metrics


def retrieval_and_generation_gradients(model: nn.Module, logit_scale: float, params: Params, batch: Batch,
                                       task_names: Sequence[str], rng: jax.Array,
                                       stop_passage_gradient: bool = False
                                       ) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """GDMTL: gradients of the retrieval loss (summed over tasks) and of the query-generation loss.

    The generation loss is the token cross-entropy of each query decoded (teacher forced) from its
    positive passage by the shared T5. One forward pass, two backward passes (vjp with each
    objective's cotangent). Returns (gradients stacked [2, ...], losses [2], metrics); a
    two-objective transform such as `multitask.uncertainty_weighting(num_tasks=2)` combines them.
    """
    retrieval_rng, generation_rng = jax.random.split(rng)
    retrieval_loss = summed_task_losses(model, logit_scale, batch, task_names, retrieval_rng, stop_passage_gradient)

    def objectives(params: Params):
        retrieval, (task_losses, metrics) = retrieval_loss(params)
        generation: list[jax.Array] = []
        for name in task_names:
            queries = jnp.asarray(batch[name]["query_tokens"])
            positives = positive_rows(jnp.asarray(batch[name]["passage_tokens"]), queries.shape[0])
            logits = apply_params(model, params, positives, queries, deterministic=False,
                                 rngs={"dropout": jax.random.fold_in(generation_rng, len(generation))},
                                 method=model.query_generation_logits)
            generation.append(token_cross_entropy(logits, queries))
            metrics[f"generation_loss/{name}"] = generation[-1]
        return jnp.stack([retrieval, sum(generation)]), metrics

    losses, vjp, metrics = jax.vjp(objectives, params, has_aux=True)
    grads = [vjp(jnp.zeros(2, losses.dtype).at[i].set(1.0))[0] for i in range(2)]
    metrics["retrieval_loss"], metrics["generation_loss"] = losses[0], losses[1]
    return jax.tree.map(lambda *g: jnp.stack(g), *grads), losses, metrics


def all_finite(*trees: Any) -> jax.Array:
    """True iff every value of every tree is finite: sum(x * 0) is 0 then and NaN otherwise (one
    float reduction per leaf, cheaper on XLA:CPU than and-reducing isfinite)."""
    leaves = [x for tree in trees for x in jax.tree.leaves(tree)]
    return jnp.asarray(sum(jnp.sum(x * 0, dtype=jnp.float32) for x in leaves) == 0)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """`on_true` where the scalar `pred` holds, else `on_false`, leaf by leaf. Selects rather than
    a `lax.cond`: they fuse into the update's pass, and donated buffers stay updated in place."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def make_gradient_update(optimizer: optax.GradientTransformationExtraArgs,
                         extra_metrics: Callable[[optax.OptState], dict[str, jax.Array]] | None = None,
                         max_nonfinite_in_a_row: int | None = None) -> Callable:
    """Returns apply(state, grads, losses, metrics, rng) -> (state, metrics): the second half of
    `make_train_step`, from the gradients to the next state (its non-finite handling described there).
    A function of its own so that `t5r plan` can compile it apart from the gradient passes."""

    def apply(state: TrainState, grads: Any, losses: jax.Array, metrics: dict[str, jax.Array], rng: jax.Array
              ) -> tuple[TrainState, dict[str, jax.Array]]:
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params, task_losses=losses)
        params = optax.apply_updates(state.params, updates)
        finite = all_finite(losses, updates)
        if max_nonfinite_in_a_row is not None:
            finite &= state.nonfinite_in_a_row < max_nonfinite_in_a_row  # frozen once the limit is hit
        in_a_row = jnp.where(finite, 0, state.nonfinite_in_a_row + 1)
        if max_nonfinite_in_a_row is not None:
            in_a_row = jnp.minimum(in_a_row, max_nonfinite_in_a_row)
        params, opt_state = select_tree(finite, (params, opt_state), (state.params, state.opt_state))
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng,
                               skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
                               nonfinite_in_a_row=in_a_row)
        metrics = {**metrics, "loss": jnp.sum(losses),
                   "update_norm": jnp.where(finite, optax.tree.norm(updates), 0.0),
                   "skipped": (~finite).astype(jnp.int32), "skipped_steps": new_state.skipped_steps,
                   "nonfinite_in_a_row": new_state.nonfinite_in_a_row}
        if extra_metrics is not None:
            metrics.update(extra_metrics(opt_state))
        return new_state, metrics

    return apply


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformationExtraArgs,
                    task_names: Sequence[str], per_task: bool, logit_scale: float = 1.0,
                    extra_metrics: Callable[[optax.OptState], dict[str, jax.Array]] | None = None,
                    max_nonfinite_in_a_row: int | None = None, stop_passage_gradient: bool = False,
                    gathered_passes: GatheredPasses | None = None) -> Callable:
    """Returns train_step(state, batch) -> (state, metrics), to be jitted with shardings by the caller.

    The optimiser receives the gradient of the summed task losses, or with ``per_task`` the K task
    gradients stacked on a leading axis; a model with ``query_generation`` (GDMTL) gives it the
    [retrieval, query generation] pair instead, so it needs a two-objective transform.

    ``stop_passage_gradient``: the in-batch loss treats passage embeddings as constants, so only
    the query side learns from it (the universal-DR thesis' stop-gradient loss; with a separate
    query encoder the passage encoder then gets no gradient at all).

    ``gathered_passes`` (per-task steps): the task passes read the parameters gathered whole onto
    every device, once per step, as the network reads them (`GatheredPasses.read`: cast to bfloat16
    under bfloat16 compute, except those it reads in float32), and each task's gradient is reduced
    back to the parameters' shardings and dtypes. Under a layout that shards parameters (FSDP)
    every pass otherwise gathers each layer's weights again, forward and backward: K times what
    the naive step gathers. Costs one copy of the parameters per device, in the dtypes read.

    A step whose losses or updates are not all finite is skipped (a non-finite gradient reaches
    the update through every transform, clipping and AdamW; checking the K x P per-task gradients
    themselves would cost a pass over them every step): parameters and the whole
    optimiser state (hence its step count and learning-rate schedule, and the multi-task
    transform's state: TACO's EMA and burn-in count never see a non-finite gradient) stay as they
    were, the batch is consumed and `step` advances. This is the one place where non-finite
    values are handled; the transforms themselves are pure. Metric ``skipped`` is 1 for such a
    step, ``skipped_steps`` and ``nonfinite_in_a_row`` report the state's counters. Once the streak
    reaches ``max_nonfinite_in_a_row`` the state freezes (every later step is skipped and the
    streak kept), so the caller, which reads the metrics only every few steps, can stop the run
    on the exact state where the limit was hit.
    """
    if gathered_passes is not None and (not per_task or model.config.query_generation):
        raise ConfigError("train.gather_params_once is for per-task steps (a train.multitask transform over the "
                          "tasks, not GDMTL's two objectives), whose task passes would each gather the weights; "
                          "the one pass of this step gathers them once anyway")
    if model.config.query_generation and not per_task:
        raise ConfigError("a model with query_generation (GDMTL) needs a multi-task transform over its two "
                          "objectives, e.g. train.multitask = @multitask.uncertainty_weighting")
    loss_fn = task_loss_fn(model, logit_scale, stop_passage_gradient)
    task_names = tuple(task_names)
    apply_gradients = make_gradient_update(optimizer, extra_metrics, max_nonfinite_in_a_row)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        rng, step_rng = jax.random.split(state.rng)
        if model.config.query_generation:
            grads, losses, metrics = retrieval_and_generation_gradients(
                model, logit_scale, state.params, batch, task_names, step_rng, stop_passage_gradient)
        elif per_task:
            params, rules = state.params, nn.get_logical_axis_rules()
            shardings = None
            if gathered_passes is not None:
                params = jax.lax.with_sharding_constraint(gathered_passes.read(params), PartitionSpec())  # every leaf
                rules, shardings = sharding.batch_only(rules), gathered_passes.shardings
            with nn.logical_axis_rules(rules):
                grads, losses, metrics = per_task_gradients(loss_fn, params, batch, task_names, step_rng,
                                                            task_groups(model, batch, task_names), shardings)
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)  # as stored
        else:
            grads, losses, metrics = summed_gradient(model, logit_scale, state.params, batch, task_names, step_rng,
                                                     stop_passage_gradient)
        return apply_gradients(state, grads, losses, metrics, rng)

    return train_step
