"""`t5r train`: the training program, top to bottom.

mesh -> data -> model + sharded init -> optimiser -> restore -> jitted step -> loop (log, checkpoint).

    t5r train --model_dir=/tmp/run --gin_file=models/t5_base.gin --gin_file=runs/mt_dpr.gin \
        --gin.DATA_DIR="'/data/kilt'" --gin.VOCABULARY="'/models/t5/spiece.model'" --gin.TRAIN_STEPS=20000
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from tqdm import tqdm

from t5_retrieval import checkpoint, gin_utils, sharding
from t5_retrieval.artefact_io import directory_lock
from t5_retrieval.checkpoint import (
    QUERY_SIDE_FILE,
    base_dir_of,
    is_query_side_dir,
    read_base_record,
    write_base_record,
)
from t5_retrieval.data.batching import batches as _batches  # noqa: F401  (registers its gin configurables)
from t5_retrieval.data.batching import random_batches as _random_batches  # noqa: F401  (registers its gin configurables)
from t5_retrieval.data.records import write_text_atomic
from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.inference import load_encoder
from t5_retrieval.models.build import build_model, init_params, initial_params, model_config, upgraded_config
from t5_retrieval.models.families import family_of
from t5_retrieval.multitask import exported_state, multitask_metrics, multitask_problems, multitask_statistics
from t5_retrieval.multitask.analysis import STATE_FILE, save_state_npz
from t5_retrieval.optim import make_optimizer
from t5_retrieval.retrieval.encoder import is_encoder_of
from t5_retrieval.train_step import GatheredPasses, TrainState, make_train_step, query_shape_groups, task_groups

log = logging.getLogger(__name__)
# The host dispatches each step while the device runs the one before, then waits for that one: it
# hides the host's per-step work, keeps at most two steps queued (more than ~50 with collectives can
# deadlock on CPU), and a SIGTERM's checkpoint waits for the running step and at most one more.
# The state itself is looked at (non-finite streak, logged metrics) every SYNC_EVERY steps.
SYNC_EVERY = 20
OPERATIVE_CONFIG = gin_utils.OPERATIVE_CONFIG  # the gin bindings the run used (t5x's name)
# The parameters that hold paths: config.gin records them absolute (`portable_bindings`).
PATH_PARAMETERS = ("make_train_iterator.data_dir", "make_train_iterator.vocabulary", "make_train_iterator.negatives",
                   "make_train_iterator.passage_embeddings", "make_train_iterator.cache_dir",
                   "make_train_iterator.task_module_path", "train.init_from")


def portable_bindings() -> None:
    """Makes the bindings config.gin will record mean the same from any working directory: relative
    paths absolute, and the directory a MIXTURE_OR_TASK_MODULE was imported from recorded
    (`make_train_iterator.task_module_path`) when only this run's working directory or a relative
    `sys.path` entry holds it. Call after the gin flags are parsed, before `train`."""
    gin_utils.bind_absolute_paths(PATH_PARAMETERS)
    recorded = list(gin_utils.bound_value("make_train_iterator.task_module_path") or ())
    found = gin_utils.import_modules(gin_utils.bound_value("make_train_iterator.task_module"), recorded)
    if found:
        gin.bind_parameter("make_train_iterator.task_module_path", list(dict.fromkeys([*recorded, *found])))


LOCK_FILE = "t5r_train.lock"  # in a model directory: held by the run training it (`hold_model_dir`)


@contextlib.contextmanager
def hold_model_dir(model_dir: str) -> Iterator[None]:
    """Holds `<model_dir>/t5r_train.lock` for the block, so two runs never train one model
    directory at once (they would race for its checkpoints); a second run gets one line naming the
    first. A lock left by a killed run is taken over (the kernel releases it with its process) and
    the takeover logged. In a multi-process job process 0 takes it, the one that writes the model
    directory, and tells the others whether it got it, so every process stops, or none."""
    with contextlib.ExitStack() as stack:
        refusal: UserError | None = None
        if jax.process_index() == 0:
            try:
                previous = stack.enter_context(directory_lock(os.path.join(model_dir, LOCK_FILE), "model directory"))
            except UserError as e:
                refusal = e
            else:
                if previous:
                    log.info("%s: taking over the lock of a run that ended without releasing it (pid %s on host %s, "
                             "since %s)", model_dir, previous.get("pid"), previous.get("host"), previous.get("since"))
        if jax.process_count() > 1:
            refused = int(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)))
            if refused and refusal is None:
                refusal = UserError(f"{model_dir}: process 0 of this job found the model directory in use by another "
                                    "run (its log names it); wait for that run to end, then run this command again")
        if refusal is not None:
            raise refusal
        yield


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "t5_retrieval", "xla")
# Bindings that describe the machine a run used, not the model: left out of the model's config.gin.
MACHINE_LOCAL_BINDINGS = ("train.compilation_cache_dir",)


def portable_config(operative_config: str) -> str:
    """gin's operative config (`gin.operative_config_str()`) without `MACHINE_LOCAL_BINDINGS`: a
    binding's line and its indented continuation lines (gin wraps a long value) are dropped."""
    kept: list[str] = []
    dropping = False
    for line in operative_config.splitlines(keepends=True):
        if dropping and line.startswith(" "):
            continue
        dropping = line.split(" = ", 1)[0] in MACHINE_LOCAL_BINDINGS
        if not dropping:
            kept.append(line)
    return "".join(kept)


