"""Device mesh and logical-axis rules: data parallel, FSDP and tensor parallel by rules only.

Every parameter and main activation of the models carries logical axis names; a layout is just an
ordered list of (logical name, mesh axis) rules. Flax maps each array's names through the rules,
skipping a rule whose mesh axis the array already uses, so 'batch' and 'embed' may both map to 'data'
(FSDP): activations shard over batch, parameters over their embed dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import gin
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from t5_retrieval.errors import ConfigError

Rules = tuple[tuple[str, str | None], ...]

# Logical names used by the models: batch, length, embed, heads, kv, mlp, vocab, relpos_buckets,
# projection; per-task optimiser states (TACO's EMA) add a leading 'tasks' axis (never sharded,
# see `opt_state_shardings`).
_REPLICATED_REST: Rules = (("length", None), ("kv", None), ("relpos_buckets", None), ("tasks", None))
LAYOUTS: dict[str, Rules] = {
    "data_parallel": (("batch", "data"), ("embed", None), ("heads", None), ("mlp", None), ("vocab", None),
                      ("projection", None)) + _REPLICATED_REST,
    "fsdp": (("batch", "data"), ("embed", "data"), ("heads", None), ("mlp", None), ("vocab", None),
             ("projection", None)) + _REPLICATED_REST,
    "tensor_parallel": (("batch", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"),
                        ("embed", None), ("projection", None)) + _REPLICATED_REST,
    # 2-D: parameters sharded over both axes (embed over data, heads/mlp/vocab over model).
    "fsdp_tensor_parallel": (("batch", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"),
                             ("embed", "data"), ("projection", None)) + _REPLICATED_REST,
}


@gin.configurable
def logical_axis_rules(layout: str = "data_parallel") -> Rules:
    """The rules of a named layout (gin: `logical_axis_rules.layout = 'fsdp'`)."""
    if layout not in LAYOUTS:
        raise ConfigError(f"logical_axis_rules.layout: unknown sharding layout {layout!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


@gin.configurable
def make_mesh(model_parallelism: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh over all devices (of all processes); model axis innermost.

    Built with `Mesh` and Auto axis types: jax 0.10's `jax.make_mesh` defaults to Explicit axes,
    which would require sharding-in-types annotations everywhere.
    """
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) % model_parallelism:
        raise ConfigError(f"make_mesh.model_parallelism={model_parallelism} does not divide {len(devices)} devices")
    grid = np.asarray(devices).reshape(len(devices) // model_parallelism, model_parallelism)
    return Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def tree_shardings(mesh: Mesh, rules: Rules, logical_specs: Any) -> Any:
    """Maps a tree of logical PartitionSpecs (from `nn.get_partition_spec`) to NamedShardings."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_only(rules: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """The rules with every logical axis but 'batch' replicated: how a step reads parameters it
    gathered whole (the models' own constraints, such as the scanned layers' stacked weights,
    would otherwise shard them again)."""
    return tuple((name, axis if name == "batch" else None) for name, axis in rules)


def tasks_mesh_axis(rules: Rules) -> str | tuple[str, ...] | None:
    """The mesh axis the rules give the logical 'tasks' axis (a per-task state's or gradient's
    leading axis K); None: replicated."""
    return (nn.logical_to_mesh_axes(("tasks",), rules) or (None,))[0]  # None only for no names


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any, param_shardings: Any,
                        mesh: Mesh, rules: Rules) -> Any:
    """Shardings of `optimizer.init(params)`, matched to the params by structure, not by name.

    `optax.tree_map_params` finds the state's subtrees that `init` built from the params tree. Their
    leaves shaped like the parameter (AdamW's moments) get the parameter's sharding; leaves with
    one more, leading, axis (TACO's EMA, [K, *param.shape]) get it behind the logical 'tasks'
    axis, mapped by `rules`. Every other leaf (step counts, PRNG keys, [K] task weights) is
    replicated.
    """
    tasks_axis = tasks_mesh_axis(rules)

    def mirror(leaf: Any, param: Any, param_sharding: NamedSharding) -> Any:
        if isinstance(leaf, optax.MaskedNode):  # a parameter this part of the state leaves out (frozen)
            return leaf
        extra = leaf.ndim - param.ndim
        if extra == 0:
            return param_sharding
        if extra == 1:
            return NamedSharding(mesh, PartitionSpec(tasks_axis, *param_sharding.spec))
        raise ValueError(f"an optimiser-state leaf of shape {leaf.shape} mirrors a parameter of shape "
                         f"{param.shape}: expected the same rank or one leading task axis more")

    abstract_state = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, mirror, abstract_state, params, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (example) axis over 'data', the rest replicated."""
    return NamedSharding(mesh, PartitionSpec("data", *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def global_batch(mesh: Mesh, local_batch: Any) -> Any:
    """Assembles each host's slice of a batch (numpy, leading axis = examples) into global arrays."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(x)), np.asarray(x)),
        local_batch)


def local_data_devices(mesh: Mesh) -> int:
    """How many distinct 'data' shards this process feeds (its host-local batch multiplier)."""
    process = jax.process_index()
    rows = {i for i, row in enumerate(mesh.devices) for d in row if d.process_index == process}
    return len(rows)


def param_path(path: Sequence[Any]) -> str:
    """A pytree leaf's key path as "a/b/c" (dict keys, attribute names, sequence indices): the names
    `make_optimizer.frozen` patterns match and the task-sensitivity files are keyed by."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)
