"""The one model factory: architecture config as plain data -> Flax module -> sharded parameters.

Training, inference and export all build models here, so a checkpoint's stored `model_config.json`
rebuilds exactly the module that wrote it. `initial_params` loads the weights a run starts from
(a t5r model directory, or a Hugging Face T5 / BERT directory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import types
import typing
from typing import Any

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5_retrieval import checkpoint, sharding
from t5_retrieval.data.tasks.task_spec import upgrade_records
from t5_retrieval.data.text import PASSAGE_TEMPLATE
from t5_retrieval.data.tokenizers.query_inputs import TRUNCATIONS
from t5_retrieval.errors import ConfigError
from t5_retrieval.models import (  # noqa: F401 (the model families: importing one registers it)
    bert_dual_encoder,
    dual_encoder,
    pretrained,  # gin: @minilm_l6_dir
)
from t5_retrieval.models.families import FAMILIES, UNNAMED, family_of, get_family, hf_family

log = logging.getLogger(__name__)


@gin.configurable
def model_config(family: str = "t5") -> dict[str, Any]:
    """The architecture as plain data: stored with checkpoints, rebuilt by `build_model`.

    `family` names a registered `families.ModelFamily`: "t5" (ST5 dual encoder; the stored config has
    no "family" key, as before BERT existed) or "bert" (MT-DPR / sentence-transformers: {"family":
    "bert", "bert", "dual_encoder"}). Each builds its config dataclasses here, so gin bindings apply.
    """
    if family not in FAMILIES:
        raise ConfigError(f"model_config.family: expected one of {tuple(FAMILIES)}, got {family!r}")
    return get_family(family).config()


def upgraded_config(stored: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A config stored by an earlier version as this version writes it, so that its run resumes.

    Architecture fields added since take their dataclass defaults (the same model), the passage
    template its only former value, the vocabulary digest and the passage embeddings' content
    digest the current ones (not recorded before: nothing to compare), the task records in this
    version's form (`task_spec.upgrade_records`, the one reader of older ones) with their step order
    and text preprocessors the current run's where not recorded (`_with_current_run`).
    """
    out = family_of(stored).upgraded(stored)
    if "features" in stored:
        features = dict(stored["features"])
        if "passage_template" in current.get("features", {}):
            features.setdefault("passage_template", PASSAGE_TEMPLATE)
        if "vocabulary_digest" in current.get("features", {}):  # not recorded before: nothing to compare
            features.setdefault("vocabulary_digest", current["features"]["vocabulary_digest"])
        current_table = current.get("features", {}).get("passage_embeddings")
        if isinstance(features.get("passage_embeddings"), dict) and current_table and "digest" in current_table:
            features["passage_embeddings"] = {"digest": current_table["digest"], **features["passage_embeddings"]}
        features["tasks"] = _with_current_run(upgrade_records(features), current.get("features", {}).get("tasks", {}))
        out["features"] = features
    return out


def _with_current_run(records: dict[str, dict[str, Any]], current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Stored task records with what older versions did not record taken from the current run's:
    a task's step order (`index`, once implied by the mixture) and the preprocessors that rewrite
    its query text."""
    return {name: {**{key: current[name][key] for key in ("index", "text_preprocessors")
                      if key in current.get(name, {}) and key not in record}, **record}
            for name, record in records.items()}


# Values a stored config's string fields may take where the network's config class does not check them.
KNOWN_VALUES = {"dtype": ("float32", "bfloat16", "float16"), "mlp_activation": ("relu", "gated-gelu")}


def _value_problem(value: Any, hint: Any, default: Any) -> str | None:
    """What is wrong with a stored field of a config dataclass (`hint` its type, `default` its
    default value), or None: ints positive (at least 0 where the default is 0), floats finite."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        return None if type(None) in options else "expected a value, not null"
    if bool in options:
        return None if isinstance(value, bool) else "expected true or false"
    if int in options:
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if default == 0 else 1):
            return "expected an integer >= 0" if default == 0 else "expected a positive integer"
        return None
    if float in options:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "expected a finite number"
    if str in options:
        return None if isinstance(value, str) else "expected a string"
    return None


def _check_section(section: Any, cls: type, where: str, name: str) -> None:
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: field {name!r} is {json.dumps(section)[:60]}, expected an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in section.items():
        if key not in fields:
            raise ConfigError(f"{where}: field '{name}.{key}' is unknown to this version ({cls.__name__} has "
                              f"{', '.join(fields)})")
        problem = _value_problem(value, hints[key], fields[key].default)
        if problem is None and key in KNOWN_VALUES and value not in KNOWN_VALUES[key]:
            problem = f"expected one of {KNOWN_VALUES[key]}"
        if problem:
            raise ConfigError(f"{where}: field '{name}.{key}' is {json.dumps(value)[:60]}, {problem}")
    try:
        cls(**section)  # the class's own checks (pooling, remat policy)
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{where}: field {name!r}: {str(e).splitlines()[0]}") from None


