"""A model directory as one object: text in, embeddings out.

Every command that embeds text (encode, eval, mine, serve, export, fuse, query-side) opens its
model with `load_encoder`, so every stage formats queries
(task prefix, `[SEP]` -> `</s>`), tokenizes, cuts them to their task's length and pads exactly as
training did (`data.query_inputs`): the features recorded with the checkpoint say how. Batches are
sharded over the mesh's data axis; the last partial batch is padded so one compiled shape serves the
whole corpus.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5_retrieval import checkpoint, sharding
from t5_retrieval.data.records import Passage
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.text import PASSAGE_TEMPLATE, format_passage
from t5_retrieval.data.tokenizers.query_inputs import QueryInput, query_tokens
from t5_retrieval.data.tokenizers.tokenize import load_vocabulary, tokenize, vocabulary_digest
from t5_retrieval.errors import ConfigError
from t5_retrieval.models.build import build_model, check_stored_config
from t5_retrieval.retrieval.encoder import Encoder, is_encoder_of
from t5_retrieval.retrieval.index import IndexMismatchError


def fingerprint_of(config: dict[str, Any], params: Any, step: int, vocabulary: str | None) -> str:
    """Identifies a model: its config as stored, the content of its vocabulary (the file at
    `vocabulary`), its checkpoint step and an exact digest of every weight (`weights_digest`).

    The config names the vocabulary by path only, and other token ids through the same weights
    are another model: an index built before the file changed must not match after. A config of
    this version names the path relative to the model directory, so the model keeps its
    fingerprint (and its indexes) when the directory moves; the weights' digest is integer
    arithmetic, so it keeps it on another machine, backend or compiler too.
    """
    digest = _identity_digest(config, step, vocabulary)
    digests = jax.device_get(_weights_digests(params))
    for path, value in jax.tree_util.tree_flatten_with_path(digests)[0]:
        digest.update(f"{jax.tree_util.keystr(path)}#{int(value)}".encode())
    return digest.hexdigest()[:16]


def weights_digest(x: jax.Array) -> jax.Array:
    """uint32: each element's bits times an odd number from its position, summed modulo 2**32.

    A sum of integers is exact in any order, so every backend, sharding and compiler flag set gives
    the same digest. A float sum is not: XLA's reduction order moved the last digit of MiniLM's sum
    of squares between two CPU flag sets, and with it the fingerprint (`legacy_fingerprint_of`).
    The position makes moved weights another digest."""
    unsigned = {2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
        raise ValueError(f"weights_digest: {x.dtype} parameters are not supported (16- or 32-bit only)")
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    position = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)
    return jnp.sum(bits * (2 * position + 1), dtype=jnp.uint32)


@jax.jit
def _weights_digests(params: Any) -> Any:
    """`weights_digest` of every parameter, one program for the tree: each position made where its
    shard is, never a whole array's."""
    return jax.tree.map(weights_digest, params)


def legacy_fingerprint_of(config: dict[str, Any], params: Any, step: int, vocabulary: str | None) -> str:
    """The fingerprint t5-retrieval recorded before `fingerprint_of`'s exact digest: the weights'
    float32 sums of squares to 10 digits, which can differ on another machine or compiler. Only
    for matching what it recorded (`retrieval.encoder.is_encoder_of`) on the machine that did."""
    digest = _identity_digest(config, step, vocabulary)
    sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32) ** 2), params))
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
        digest.update(f"{jax.tree_util.keystr(path)}={float(value):.9e}".encode())
    return digest.hexdigest()[:16]