def use_compilation_cache(directory: str | None) -> None:
    """Points JAX's persistent compilation cache at `directory` unless one is configured already
    (JAX_COMPILATION_CACHE_DIR, or a caller's `jax.config`)."""
    if directory and not jax.config.jax_compilation_cache_dir:  # type: ignore[attr-defined]  # a runtime flag
        jax.config.update("jax_compilation_cache_dir", directory)
        log.info("compilation cache: %s", directory)


def _count(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


class BatchIterator(Protocol):
    """What the trainer needs from the data pipeline (see t5_retrieval.data.batching.batches)."""

    task_names: list[str]
    features: dict[str, Any]  # vocabulary, lengths, task prefixes: recorded for inference
    steps_per_epoch: int  # what `num_epochs` counts in

    def __next__(self) -> dict[str, dict[str, np.ndarray]]: ...
    def state(self) -> dict[str, Any]: ...
    def restore(self, state: dict[str, Any]) -> None: ...


def _summary_writer(directory: str, purge_step: int) -> Any:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch wherever it
    is installed, only to accept torch tensors, which this loop never logs (2-4 s of every run's
    start). Where something imported torch already, it stays as it is."""
    hidden = "torch" not in sys.modules
    if hidden:
        # a None entry makes `import torch` raise ImportError, which tensorboardX expects where it is absent
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules["torch"]
    return SummaryWriter(directory, purge_step=purge_step)


class MetricsLog:
    """Scalars to TensorBoard (`<model_dir>/tb`) and to `<model_dir>/metrics.jsonl` (process 0 only).

    A run resumed at `start_step` first drops what the interrupted run logged after that step (it
    is logged again), so both hold one row per step however often the run was restarted.
    """

    def __init__(self, directory: str, start_step: int):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            self.tb = _summary_writer(os.path.join(directory, "tb"), purge_step=start_step + 1)
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

    def close(self, failing: bool = False) -> None:
        """`failing`: the run is already failing (a full disk, say), and a flush error here must not
        replace that error."""
        if not self.enabled:
            return
        try:
            self.tb.close()
            self.jsonl.close()
        except OSError:
            if not failing:
                raise


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
          gather_params_once: bool = False,
          compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE,
          command_line: bool = False,
          ) -> TrainState:
    """Trains (or resumes) a dual encoder in `model_dir`; returns the final state.

    Args:
      batches: factory of the multi-task batch iterator, called with per_device_batch,
        local_data_devices, host_index, host_count and seed (gin: `@make_train_iterator`).
      num_steps / num_epochs: the run's length (exactly one), in optimiser steps or in epochs of
        the largest task; the learning-rate schedule is a fraction of it, and the multi-task
        transform is built knowing it.
      per_device_batch: queries per device per step, split over the tasks by the mixture rates.
      multitask: factory of a multi-task gradient transform (gin: `@multitask.<name>`, any factory
        of `t5_retrieval.multitask`); None sums the task losses (naive multi-task). The metrics its
        state reports are logged with the others, and the arrays it exports are written to
        `<model_dir>/multitask_state.npz` when the run ends (for `t5r analyze`).
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
      gather_params_once: a per-task step (`multitask`) gathers the parameters whole onto every
        device once per step, before its task passes, instead of each pass gathering every layer's
        weights under a layout that shards them (FSDP); each task's gradient is reduced back to the
        parameters' shardings. One copy of the parameters per device more, in the dtypes the network
        reads them (bfloat16 for a T5 computing in bfloat16; docs/pods.md).
      compilation_cache_dir: JAX's persistent compilation cache, so that a restarted run does not
        compile its step again; None turns it off. Left alone when JAX already has one configured.
      command_line: run as `t5r train`: a `--gin.configurable.param` binding of a configurable the
        run never called is an error, before the first step.

    The operative gin config (every binding the run used) is written to `<model_dir>/config.gin`;
    `t5r train --gin_file=<model_dir>/config.gin --model_dir=<model_dir>` runs it again, from any
    directory when its paths were made absolute (`portable_bindings`, as `t5r train` does).
    """
    if max_nonfinite_in_a_row < 1:
        raise ConfigError(f"train.max_nonfinite_in_a_row must be >= 1, got {max_nonfinite_in_a_row}")
    if (num_steps is None) == (num_epochs is None):
        raise ConfigError(f"train: set exactly one of num_steps ({num_steps}) and num_epochs ({num_epochs})")
    if num_steps is not None and num_steps < 1:
        raise ConfigError(f"train.num_steps must be >= 1, got {num_steps}")
    use_compilation_cache(compilation_cache_dir)
    mesh = sharding.make_mesh()
    rules = sharding.logical_axis_rules()
    data = batches(per_device_batch=per_device_batch, local_data_devices=sharding.local_data_devices(mesh),
                   host_index=jax.process_index(), host_count=jax.process_count(), seed=seed,
                   **(data_overrides or {}))
    task_names = list(data.task_names)
    if num_epochs is not None:
        num_steps = max(1, int(round(num_epochs * data.steps_per_epoch)))
    assert num_steps is not None  # exactly one of the two is set (checked above)
    config = {**model_config(), "features": data.features}
    check_vocabulary_fits(config)
    towers = config["dual_encoder"]["query_towers"]
    if towers and towers != len(task_names):
        raise ConfigError(f"DualEncoderConfig.query_towers={towers} but the mixture has {len(task_names)} tasks "
                          f"({', '.join(task_names)}); set one query tower per task")
    checkpoint.write_config(model_dir, config, upgrade=lambda stored: upgraded_config(stored, config))
    if "passage_embeddings" in data.features:
        init_from = record_passage_base(model_dir, init_from, data.features["passage_embeddings"], config)

    model = build_model(config)
    params_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
    params, param_shardings = init_params(model, params_rng, mesh, rules)
    log.info("model %s: %s dual encoder, %s parameters; %d device(s) (%s) on %d process(es), mesh %s; "
             "tasks %s", model_dir, family_of(config).name.upper(), f"{_count(params):,}", jax.device_count(),
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
                              stop_passage_gradient=stop_passage_gradient,
                              gathered_passes=GatheredPasses.of_model(config, param_shardings)
                              if gather_params_once else None)
    unread = gin_utils.unread_bindings() if command_line else []
    if unread:
        raise UserError(f"--gin.{unread[0]}: this run never uses {unread[0].rpartition('.')[0]}, so the value "
                        "would be ignored; check the name or the gin files")
    if jax.process_index() == 0:
        write_text_atomic(os.path.join(model_dir, OPERATIVE_CONFIG), portable_config(gin.operative_config_str()))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        first = next(data)
        log_query_passes(model, first, task_names, per_task=multitask is not None)
        batch_shardings = jax.tree.map(lambda x: sharding.batch_sharding(mesh, np.ndim(x)), first)
        jitted = jax.jit(step_fn, in_shardings=(state_shardings, batch_shardings),
                         out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        state = _loop(jitted, state, data, first, mesh, mngr, model_dir, num_steps, log_every, checkpoint_every,
                      max_nonfinite_in_a_row, task_names)
    log.info("finished %s at step %d (%d step(s) skipped as non-finite)", model_dir, int(state.step),
             int(state.skipped_steps))
    export_multitask_state(state.opt_state, task_names, model_dir)
    return state


def check_vocabulary_fits(config: dict[str, Any]) -> None:
    """Every token id of the run's vocabulary (sentencepiece pieces plus T5's 100 sentinel ids, or
    WordPiece tokens) must have a row in the model's embedding table: an id past it gives every step a
    non-finite loss. Raises ConfigError naming VOCAB_SIZE and a size that fits (a multiple of 128)."""
    from t5_retrieval.data.tokenizers.tokenize import load_vocabulary

    path = config["features"].get("vocabulary")
    family = family_of(config)
    size = config[family.name]["vocab_size"]
    if not path:
        return
    vocab = load_vocabulary(path)
    if vocab.vocab_size > size:
        extra = vocab.extra_ids
        raise ConfigError(f"VOCAB_SIZE={size} ({family.network.__name__}.vocab_size) is below the {vocab.vocab_size} "
                          f"token ids of the vocabulary {path} ({vocab.vocab_size - extra} pieces + {extra} sentinels): "
                          f"pass --gin.VOCAB_SIZE={-(-vocab.vocab_size // 128) * 128}")


def log_query_passes(model: nn.Module, batch: dict[str, dict[str, np.ndarray]], task_names: list[str],
                     per_task: bool) -> None:
    """Logs each task's query length and how the step reads the queries: per-task gradients compile
    one pass (a `lax.scan` body) per group of same-shaped tasks; the naive step one model call per
    task with per-task towers, else one call for all query shapes (`embed_groups`)."""
    if per_task:
        groups = [[task_names[k] for k in group] for group in task_groups(model, batch, task_names)]
        how = f"the step compiles {len(groups)} task pass(es), one per sub-batch shape"
    elif model.config.query_towers:
        groups = [[name] for name in task_names]
        how = f"the step compiles {len(groups)} query pass(es), one per task's tower"
    else:
        groups = query_shape_groups(batch, task_names)
        how = f"the step embeds {len(groups)} query shape(s) in one pass of the model"
    log.info("query lengths: %s; %s: %s", ", ".join(f"{name} {batch[name]['query_tokens'].shape[1]}"
                                                     for name in task_names), how,
             "; ".join("[" + ", ".join(group) + "]" for group in groups))


def record_passage_base(model_dir: str, init_from: str | None, table: dict[str, str], config: dict[str, Any]) -> str:
    """Training over stored passage embeddings only makes sense from the model that wrote them:
    checks that `init_from` is it, and marks `model_dir` as a query-side model over that base (so
    encode/index/eval/serve embed passages with the base and accept the base's indexes). Returns
    the base to start from.

    A model directory that already records a base with the embeddings' fingerprint (a resumed run,
    maybe of a copy moved with its base) keeps its record, which is relative to it, and starts from
    that base: config.gin's `init_from` names where the base was when the run began."""
    if config["dual_encoder"].get("query_generation"):
        raise ConfigError("make_train_iterator.passage_embeddings: GDMTL's query generation needs passage tokens")
    kept = _recorded_base(model_dir, table["fingerprint"])
    if kept is not None:
        log.info("%s: keeps its base model %s (%s)", model_dir, kept, QUERY_SIDE_FILE)
        return kept
    if not init_from or not os.path.exists(os.path.join(init_from, checkpoint.CONFIG_FILE)):
        raise ConfigError(f"make_train_iterator.passage_embeddings (written by the model with fingerprint "
                          f"{table['fingerprint']!r}) needs train.init_from to be the t5r model directory that "
                          f"wrote them (got {init_from!r})")
    base = load_encoder(init_from)
    if not is_encoder_of(base, table["fingerprint"]):
        raise ConfigError(f"make_train_iterator.passage_embeddings: written by the model with fingerprint "
                          f"{table['fingerprint']!r}, but train.init_from={init_from!r} has fingerprint "
                          f"{base.fingerprint!r}")
    if jax.process_index() == 0:
        write_base_record(model_dir, init_from, table["fingerprint"], trained_by="t5r train",
                          passage_embeddings_digest=table["digest"])
    return init_from


