"""A trained dual encoder as one object: text in, embeddings out.

Encode, index, eval, mine and serve all go through `load_encoder`, so every stage formats queries
(task prefix, `[SEP]` -> `</s>`), tokenizes and pads exactly as training did: the features recorded
with the checkpoint say how. Batches are sharded over the mesh's data axis; the last partial batch
is padded so one compiled shape serves the whole corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5_retrieval import checkpoint, sharding
from t5_retrieval.data.records import Passage
from t5_retrieval.data.text import PASSAGE_TEMPLATE, format_passage, format_query
from t5_retrieval.data.tokenize import load_vocabulary, tokenize, vocabulary_digest
from t5_retrieval.models.bert_dual_encoder import BertDualEncoder
from t5_retrieval.models.dual_encoder import DualEncoder
from t5_retrieval.models.t5 import T5Config
from t5_retrieval.train import build_model


def fingerprint_of(config: dict[str, Any], params: Any, step: int) -> str:
    """Identifies a model: its config, its vocabulary's content, its checkpoint step and a cheap
    digest of every weight.

    The config names the vocabulary by path only, and other token ids through the same weights
    are another model: an index built before the file changed must not match after.
    """
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    vocabulary = config.get("features", {}).get("vocabulary")
    if vocabulary:
        digest.update(f"vocabulary={vocabulary_digest(vocabulary)}".encode())
    digest.update(str(step).encode())
    sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32) ** 2), params))
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
        digest.update(f"{jax.tree_util.keystr(path)}={float(value):.9e}".encode())
    return digest.hexdigest()[:16]


LENGTH_BUCKET = 32  # encode batches are cut to a multiple of this many tokens


class DualEncoderInference:
    """Implements the retrieval `Encoder` protocol with a trained (or freshly built) dual encoder."""

    def __init__(self, model: DualEncoder | BertDualEncoder, params: Any, config: dict[str, Any], fingerprint: str,
                 mesh: jax.sharding.Mesh, batch_size: int = 64, vocabulary: Any = None):
        self.model = model
        self.params = params
        self.config = config
        self.features = config.get("features", {})
        self.fingerprint = fingerprint
        self.dim = model.embedding_dim
        self._mesh = mesh
        data_devices = mesh.shape["data"]
        self.batch_size = -(-batch_size // data_devices) * data_devices
        self._vocab = vocabulary
        self._embed = jax.jit(lambda p, tokens, tower: model.apply({"params": p}, tokens, tower=tower),
                              in_shardings=(None, sharding.batch_sharding(mesh, 2)), static_argnums=2)

    @property
    def task_names(self) -> list[str]:
        return sorted(self.features.get("tasks", {}))

    @property
    def training_task_order(self) -> list[str]:
        """Tasks in their training order, where task k's queries use query tower k."""
        tasks = self.features.get("tasks", {})
        if not self.model.config.query_towers:
            return list(tasks)  # the order only matters for choosing a tower
        if any("index" not in spec for spec in tasks.values()):
            raise ValueError("this model's config records no task order (features.tasks.*.index); "
                             "it was written before towers were tracked: retrain or add the indices")
        return sorted(tasks, key=lambda t: tasks[t]["index"])

    @property
    def vocabulary(self) -> Any:
        if self._vocab is None:
            path = self.features.get("vocabulary")
            if not path:
                raise ValueError("this model records no vocabulary path (trained on synthetic token batches?)")
            self._vocab = load_vocabulary(path)  # sentencepiece (T5) or WordPiece (BERT), by the path
        return self._vocab

    def prefix_of(self, task: str) -> str | None:
        tasks = self.features.get("tasks", {})
        if task not in tasks:
            raise KeyError(f"unknown task {task!r}; this model was trained on: {', '.join(sorted(tasks))}")
        return tasks[task]["prefix"]

    def encode_queries(self, texts: Sequence[str], task: str) -> np.ndarray:
        prefix = self.prefix_of(task)
        for i, text in enumerate(texts):
            if not text or not text.strip():
                raise ValueError(f"query {i} is empty")
        strings = [format_query(t, prefix) for t in texts]
        config = self.model.config
        tower = config.query_tower(self.training_task_order.index(task) if config.query_towers else 0)
        return self.encode_tokens(tokenize(self.vocabulary, strings, self.features["query_len"]), tower)

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray:
        template = self.features.get("passage_template", PASSAGE_TEMPLATE)
        strings = [format_passage(p.title, p.text, template) for p in passages]
        return self.encode_tokens(tokenize(self.vocabulary, strings, self.features["passage_len"]))

    def encode_tokens(self, tokens: np.ndarray, tower: int | None = None) -> np.ndarray:
        """[n, length] token ids -> [n, dim] float32, in fixed-size batches sharded over devices.

        Rows are encoded shortest first, each batch cut to its longest row rounded up to a multiple
        of LENGTH_BUCKET: padding is masked, so the embeddings are those of the full width, while
        KB passages (mostly far shorter than `passage_len`) cost ~2x less. At most
        length / LENGTH_BUCKET shapes get compiled. `tower` selects a task's own query encoder
        (models with per-task query towers)."""
        out = np.empty((len(tokens), self.dim), np.float32)
        lengths = token_lengths(tokens)
        order = np.argsort(lengths, kind="stable")
        with jax.set_mesh(self._mesh), nn.logical_axis_rules(sharding.logical_axis_rules()):
            for start in range(0, len(tokens), self.batch_size):
                rows = order[start:start + self.batch_size]
                width = bucketed_width(lengths[rows], tokens.shape[1])
                padded = np.zeros((self.batch_size, width), np.int32)
                padded[:len(rows)] = tokens[rows, :width]
                padded[len(rows):, 0] = 1  # filler rows that are never all-padding (their output is dropped)
                out[rows] = np.asarray(self._embed(self.params, padded, tower))[:len(rows)]
        return out