def _identity_digest(config: dict[str, Any], step: int, vocabulary: str | None) -> hashlib._Hash:
    """The digest of what names a model besides its weights, which both fingerprints continue."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    if vocabulary:
        digest.update(f"vocabulary={vocabulary_digest(vocabulary)}".encode())
    digest.update(str(step).encode())
    return digest


LENGTH_BUCKET = 32  # encode batches are cut to a multiple of this many tokens
# Rows per encode call. On CPU small batches are faster, their activations staying in cache:
# all-MiniLM-L6-v2 over 1,024 KB passages on 2 cores encodes 51.7 passages/s at 16 and 35.1 at 64
# (benchmarks/bench_encode_kb.py). Accelerators need large batches to be busy: 64 per data shard.
# `t5r plan` estimates T5-base's KB encode on v4:2x2x1 (8 shards) at 6,162 passages/s with 64 per
# call (8 per device) and 8,584 with 64 per device; 128 per device gives no more.
CPU_ENCODE_BATCH, ACCELERATOR_ENCODE_BATCH_PER_SHARD = 16, 64


def default_encode_batch(data_shards: int) -> int:
    """Rows per encode call: CPU_ENCODE_BATCH on a CPU, else ACCELERATOR_ENCODE_BATCH_PER_SHARD per data shard."""
    return CPU_ENCODE_BATCH if jax.default_backend() == "cpu" else ACCELERATOR_ENCODE_BATCH_PER_SHARD * data_shards


class DualEncoderInference:
    """Implements the retrieval `Encoder` protocol with a trained (or freshly built) dual encoder."""

    def __init__(self, model: nn.Module, params: Any, config: dict[str, Any], fingerprint: str,
                 mesh: jax.sharding.Mesh, batch_size: int | None = None, vocabulary: Any = None,
                 step: int | None = None, legacy_fingerprint: Callable[[], str] | None = None):
        self.model = model
        self.step = step  # the checkpoint step restored (an unreadable newest one falls back to an older)
        self.params = params
        self.config = config
        self.features = config.get("features", {})
        self.tasks = TaskSet.from_features(self.features)
        self.fingerprint = fingerprint
        self._legacy_fingerprint = legacy_fingerprint
        self.dim = model.embedding_dim
        self._mesh = mesh
        data_devices = mesh.shape["data"]
        batch_size = batch_size or default_encode_batch(data_devices)
        self.batch_size = -(-batch_size // data_devices) * data_devices
        self._vocab = vocabulary
        self._embed = jax.jit(lambda params, tokens, tower: model.apply({"params": params}, tokens, tower=tower),
                              in_shardings=(None, sharding.batch_sharding(mesh, 2)), static_argnums=2)

    @functools.cached_property
    def legacy_fingerprint(self) -> str | None:
        """What older versions recorded for this model (`legacy_fingerprint_of`): a second pass over the
        weights, so computed only when a recorded fingerprint is not the current one."""
        return self._legacy_fingerprint() if self._legacy_fingerprint is not None else None

    @property
    def task_names(self) -> list[str]:
        return sorted(self.tasks)

    @property
    def training_task_order(self) -> list[str]:
        """Tasks in their training order, where task k's queries use query tower k."""
        if not self.model.config.query_towers:
            return list(self.tasks)  # the order only matters for choosing a tower
        order = self.tasks.training_order()
        if order is None:
            raise ConfigError("this model's config records no task order (features.tasks.*.index); "
                              "it was written before towers were tracked: retrain or add the indices")
        return order

    @property
    def vocabulary(self) -> Any:
        if self._vocab is None:
            path = self.features.get("vocabulary")
            if not path:
                raise ConfigError("this model records no vocabulary path (trained on synthetic token batches?)")
            self._vocab = load_vocabulary(path)  # sentencepiece (T5) or WordPiece (BERT), by the path
        return self._vocab

    def prefix_of(self, task: str) -> str | None:
        return self.tasks.spec(task).prefix

    def query_input(self, task: str) -> QueryInput:
        """How `task`'s queries become token ids: its prefix, length and truncation, as trained."""
        return self.tasks.query_input(task)

    def encode_queries(self, texts: Sequence[str], task: str) -> np.ndarray:
        spec = self.tasks.spec(task)  # the one resolution of `task` (any form): its tower and inputs follow
        for i, text in enumerate(texts):
            if not text or not text.strip():
                raise ValueError(f"query {i} is empty")
        config = self.model.config
        tower = config.query_tower(self.training_task_order.index(spec.name) if config.query_towers else 0)
        return self.encode_tokens(query_tokens(self.vocabulary, texts, spec.query_input()), tower)

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