def _recorded_base(model_dir: str, fingerprint: str) -> str | None:
    """The base model directory `model_dir`'s query_side.json records, when it records one whose
    model has `fingerprint`; else None."""
    if not is_query_side_dir(model_dir):
        return None
    base_dir = base_dir_of(model_dir)
    if read_base_record(model_dir)["base_fingerprint"] != fingerprint or \
            not os.path.exists(os.path.join(base_dir, checkpoint.CONFIG_FILE)):
        return None
    return base_dir if is_encoder_of(load_encoder(base_dir), fingerprint) else None


def export_multitask_state(opt_state: Any, task_names: list[str], model_dir: str) -> None:
    """Writes what the multi-task state exports for analysis (if it exports anything), with the task
    names and its hyperparameters, as `<model_dir>/multitask_state.npz` for `t5r analyze`."""
    exported = exported_state(opt_state)
    if exported is None:
        return
    arrays, hyperparams = multihost_utils.process_allgather(tuple(exported), tiled=True)
    if jax.process_index() == 0:
        save_state_npz(arrays, task_names, os.path.join(model_dir, STATE_FILE), hyperparams)


def restore_train_state(mngr: Any, like: TrainState) -> tuple[TrainState, dict[str, Any]] | None:
    """(state, data position) from the newest readable checkpoint into `like`'s shardings, or None.

    A checkpoint whose non-finite step counters were saved as None (orbax restores them as None)
    resumes with zero counts. (One written by the four-field TrainState from before the counters
    existed has no such entries and does not restore into this layout.) One whose optimiser state
    has other fields than this run's is refused (`check_optimizer_state_fits`).
    """
    if mngr.latest_step() is not None:
        check_optimizer_state_fits(mngr, mngr.latest_step(), like)
    restored = checkpoint.restore(mngr, checkpoint.abstract_like(like))
    if restored is None:
        return None
    state, data_state = restored
    if state.skipped_steps is None or state.nonfinite_in_a_row is None:
        log.info("%s: checkpoint without non-finite step counts; counting from 0", mngr.directory)
        state = state.replace(skipped_steps=like.skipped_steps, nonfinite_in_a_row=like.nonfinite_in_a_row)
    return state, data_state


