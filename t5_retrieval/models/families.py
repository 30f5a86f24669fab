"""Model families: each one registered value saying how its dual encoder is configured, built and sized.

A family is a network (T5, BERT, ...) with its dual-encoder head. Its module registers a
`ModelFamily` with `register_family`; `models/build.py` imports the family modules and dispatches
through `FAMILIES`, and `t5r plan` sizes any registered family, so no caller branches on a family's
name. Conventions every family keeps, which the trainer, inference and checkpoint import rely on:
its stored config is `{"family": name, name: <network fields>, "dual_encoder": <head fields>}`; its
module holds the shared encoder's parameters under `name` and query towers under `query_<name>_<k>`,
and embeds with `__call__(tokens, deterministic, tower)` and, for the train step's groups of texts of
several shapes, `embed_groups(groups, deterministic, tower)` (a tuple, one embedding per group);
its head config is a `dual_encoder.QueryTowers` with `logit_scale` and `query_generation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5_retrieval.errors import ConfigError

# A stored config without a "family" key is a T5's (written before other families existed); T5's
# are still written without one, so that their config bytes and fingerprints stay the same.
UNNAMED = "t5"


@dataclasses.dataclass(frozen=True)
class HFImport:
    """How a family starts from a Hugging Face directory whose config.json has `model_type`.

    `load(directory, abstract params of one encoder, network config)` returns that encoder's params,
    refusing a directory that describes another network.
    """

    model_type: str
    load: Callable[[str, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family: its config dataclasses, its Flax module and what `t5r plan` needs to size it."""

    name: str
    network: type  # the network's config dataclass (gin-configurable), stored under config[name]
    head: type  # the dual encoder's config dataclass (gin-configurable), stored under config["dual_encoder"]
    module: Callable[[Any, Any], nn.Module]  # (network config, head config) -> the dual encoder
    depth_keys: tuple[str, ...]  # network fields counting the layers of each stack
    forward_flops: Callable[[dict[str, Any], int, int], float]  # (model config, rows, length) -> matmul FLOPs
    hf_import: HFImport | None = None  # None: starts from t5r model directories only
    dropout_keys: tuple[str, ...] = ()  # network fields holding dropout rates (zeroed in the plan's timing programs)
    # Names of the parameters the network reads in float32 whatever its compute dtype; it reads every
    # other one cast to that dtype (`as_read`). None: not declared, parameters are read as stored.
    float32_params: tuple[str, ...] | None = None
    # Network fields that choose how the chips compute, not what (the attention kernel): left out of
    # the stored config, so a config built from stored data takes them from the run's gin bindings.
    runtime_keys: tuple[str, ...] = ()

    def _stored(self, network: Any) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(network).items() if k not in self.runtime_keys}

    def config(self) -> dict[str, Any]:
        """The architecture as plain data, the dataclasses constructed here so that gin bindings apply."""
        named = {} if self.name == UNNAMED else {"family": self.name}
        return {**named, self.name: self._stored(self.network()),
                "dual_encoder": dataclasses.asdict(self.head())}

    def network_config(self, config: dict[str, Any]) -> Any:
        return self.network(**config[self.name])

    def build(self, config: dict[str, Any]) -> nn.Module:
        return self.module(self.network_config(config), self.head(**config["dual_encoder"]))

    def as_read(self, config: dict[str, Any], params: Any) -> Any:
        """`params` cast to the dtypes the network reads them in (see `float32_params`): the same
        forward pass, from a copy that is half the size under bfloat16 compute. What a per-task step
        with `train.gather_params_once` gathers."""
        if self.float32_params is None:
            return params
        compute = self.network_config(config).compute_dtype
        keep = set(self.float32_params)

        def read(path: tuple[Any, ...], p: Any) -> Any:
            if getattr(path[-1], "key", None) in keep or not jnp.issubdtype(p.dtype, jnp.floating):
                return p
            return p.astype(compute)
        return jax.tree_util.tree_map_with_path(read, params)

    def upgraded(self, stored: dict[str, Any]) -> dict[str, Any]:
        """A stored config's architecture with fields added since at their defaults (the same model)."""
        out = dict(stored)
        if self.name in stored:
            fields = {k: v for k, v in stored[self.name].items() if k not in self.runtime_keys}
            out[self.name] = self._stored(self.network(**fields))
        if "dual_encoder" in stored:
            out["dual_encoder"] = dataclasses.asdict(self.head(**stored["dual_encoder"]))
        return out


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    if family.name in FAMILIES and FAMILIES[family.name] != family:
        raise ValueError(f"model family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ConfigError(f"model family {name!r}: this version knows {tuple(FAMILIES)} (model_config.family)")
    return FAMILIES[name]


def family_of(config: dict[str, Any]) -> ModelFamily:
    """The family of a model config (`model_config()`'s, or one stored with a checkpoint)."""
    return get_family(config.get("family", UNNAMED))


def hf_family(model_type: str) -> ModelFamily:
    """The family that imports Hugging Face directories of `model_type`."""
    for family in FAMILIES.values():
        if family.hf_import and family.hf_import.model_type == model_type:
            return family
    known = [f.hf_import.model_type for f in FAMILIES.values() if f.hf_import]
    raise ConfigError(f"a Hugging Face directory of model_type {model_type!r}: this version imports {known}")
