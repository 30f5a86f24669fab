"""`t5r train`: the training program, top to bottom.

mesh -> data -> model + sharded init -> optimiser -> restore -> jitted step -> loop (log, checkpoint).

    t5r train --model_dir=/tmp/run --gin_file=models/t5_base.gin --gin_file=runs/taco.gin \
        --gin.DATA_DIR="'/data/kilt'" --gin.VOCABULARY="'/models/t5/spiece.model'" --gin.TRAIN_STEPS=20000
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Protocol

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm import tqdm

import t5_retrieval.tasks  # noqa: F401  (registers the KILT, mini-KILT and demo tasks and mixtures)
from t5_retrieval import checkpoint, gin_utils, logs, sharding
from t5_retrieval.errors import UserError, check_writable_dir
from t5_retrieval.data import batches as _batches, random_batches as _random_batches  # noqa: F401 (gin)
from t5_retrieval.data.records import write_text_atomic
from t5_retrieval.inference import load_encoder, write_base_record
from t5_retrieval.models.build import build_model, init_params, initial_params, model_config, upgraded_config
from t5_retrieval.multitask import find_taco_state, multitask_metrics, taco_metrics
from t5_retrieval.multitask.analysis import save_state_npz
from t5_retrieval.optim import make_optimizer
from t5_retrieval.train_step import TrainState, make_train_step, query_shape_groups, task_groups

log = logging.getLogger(__name__)
# On CPU, more than ~50 dispatched steps with collectives can deadlock; never run further ahead.
MAX_STEPS_IN_FLIGHT = 20
TACO_STATE_FILE = "taco_state.npz"
OPERATIVE_CONFIG = "config.gin"  # the gin bindings the run used (t5x's name)


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "t5_retrieval", "xla")


def use_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` unless one is configured already
    (JAX_COMPILATION_CACHE_DIR, or a caller's `jax.config`)."""
    if directory and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory)
        log.info("compilation cache: %s", directory)


def _count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


class BatchIterator(Protocol):
    """What the trainer needs from the data pipeline (see t5_retrieval.data.batches)."""

    task_names: list[str]
    features: dict[str, Any]  # vocabulary, lengths, task prefixes: recorded for inference

    def __next__(self) -> dict[str, dict[str, np.ndarray]]: ...
    def state(self) -> dict[str, Any]: ...
    def restore(self, state: dict[str, Any]) -> None: ...




class MetricsLog:
    """Scalars to TensorBoard (`<model_dir>/tb`) and to `<model_dir>/metrics.jsonl` (process 0 only).

    A run resumed at `start_step` first drops what the interrupted run logged after that step (it
    is logged again), so both hold one row per step however often the run was restarted.
    """

    def __init__(self, directory: str, start_step: int):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            from tensorboardX import SummaryWriter
            self.tb = SummaryWriter(os.path.join(directory, "tb"), purge_step=start_step + 1)
            path = os.path.join(directory, "metrics.jsonl")
            if os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start_step]
                write_text_atomic(path, "".join(kept))
            self.jsonl = open(path, "a")

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        for name, value in scalars.items():
            self.tb.add_scalar(name, value, step)
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.enabled:
            self.tb.close()
            self.jsonl.close()