def check_optimizer_state_fits(mngr: Any, step: int, like: TrainState) -> None:
    """Raises CheckpointError, saying what to do, when the optimiser state saved at `step` has other
    fields than this run's: another multi-task transform or optimiser setting, or a version of t5r
    whose multi-task state held other fields (before hyperparameters were saved in it)."""
    saved_paths = checkpoint.saved_leaf_paths(mngr, step)
    if saved_paths is None:
        return
    saved = {p for p in saved_paths if p.startswith("opt_state/")}
    expected = {p for p in checkpoint.leaf_paths(like) if p.startswith("opt_state/")}
    if saved == expected:
        return
    differences = [f"{what} {sorted(paths)[0]}" + (f" (and {len(paths) - 1} more)" if len(paths) > 1 else "")
                   for what, paths in (("lacks", expected - saved), ("has", saved - expected)) if paths]
    raise checkpoint.CheckpointError(
        f"checkpoint {mngr.directory / str(step)}: its optimiser state does not fit this run's (it "
        f"{' and '.join(differences)}): it was written with another multi-task transform or optimiser "
        "setting, or by an earlier t5r whose multi-task state had other fields, and cannot be resumed "
        f"here. Resume it with the configuration and t5r version that wrote it, or continue from its "
        f"weights with a fresh optimiser in a new --model_dir with --gin.train.init_from=\"'{mngr.directory}'\".")


