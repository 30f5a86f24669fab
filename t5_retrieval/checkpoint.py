"""Orbax checkpoints of the whole training state plus the data iterator position.

One checkpoint = {state: params, optimiser state (incl. TACO), step, RNG} saved as sharded arrays,
and {data: the batch iterator's JSON state}, so a resumed run continues bit-for-bit. The model's
config is stored next to the checkpoints so that inference can rebuild the model from the
directory alone and refuse a checkpoint that does not fit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

CONFIG_FILE = "model_config.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, empty or does not fit the model."""


def manager(directory: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_names=("state", "data"))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict[str, Any]) -> None:
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(data_state)))
    mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, step: int | None = None
            ) -> tuple[Any, dict[str, Any]] | None:
    """Restores into the shardings of `abstract_state` (ShapeDtypeStructs); None if no checkpoint."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                              data=ocp.args.JsonRestore()))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"checkpoint {mngr.directory}/{step} does not fit this model/state: {e}") from e
    return restored["state"], restored["data"]


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding, the target orbax restores into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def write_config(directory: str, config: dict[str, Any]) -> None:
    """Records the model config; a different config in an existing directory is an error."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CONFIG_FILE)
    if os.path.exists(path):
        existing = read_config(directory)
        if existing != config:
            changed = sorted(k for k in set(existing) | set(config) if existing.get(k) != config.get(k))
            raise CheckpointError(f"{path}: the model config differs from this run's in {changed}; "
                                  f"use a new model_dir or the same config")
        return
    if jax.process_index() == 0:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(config, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def read_config(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{directory}: no {CONFIG_FILE}; is this a t5r model directory?")
    with open(path) as f:
        return json.load(f)


def restore_params(directory: str, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
    """Restores only the parameters of the latest (or given) checkpoint, for inference.

    Returns (params, step). The optimiser state is not read, so inference needs no more memory
    than the model itself.
    """
    mngr = manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"{directory}: no checkpoint found")
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding) if getattr(x, "sharding", None)
                                else ocp.RestoreArgs(), abstract_params)
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True)))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"checkpoint {directory}/{step} does not fit this model: {e}") from e
    return restored["state"]["params"], step