def load_encoder(model_dir: str, step: int | None = None, batch_size: int | None = None
                 ) -> DualEncoderInference | QuerySideEncoder:
    """The one way to open a model directory the project writes, as a retrieval `Encoder`.

    A trained (or imported, e.g. MiniLM) model is rebuilt from its stored config with its
    parameters restored; a query-side model (`t5r query-side`, or `t5r train` over stored passage
    embeddings) encodes queries with its own weights and passages with its base model's.
    """
    if not checkpoint.is_query_side_dir(model_dir):
        return load_dual_encoder(model_dir, step, batch_size)
    if step is not None:
        raise ConfigError(f"step={step}: {model_dir} is a query-side model; it is used at its latest step")
    record, base_dir = checkpoint.query_side_base(model_dir)
    base = load_encoder(base_dir, batch_size=batch_size)
    if not is_encoder_of(base, record["base_fingerprint"]):
        raise IndexMismatchError(f"{model_dir}/{checkpoint.QUERY_SIDE_FILE}: base checkpoint {base_dir} now "
                                 f"has fingerprint {base.fingerprint!r}, fine-tuned against {record['base_fingerprint']!r}")
    return QuerySideEncoder(load_dual_encoder(model_dir, batch_size=batch_size), base)


def stored_config(model_dir: str) -> dict[str, Any]:
    """The model config `model_dir` stores, verified against its newest checkpoint's record and
    checked readable by this version, before any weight is read."""
    stored = checkpoint.read_config(model_dir)
    check_stored_config(stored, os.path.join(model_dir, checkpoint.CONFIG_FILE))
    return stored


def load_dual_encoder(model_dir: str, step: int | None = None, batch_size: int | None = None
                      ) -> DualEncoderInference:
    """A model directory's own network and parameters (what training, export and analysis need);
    retrieval uses `load_encoder`, which also resolves a query-side model's passage encoder."""
    stored = stored_config(model_dir)
    config = checkpoint.located_config(model_dir, stored)  # its vocabulary checked, by a path that opens from here
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
    params, restored_step = checkpoint.restore_params(model_dir, abstract, step)
    vocabulary = config.get("features", {}).get("vocabulary")
    return DualEncoderInference(model, params, config, fingerprint_of(stored, params, restored_step, vocabulary),
                                mesh, batch_size, step=restored_step,
                                legacy_fingerprint=functools.partial(legacy_fingerprint_of, stored, params, restored_step,
                                                                     vocabulary))


class QuerySideEncoder:
    """Queries through the fine-tuned model, passages through its frozen base (the `Encoder` protocol).

    `fingerprint` is the base's: the embedding space, and so the index it may search, is the base's.
    """

    def __init__(self, query_encoder: DualEncoderInference, passage_encoder: Encoder):
        self.query_encoder = query_encoder
        self.passage_encoder = passage_encoder
        self.step = passage_encoder.step  # the step whose passage embeddings this gives

    @property
    def fingerprint(self) -> str:
        return self.passage_encoder.fingerprint

    @property
    def legacy_fingerprint(self) -> str | None:
        return getattr(self.passage_encoder, "legacy_fingerprint", None)

    @property
    def dim(self) -> int:
        return self.passage_encoder.dim

    @property
    def features(self) -> dict[str, Any]:
        """How queries become model inputs (tasks, prefixes, lengths): the fine-tuned model's."""
        return self.query_encoder.features

    @property
    def task_names(self) -> list[str]:
        return self.query_encoder.task_names

    @property
    def tasks(self) -> TaskSet:
        return self.query_encoder.tasks

    def encode_queries(self, texts: Sequence[str], task: str) -> np.ndarray:
        return self.query_encoder.encode_queries(texts, task)

    def encode_passages(self, passages: Sequence[Passage]) -> np.ndarray:
        return self.passage_encoder.encode_passages(passages)


__all__ = ["DualEncoderInference", "QuerySideEncoder", "load_encoder", "load_dual_encoder", "stored_config",
           "fingerprint_of"]