@gin.configurable(denylist=["model_dir", "data_overrides", "command_line"])
def train(model_dir: str,
          batches: Callable[..., BatchIterator] = gin.REQUIRED,
          num_steps: int | None = None,
          num_epochs: float | None = None,
          per_device_batch: int = 8,
          seed: int = 0,
          log_every: int = 10,
          checkpoint_every: int = 500,
          keep_checkpoints: int = 3,
          multitask: Callable[..., optax.GradientTransformation] | None = None,
          init_from: str | None = None,
          data_overrides: dict[str, Any] | None = None,
          max_nonfinite_in_a_row: int = 10,
          stop_passage_gradient: bool = False,
          compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE,
          command_line: bool = False,
          ) -> TrainState:
    """Trains (or resumes) a dual encoder in `model_dir`; returns the final state.

    Args:
      batches: factory of the multi-task batch iterator, called with per_device_batch,
        local_data_devices, host_index, host_count and seed (gin: `@make_train_iterator`).
      num_steps / num_epochs: the run's length (exactly one), in optimiser steps or in epochs of
        the largest task; the learning-rate schedule and TACO's burn-in are fractions of it.
      per_device_batch: queries per device per step, split over the tasks by the mixture rates.
      multitask: factory of a multi-task gradient transform (gin: `@multitask.taco`, `@multitask.pcgrad`,
        ...); None sums the task losses (naive multi-task). Its statistics (e.g. whether TACO's
        weighting is active, the mean task entropy) are logged with the other metrics.
      init_from: start from these weights instead of a random init: a t5r model directory (its
        latest checkpoint; a fresh optimiser, as between ANCE episodes) or a Hugging Face T5 or
        BERT directory (config.json + safetensors; gin `@minilm_l6_dir()` for the installed
        MiniLM). Ignored when model_dir already has a checkpoint.
      data_overrides: extra arguments for `batches` (e.g. the negatives of an ANCE episode).
      max_nonfinite_in_a_row: a step with a non-finite loss, gradient or update is skipped (params
        and optimiser state unchanged, counted as `skipped_steps`); this many in a row stop the
        run with `NonFiniteError` (the last checkpoint stays the latest good state).
      stop_passage_gradient: only the query side learns from the loss (passage embeddings are
        constants in it); with `separate_query_encoder` the passage encoder stays as initialised.
      compilation_cache_dir: JAX's persistent compilation cache, so that a restarted run does not
        compile its step again; None turns it off. Left alone when JAX already has one configured.
      command_line: run as `t5r train`: a `--gin.configurable.param` binding of a configurable the
        run never called is an error, before the first step.

    The operative gin config (every binding the run used) is written to `<model_dir>/config.gin`;
    `t5r train --gin_file=<model_dir>/config.gin --model_dir=<model_dir>` runs it again.
    """
    use_compilation_cache(compilation_cache_dir)
    mesh = sharding.make_mesh()
    rules = sharding.logical_axis_rules()
    data = batches(per_device_batch=per_device_batch, local_data_devices=sharding.local_data_devices(mesh),
                   host_index=jax.process_index(), host_count=jax.process_count(), seed=seed,
                   **(data_overrides or {}))
    task_names = list(data.task_names)
    if max_nonfinite_in_a_row < 1:
        raise ValueError(f"train.max_nonfinite_in_a_row must be >= 1, got {max_nonfinite_in_a_row}")
    if (num_steps is None) == (num_epochs is None):
        raise ValueError(f"train: set exactly one of num_steps ({num_steps}) and num_epochs ({num_epochs})")
    num_steps = num_steps or max(1, int(round(num_epochs * data.steps_per_epoch)))
    config = {**model_config(), "features": data.features}
    towers = config["dual_encoder"]["query_towers"]
    if towers and towers != len(task_names):
        raise ValueError(f"DualEncoderConfig.query_towers={towers} but the mixture has {len(task_names)} tasks "
                         f"({', '.join(task_names)}); set one query tower per task")
    checkpoint.write_config(model_dir, config, upgrade=lambda stored: upgraded_config(stored, config))
    if "passage_embeddings" in data.features:
        record_passage_base(model_dir, init_from, data.features["passage_embeddings"], config)

    model = build_model(config)
    params_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
    params, param_shardings = init_params(model, params_rng, mesh, rules)
    log.info("model %s: %s dual encoder, %s parameters; %d device(s) (%s) on %d process(es), mesh %s; "
             "tasks %s", model_dir, config.get("family", "t5").upper(), f"{_count(params):,}", jax.device_count(),
             jax.devices()[0].platform, jax.process_count(), dict(mesh.shape), ", ".join(task_names))
    if init_from:
        params = jax.device_put(initial_params(init_from, params, config), param_shardings)
    # GDMTL's transform combines two objectives (retrieval, query generation), others the tasks.
    num_objectives = 2 if model.config.query_generation else len(task_names)
    optimizer = make_optimizer(total_steps=num_steps, num_tasks=num_objectives, multitask=multitask)
    opt_shardings = sharding.opt_state_shardings(optimizer, params, param_shardings, mesh, rules)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    replicated = sharding.replicated(mesh)
    state = TrainState.create(params, opt_state, train_rng)
    state_shardings = jax.tree.map(lambda _: replicated, state).replace(params=param_shardings,
                                                                        opt_state=opt_shardings)
    state = jax.device_put(state, state_shardings)

    mngr = checkpoint.manager(model_dir, max_to_keep=keep_checkpoints, writer=True)
    restored = restore_train_state(mngr, state)
    if restored is not None:
        state, data_state = restored
        data.restore(data_state)
        log.info("resumed %s at step %d", model_dir, int(state.step))
        if int(state.step) >= num_steps:
            return state

    step_fn = make_train_step(model, optimizer, task_names, per_task=multitask is not None,
                              logit_scale=config["dual_encoder"]["logit_scale"],
                              extra_metrics=None if multitask is None else multitask_metrics,
                              max_nonfinite_in_a_row=max_nonfinite_in_a_row,
                              stop_passage_gradient=stop_passage_gradient)
    unread = gin_utils.unread_bindings() if command_line else []
    if unread:
        raise UserError(f"--gin.{unread[0]}: this run never uses {unread[0].rpartition('.')[0]}, so the value "
                        "would be ignored; check the name or the gin files")
    if jax.process_index() == 0:
        write_text_atomic(os.path.join(model_dir, OPERATIVE_CONFIG), gin.operative_config_str())
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        first = next(data)
        log_query_passes(model, first, task_names, per_task=multitask is not None)
        batch_shardings = jax.tree.map(lambda x: sharding.batch_sharding(mesh, np.ndim(x)), first)
        jitted = jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        state = _loop(jitted, state, data, first, mesh, mngr, model_dir, num_steps, log_every, checkpoint_every,
                      max_nonfinite_in_a_row)
    log.info("finished %s at step %d (%d step(s) skipped as non-finite)", model_dir, int(state.step),
             int(state.skipped_steps))
    export_taco_state(state.opt_state, task_names, model_dir)
    return state