def _check_features(features: Any, where: str) -> None:
    if not isinstance(features, dict):
        raise ConfigError(f"{where}: field 'features' is {json.dumps(features)[:60]}, expected an object")
    for key in ("query_len", "passage_len"):
        if key in features and _value_problem(features[key], int, 1):
            raise ConfigError(f"{where}: field 'features.{key}' is {json.dumps(features[key])[:60]}, expected a "
                              "positive integer")
    for key in ("vocabulary", "vocabulary_digest", "passage_template"):
        if _value_problem(features.get(key), str | None, None):
            raise ConfigError(f"{where}: field 'features.{key}' is {json.dumps(features[key])[:60]}, expected a "
                              "string")
    tasks = features.get("tasks", {})
    if not isinstance(tasks, dict):
        raise ConfigError(f"{where}: field 'features.tasks' is {json.dumps(tasks)[:60]}, expected an object")
    for task, record in tasks.items():
        field = f"features.tasks.{task}"
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: field '{field}' is {json.dumps(record)[:60]}, expected an object")
        for key, hint, default in (("query_len", int | None, 1), ("prefix", str | None, None),
                                   ("dataset", str, None), ("truncation", str, None), ("index", int, 0)):
            if key in record and (problem := _value_problem(record[key], hint, default)):
                raise ConfigError(f"{where}: field '{field}.{key}' is {json.dumps(record[key])[:60]}, {problem}")
        if record.get("truncation", TRUNCATIONS[0]) not in TRUNCATIONS:
            raise ConfigError(f"{where}: field '{field}.truncation' is {json.dumps(record['truncation'])[:60]}, "
                              f"expected one of {TRUNCATIONS}")


def check_stored_config(config: Any, where: str) -> None:
    """Raises ConfigError naming the file `where` and the field of a stored model config that this
    version cannot build a model from: a family it does not know, a field of the wrong type, a size
    that is not a positive integer (`num_heads` 0), a value outside its known set, a malformed
    task record. Run before anything is built from a config read from disk."""
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: a JSON {type(config).__name__}, expected an object")
    name = config.get("family", UNNAMED)
    if not isinstance(name, str) or name not in FAMILIES:
        raise ConfigError(f"{where}: field 'family' is {json.dumps(name)[:60]}, expected one of {tuple(FAMILIES)}")
    family = FAMILIES[name]
    for key, cls in ((family.name, family.network), ("dual_encoder", family.head)):
        if key not in config:
            raise ConfigError(f"{where}: no field {key!r}; is this a t5r model directory?")
        _check_section(config[key], cls, where, key)
    if "features" in config:
        _check_features(config["features"], where)


def build_model(config: dict[str, Any]) -> nn.Module:
    """The Flax dual encoder a model config describes (its family's module)."""
    return family_of(config).build(config)


def apply_params(model: nn.Module, params: Any, *args: Any, **kwargs: Any) -> jax.Array:
    """`model.apply({"params": params}, ...)`: the output alone (flax types `apply` as maybe returning
    mutated collections too, which a call without `mutable` never does)."""
    return model.apply({"params": params}, *args, **kwargs)  # type: ignore[return-value]


def init_params(model: nn.Module, rng: jax.Array, mesh: jax.sharding.Mesh, rules: sharding.Rules
                ) -> tuple[Any, Any]:
    """Initialises parameters directly into their shardings; returns (params, shardings)."""

    def boxed_init(key: jax.Array) -> Any:
        return model.init({"params": key}, jnp.ones((1, 4), jnp.int32))["params"]

    logical_specs = nn.get_partition_spec(jax.eval_shape(boxed_init, rng))
    shardings = sharding.tree_shardings(mesh, rules, logical_specs)
    params = jax.jit(lambda key: nn.unbox(boxed_init(key)), out_shardings=shardings)(rng)
    return params, shardings


def initial_params(source: str, like: Any, config: dict[str, Any]) -> Any:
    """Weights to start from: a t5r model directory's latest checkpoint, or a Hugging Face directory of
    a family that imports them (`families.HFImport`: T5, BERT). Query encoders (separate or per task)
    start from the same pretrained weights as the main one, as in DPR / MT-DPR. `config` is the
    model's (`model_config()`): a Hugging Face directory must describe the same network."""
    abstract = checkpoint.abstract_like(like)
    if os.path.exists(os.path.join(source, checkpoint.CONFIG_FILE)):
        params, step = checkpoint.restore_params(source, abstract)
        log.info("initialised from %s step %d", source, step)
        return params
    if os.path.exists(os.path.join(source, "config.json")):
        from t5_retrieval.models.hf_import import read_hf_config
        family = hf_family(read_hf_config(source).get("model_type", "t5"))
        assert family.hf_import is not None
        name = family.name
        if name not in like:
            raise checkpoint.CheckpointError(
                f"init_from={source!r} is a Hugging Face {name.upper()} directory, but the model is not "
                f"(its encoders: {sorted(like)}; see model_config.family)")
        encoders = [key for key in like if key == name or key.startswith(f"query_{name}_")]
        # The file's config.json against the model's; shapes tensor by tensor against each encoder's tree.
        network = family.network_config(config)
        return {**like, **{key: family.hf_import.load(source, abstract[key], network) for key in encoders}}
    raise checkpoint.CheckpointError(f"init_from={source!r}: neither a t5r model directory ({checkpoint.CONFIG_FILE}) "
                                     "nor a Hugging Face directory (config.json)")