def token_lengths(tokens: np.ndarray) -> np.ndarray:
    """[n, length] token ids -> [n]: each row's length up to its last non-padding id."""
    return tokens.shape[1] - np.argmax(tokens[:, ::-1] != 0, axis=1)


def bucketed_width(lengths: np.ndarray, max_width: int) -> int:
    """The width a batch of rows with these lengths can be cut to: the longest, rounded up to a
    multiple of LENGTH_BUCKET (padding is masked, so the cut changes no output)."""
    return min(max_width, -(-int(lengths.max()) // LENGTH_BUCKET) * LENGTH_BUCKET)


def check_vocabulary(features: dict[str, Any], checkpoint_dir: str) -> None:
    """Refuses a vocabulary that is missing, or whose content differs from the one the model was
    trained with (its digest, recorded with the features; models trained before it was recorded
    carry none and are not checked)."""
    path, recorded = features.get("vocabulary"), features.get("vocabulary_digest")
    if not path:
        return
    if not os.path.exists(path):
        raise checkpoint.CheckpointError(f"{checkpoint_dir}: the model's vocabulary {path} does not exist")
    current = vocabulary_digest(path)
    if recorded and current != recorded:
        raise checkpoint.CheckpointError(
            f"{checkpoint_dir}: the vocabulary {path} has content digest {current}, but the model was trained "
            f"with digest {recorded}: the file changed since training, and the model's token ids with it")


def load_encoder(checkpoint_dir: str, step: int | None = None, batch_size: int = 64) -> DualEncoderInference:
    """Rebuilds the model from `checkpoint_dir`'s config and restores its parameters (only)."""
    config = checkpoint.read_config(checkpoint_dir)
    check_vocabulary(config.get("features", {}), checkpoint_dir)
    model = build_model(config)
    # This process's devices only: in a multi-process job each process encodes its own texts (its
    # shards of the KB, its queries), different ones and different numbers of them, so an encode
    # step must not be a collective over every process's devices.
    mesh = sharding.make_mesh(devices=jax.local_devices())
    rules = sharding.logical_axis_rules()
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32))["params"])
    shardings = sharding.tree_shardings(mesh, rules, nn.get_partition_spec(boxed))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            nn.unbox(boxed), shardings)
    params, restored_step = checkpoint.restore_params(checkpoint_dir, abstract, step)
    return DualEncoderInference(model, params, config, fingerprint_of(config, params, restored_step), mesh,
                                batch_size)


__all__ = ["DualEncoderInference", "load_encoder", "fingerprint_of", "T5Config"]