def log_query_passes(model: nn.Module, batch: dict[str, dict[str, np.ndarray]], task_names: list[str],
                     per_task: bool) -> None:
    """Logs each task's query length and the query passes the step compiles, one per sub-batch shape
    (per-task gradients: one `lax.scan` body per group of same-shaped tasks; naive: one model call
    per query length, or per task with per-task towers)."""
    if per_task:
        groups = [[task_names[k] for k in group] for group in task_groups(model, batch, task_names)]
    elif model.config.query_towers:
        groups = [[name] for name in task_names]
    else:
        groups = query_shape_groups(batch, task_names)
    log.info("query lengths: %s; the step compiles %d query pass(es), one per shape: %s",
             ", ".join(f"{name} {batch[name]['query_tokens'].shape[1]}" for name in task_names), len(groups),
             "; ".join("[" + ", ".join(group) + "]" for group in groups))


def record_passage_base(model_dir: str, init_from: str | None, table: dict[str, str], config: dict[str, Any]) -> None:
    """Training over stored passage embeddings only makes sense from the model that wrote them:
    checks that `init_from` is it, and marks `model_dir` as a query-side model over that base (so
    encode/index/eval/serve embed passages with the base and accept the base's indexes)."""
    if config["dual_encoder"].get("query_generation"):
        raise ValueError("make_train_iterator.passage_embeddings: GDMTL's query generation needs passage tokens")
    if not init_from or not os.path.exists(os.path.join(init_from, checkpoint.CONFIG_FILE)):
        raise ValueError(f"make_train_iterator.passage_embeddings={table['directory']!r} needs train.init_from to be "
                         f"the t5r model directory that wrote them (got {init_from!r})")
    base = load_encoder(init_from)
    if base.fingerprint != table["fingerprint"]:
        raise ValueError(f"{table['directory']}: written by the model with fingerprint {table['fingerprint']!r}, but "
                         f"train.init_from={init_from!r} has fingerprint {base.fingerprint!r}")
    if jax.process_index() == 0:
        write_base_record(model_dir, init_from, base.fingerprint, trained_by="t5r train",
                                     passage_embeddings=table["directory"])


def export_taco_state(opt_state: Any, task_names: list[str], model_dir: str) -> None:
    """Writes the final TACO EMA as `taco_state.npz` for `t5r analyze` (when the run used TACO)."""
    taco_state = find_taco_state(opt_state)
    if taco_state is None:
        return
    ema = multihost_utils.process_allgather(taco_state.ema, tiled=True)
    if jax.process_index() == 0:
        save_state_npz(ema, task_names, os.path.join(model_dir, TACO_STATE_FILE))