class NonFiniteError(FloatingPointError):
    """Too many consecutive training steps had a non-finite loss or gradient."""


def _check_multitask(state: TrainState, task_names: list[str], step: int, warned: set[str]) -> None:
    """Stops the run on a multi-task state's fatal problem (TACO's median of 0: its weights are then
    an argmax, not TACO) and warns once about each other one (once per task, however its figures move)."""
    for problem in multitask_problems(state.opt_state, task_names):
        if problem.fatal:
            raise ConfigError(f"step {step}: {problem.message}")
        if problem.key not in warned:
            warned.add(problem.key)
            log.warning("step %d: %s", step, problem.message)


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
        self.finished_step = 0  # the last step the host saw complete (the loop keeps it current)
        self._previous = None
        self._multi_process = jax.process_count() > 1
        if not self._multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM after step %d finished: checkpointing after the running step, then stopping",
                    self.finished_step)
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
          checkpoint_every: int, max_nonfinite_in_a_row: int, task_names: list[str]) -> TrainState:
    start = int(state.step)
    warned: set[str] = set()
    metrics_log = MetricsLog(model_dir, start)
    batch = first_batch
    progress = None  # started after the first step, so that its rate and ETA leave compilation out
    last_time, last_step = time.time(), start
    log_only_metrics = jax.jit(multitask_statistics)  # a pass over the multi-task state: logging steps only
    preemption = PreemptionNotice()
    metrics: Any = None
    try:
        for step in range(start + 1, num_steps + 1):
            previous = metrics
            state, metrics = step_fn(state, sharding.global_batch(mesh, batch))
            if previous is not None:  # the device runs this step while the host prepares the next
                jax.block_until_ready(previous)
                preemption.finished_step = step - 1
            if progress is None:
                jax.block_until_ready(metrics)
                log.info("step %d compiled and ran in %.1f s", step, time.time() - last_time)
                _check_multitask(state, task_names, step, warned)  # at once
                progress = tqdm(total=num_steps, initial=step - 1, desc="train", unit="step",
                                disable=jax.process_index() != 0, mininterval=5.0)
                last_time, last_step = time.time(), step
            preempted = preemption.reached(step)
            synced = step % min(log_every, SYNC_EVERY) == 0 or step == num_steps
            if synced or step % checkpoint_every == 0 or preempted:
                _check_finite_streak(state, step, max_nonfinite_in_a_row, model_dir, mngr)  # never save a frozen state
                _check_multitask(state, task_names, step, warned)  # nor a method that is not itself
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
        metrics_log.close(failing=sys.exc_info()[0] is not None)
    return state