def restore_train_state(mngr: Any, like: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
    """(state, data position) from the newest readable checkpoint into `like`'s shardings, or None.

    A checkpoint whose non-finite step counters were saved as None (orbax restores them as None)
    resumes with zero counts. (One written by the four-field TrainState from before the counters
    existed has no such entries and does not restore into this layout.)
    """
    restored = checkpoint.restore(mngr, checkpoint.abstract_like(like))
    if restored is None:
        return None
    state, data_state = restored
    if state.skipped_steps is None or state.nonfinite_in_a_row is None:
        log.info("%s: checkpoint without non-finite step counts; counting from 0", mngr.directory)
        state = state.replace(skipped_steps=like.skipped_steps, nonfinite_in_a_row=like.nonfinite_in_a_row)
    return state, data_state


class NonFiniteError(FloatingPointError):
    """Too many consecutive training steps had a non-finite loss or gradient."""


def _check_finite_streak(state: TrainState, step: int, limit: int, model_dir: str, mngr: Any) -> None:
    """Stops the run once the step has frozen the state on reaching `limit` non-finite steps in a row."""
    in_a_row = int(state.nonfinite_in_a_row)
    if in_a_row >= limit:
        raise NonFiniteError(
            f"{model_dir}: {limit} consecutive training steps had a non-finite loss or gradient "
            f"(train.max_nonfinite_in_a_row = {limit}; {int(state.skipped_steps)} skipped in total, "
            f"noticed at step {step}); parameters are those before the streak, the latest checkpoint is "
            f"step {mngr.latest_step()}. Lower the learning rate, check the data, or resume from there.")


class Preempted(SystemExit):
    """The run was asked to stop (SIGTERM) and saved a checkpoint first. Exits with 128 + SIGTERM,
    like a process killed by it, so schedulers treat it as preempted (SLURM --requeue restarts it)."""

    def __init__(self, step: int, model_dir: str):
        super().__init__(128 + signal.SIGTERM)
        self.step, self.model_dir = step, model_dir


class PreemptionNotice:
    """Whether to checkpoint and stop after this step, because SIGTERM arrived (schedulers send it
    before they kill a job).

    One process: our own SIGTERM handler sets a flag. Several: jax's preemption sync manager
    (started by `jax.distributed.initialize`, listening for SIGTERM on any host) names the same
    step on every host, since a checkpoint needs all of them.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._multi_process = jax.process_count() > 1
        if not self._multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM: checkpointing after the current step, then stopping")
        self.requested = True

    def reached(self, step: int) -> bool:
        """Call at every step (on every host)."""
        if self._multi_process:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _loop(step_fn: Callable, state: TrainState, data: BatchIterator, first_batch: Any,
          mesh: jax.sharding.Mesh, mngr: Any, model_dir: str, num_steps: int, log_every: int,
          checkpoint_every: int, max_nonfinite_in_a_row: int) -> TrainState:
    start = int(state.step)
    metrics_log = MetricsLog(model_dir, start)
    batch = first_batch
    progress = None  # started after the first step, so that its rate and ETA leave compilation out
    last_time, last_step = time.time(), start
    log_only_metrics = jax.jit(taco_metrics)  # a pass over the TACO state: logging steps only
    preemption = PreemptionNotice()
    try:
        for step in range(start + 1, num_steps + 1):
            state, metrics = step_fn(state, sharding.global_batch(mesh, batch))
            if progress is None:
                jax.block_until_ready(metrics)
                log.info("step %d compiled and ran in %.1f s", step, time.time() - last_time)
                progress = tqdm(total=num_steps, initial=step - 1, desc="train", unit="step",
                                disable=jax.process_index() != 0, mininterval=5.0)
                last_time, last_step = time.time(), step
            preempted = preemption.reached(step)
            synced = step % min(log_every, MAX_STEPS_IN_FLIGHT) == 0 or step == num_steps
            if synced or step % checkpoint_every == 0 or preempted:
                _check_finite_streak(state, step, max_nonfinite_in_a_row, model_dir, mngr)  # never save a frozen state
            if synced:
                scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}  # also bounds the queue
                if step % log_every == 0 or step == num_steps:
                    now = time.time()
                    scalars["steps_per_second"] = (step - last_step) / max(now - last_time, 1e-9)
                    scalars.update({k: float(v) for k, v in log_only_metrics(state.opt_state).items()})
                    last_time, last_step = now, step
                    metrics_log.write(step, scalars)
                    progress.set_postfix(loss=f"{scalars['loss']:.3f}")
            progress.update(1)
            if step % checkpoint_every == 0 or step == num_steps or preempted:
                checkpoint.save(mngr, step, state, data.state())
                log.info("saved checkpoint %s", os.path.join(model_dir, str(step)))
            if preempted and step < num_steps:
                log.warning("preempted: saved %s at step %d; rerun the same command to resume", model_dir, step)
                raise Preempted(step, model_dir)
            if step < num_steps:
                batch = next(data)
    finally:
        preemption.close()
        if progress is not None:
            progress.close()
        metrics_log.close()
    return state


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="where checkpoints, config and metrics go")
    args = gin_utils.parse_args(parser, argv)
    logs.setup()
    check_writable_dir(args.model_dir, "--model_dir")
    train(args.model_dir, command_line=True)
    return 0
