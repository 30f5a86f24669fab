"""One TF SavedModel for serving: query preprocessing, the query encoder and the ScaNN searcher.

    search(query: string[n], k: int32, task: string[n]) -> passage_ids, page_ids, titles: string[n, k],
                                                            scores: float32[n, k]
    encode(query: string[n], task: string[n]) -> embeddings: float32[n, dim]

Every model `t5r train` writes is exported: T5 and BERT (MiniLM) families, one network or
per-task query towers or a separate query encoder, and query-side models (a fine-tuned query
encoder over its base's stored passage embeddings: the SavedModel holds the query encoder, and the
index, built from the base's embeddings, holds the passages).

- Preprocessing is `export.preprocess` (TF ops, each query at its task's length and truncation)
  with the model's own tokenizer as TF ops: sentencepiece (`tensorflow_text.SentencepieceTokenizer`)
  for T5, WordPiece (`export.wordpiece_tf`) for BERT; token ids equal to the Python path's.
- The encoder is the Flax model converted with `jax.experimental.jax2tf` (native serialization:
  the StableHLO module runs in TF's `XlaCallModule` op, lowered for CPU; the batch dimension is
  shape-polymorphic, the length fixed to the longest task's query length). Weights are SavedModel
  variables. Models with per-task query towers run every tower and keep each row's own.
- The searcher is the index's own serialized ScaNN searcher, loaded by ScaNN's TF ops
  (`export.scann_tf`); passage ids, page ids and titles come from row-keyed lookup tables
  initialised from asset files. An index of another backend (`t5r index --backend=exact`) is
  refused: the graph holds ScaNN's searcher, not the index's Python code.
- Provenance travels as assets: `t5r_export.json` (model fingerprint, each task's `TaskSpec`
  record, the tokenizer, the index manifest), the index's `index.json`, the model's
  `model_config.json` and the vocabulary files. `export_savedmodel` refuses a model and an index
  that do not belong together (different fingerprint or dimension) and an index whose passage ids
  are not the KB's.
- Nothing in it names a path of the exporting machine (`export.portable`): manifests keep a path's
  last component, the sentencepiece file loses its trainer's paths, lookup tables get names of
  their own rather than TF's default (their source file's path), and the encoder's StableHLO
  locations name source files without their directories.

Unknown task names, empty queries and k < 1 fail inside the graph with InvalidArgumentError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow as tf

from t5_retrieval import checkpoint
from t5_retrieval.artefact_io import replaced_on_success
from t5_retrieval.data.records import DataError
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.kb import PassageStore
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.tokenizers.conventions import TokenConventions, conventions_of
from t5_retrieval.data.tokenizers.query_inputs import MENTION_WINDOW
from t5_retrieval.data.tokenizers.tokenize import vocabulary_files
from t5_retrieval.data.tokenizers.wordpiece import WordPieceVocabulary
from t5_retrieval.errors import UserError
from t5_retrieval.export import portable, preprocess
from t5_retrieval.export.scann_tf import ScannSearcher
from t5_retrieval.inference import DualEncoderInference, QuerySideEncoder
from t5_retrieval.models.build import apply_params
from t5_retrieval.models.families import family_of
from t5_retrieval.retrieval.index import INDEX_JSON, load_index
from t5_retrieval.retrieval.scann_index import SCANN_DIR, ScannIndex

FORMAT = "t5r-savedmodel-v2"
EXPORT_JSON = "t5r_export.json"

log = logging.getLogger(__name__)


class _RowsInitializer(tf.lookup.TextFileInitializer):
    """Line number (= index row) -> that line of a file, in a table named `shared_name`: TF's default
    name spells out the file's path at export time, which the SavedModel would then carry."""

    def __init__(self, path: str, shared_name: str):
        super().__init__(path, tf.int64, tf.lookup.TextFileIndex.LINE_NUMBER, tf.string,
                         tf.lookup.TextFileIndex.WHOLE_LINE)
        self._table_shared_name = shared_name

    @property
    def _shared_name(self) -> str:
        return self._table_shared_name


def _write_lines(path: str, values: list[str], field: str) -> str:
    for row, value in enumerate(values):
        if "\n" in value or "\r" in value:
            raise DataError(f"passage row {row}: {field} {value!r} contains a line break; "
                            "it cannot be stored in a line-per-row lookup asset")
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{v}\n" for v in values)
    return path


def query_network(encoder: DualEncoderInference | QuerySideEncoder) -> DualEncoderInference:
    """The network that embeds `encoder`'s queries: its own, or a query-side model's fine-tuned one."""
    return encoder.query_encoder if isinstance(encoder, QuerySideEncoder) else encoder


def sentencepiece_without_paths(model: bytes) -> bytes:
    """A serialized sentencepiece model without its trainer's file paths (`trainer_spec.input` and
    `.model_prefix`: files of the machine that trained it, which play no part in tokenising)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString(model)  # type: ignore[attr-defined]  # generated protobuf class
    del proto.trainer_spec.input[:]
    proto.trainer_spec.ClearField("model_prefix")
    return proto.SerializeToString()


@dataclasses.dataclass(frozen=True)
class QueryTokenizer:
    """The model's tokenizer as TF ops, its special tokens, and the vocabulary files the export ships."""

    tokenizer: Any          # tokenize(string[n]) -> int[n, (ids)]
    conventions: TokenConventions
    files: list[str]        # in the staging directory or the model directory; shipped under their names
    record: dict[str, Any]  # what t5r_export.json says about it


def query_tokenizer(network: DualEncoderInference, staging: str) -> QueryTokenizer:
    """Sentencepiece for a T5 model (seqio's model bytes: the `.model` file plus the `<extra_id_*>`
    pieces the Python path uses), WordPiece for a BERT one."""
    vocabulary, path = network.vocabulary, network.features["vocabulary"]
    if isinstance(vocabulary, WordPieceVocabulary):
        from t5_retrieval.export.wordpiece_tf import WordPieceTokenizer

        files = vocabulary_files(path)
        return QueryTokenizer(WordPieceTokenizer(vocabulary), conventions_of(vocabulary), files,
                              {"kind": "wordpiece", "lower_case": vocabulary.lower_case,
                               "files": [os.path.basename(f) for f in files]})
    import tensorflow_text as tf_text

    shipped = os.path.join(staging, os.path.basename(path))
    with open(path, "rb") as f, open(shipped, "wb") as out:
        out.write(sentencepiece_without_paths(f.read()))
    return QueryTokenizer(tf_text.SentencepieceTokenizer(model=sentencepiece_without_paths(vocabulary.sp_model)),
                          conventions_of(vocabulary), [shipped],
                          {"kind": "sentencepiece", "extra_ids": vocabulary.extra_ids,
                           "files": [os.path.basename(shipped)]})


@contextlib.contextmanager
def locations_without_directories() -> Iterator[None]:
    """JAX lowers with every source file's full path in the StableHLO locations (the repository's,
    the virtualenv's); inside this, only their names."""
    previous = jax.config.jax_hlo_source_file_canonicalization_regex  # type: ignore[attr-defined]  # set at run time
    jax.config.update("jax_hlo_source_file_canonicalization_regex", r".*/")
    try:
        yield
    finally:
        jax.config.update("jax_hlo_source_file_canonicalization_regex", previous)


def _jax_embed(network: DualEncoderInference):
    """(params, tokens int32[b, l], towers int32[b]) -> float32[b, dim] as a JAX function."""
    model, config = network.model, network.model.config
    towers = config.query_towers

    def embed(params: Any, tokens: jax.Array, tower_ids: jax.Array) -> jax.Array:
        if not towers:  # one encoder for every task's queries: the shared one or the separate query tower
            return apply_params(model, params, tokens, tower=config.query_tower(0))
        every = jnp.stack([apply_params(model, params, tokens, tower=k) for k in range(towers)])
        return jnp.take_along_axis(every, tower_ids[None, :, None], axis=0)[0]

    return embed


def task_lookup(tasks: TaskSet, order: Sequence[str]) -> tuple[list[str], list[int]]:
    """(name, position in `order`) for every name a query's task may have: each task's registered
    name and, where no other task reads it, its dataset (`TaskSet.aliases`)."""
    aliases = tasks.aliases()
    names = [*order, *(name for name in aliases if name not in order)]
    return names, [order.index(aliases[name]) for name in names]


class RetrievalModule(tf.Module):
    """What the SavedModel holds: tables, tokenizer, weights, converted encoder, searcher, assets.

    `network` embeds the queries (a query-side model's query encoder); `index` holds the passages."""

    def __init__(self, network: DualEncoderInference, index: ScannIndex, index_dir: str, store: PassageStore,
                 staging: str, tokenizer: QueryTokenizer | None = None):
        super().__init__()
        from jax.experimental import jax2tf

        tokenizer = tokenizer or query_tokenizer(network, staging)
        # The query tower of a task is its position here, as in `DualEncoderInference.encode_queries`.
        self._task_names = network.training_task_order
        queries = [network.tasks.query_input(t) for t in self._task_names]
        prefixes = preprocess.prefix_strings([q.prefix for q in queries])
        self._query_lens = tf.constant([q.length for q in queries], tf.int32)
        self._mention = tf.constant([q.truncation == MENTION_WINDOW for q in queries])
        self._query_len = max(q.length for q in queries)
        self._num_passages = len(index)
        self._reorder = index.config.reorder_num_neighbors if index.config.reorders else -1
        names, positions = task_lookup(network.tasks, self._task_names)
        self._task_table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(names, tf.constant(positions, dtype=tf.int32)), default_value=-1)
        self._prefixes = tf.constant(prefixes)
        self._tokenizer = tokenizer.tokenizer
        self._conventions = tokenizer.conventions
        self._params = jax.tree.map(lambda x: tf.Variable(np.asarray(x), trainable=False),
                                    jax.device_get(network.params))
        converted = jax2tf.convert(_jax_embed(network), polymorphic_shapes=[None, "(b, _)", "(b,)"],
                                   with_gradient=False)
        # One traced (and lowered) encoder shared by both signatures.
        self._embed = tf.function(lambda tokens, task_ids: converted(self._params, tokens, task_ids),
                                  autograph=False, input_signature=[
                                      tf.TensorSpec([None, self._query_len], tf.int32, name="tokens"),
                                      tf.TensorSpec([None], tf.int32, name="task_ids")])
        self._searcher = ScannSearcher(os.path.join(index_dir, SCANN_DIR))
        passages = [store.get(pid) for pid in index.passage_ids]
        tables = f"t5r_{uuid.uuid4().hex}"  # unique to this export, as ScaNN's searcher's name
        self._passage_ids = self._row_table(os.path.join(index_dir, embedding_store.IDS_FILE), f"{tables}_passage_ids")
        self._page_ids = self._row_table(_write_lines(os.path.join(staging, "page_ids.txt"),
                                                      [p.wikipedia_id for p in passages], "page id"),
                                         f"{tables}_page_ids")
        self._titles = self._row_table(_write_lines(os.path.join(staging, "titles.txt"), [p.title for p in passages],
                                                    "title"), f"{tables}_titles")
        self.assets = {"export": tf.saved_model.Asset(os.path.join(staging, EXPORT_JSON)),
                       "index": tf.saved_model.Asset(os.path.join(staging, INDEX_JSON)),
                       "model_config": tf.saved_model.Asset(os.path.join(staging, checkpoint.CONFIG_FILE)),
                       **{f"vocabulary_{i}": tf.saved_model.Asset(f) for i, f in enumerate(tokenizer.files)}}

    @staticmethod
    def _row_table(path: str, shared_name: str) -> tf.lookup.StaticHashTable:
        """Line number (= index row) -> that line of `path` (an asset of the SavedModel)."""
        return tf.lookup.StaticHashTable(_RowsInitializer(path, shared_name), default_value="")

    def _tokens(self, query: tf.Tensor, task: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(token ids int32[n, longest query_len], task indices int32[n]) with the graph's input checks."""
        task_ids = self._task_table.lookup(task)
        unknown = task_ids < 0
        text = preprocess.normalize_queries(query)
        checks = [
            tf.debugging.assert_equal(tf.size(query), tf.size(task),
                                      message="'query' and 'task' must have the same number of entries"),
            tf.debugging.Assert(tf.logical_not(tf.reduce_any(unknown)),
                                ["unknown task(s):", tf.boolean_mask(task, unknown), "known tasks:",
                                 tf.constant(self._task_names)], summarize=10),
            tf.debugging.Assert(tf.reduce_all(tf.strings.length(text) > 0),
                                ["empty query at position(s):", tf.where(tf.strings.length(text) == 0)[:, 0]],
                                summarize=10),
        ]
        with tf.control_dependencies(checks):
            tokens = preprocess.tokenize_queries(self._tokenizer, tf.gather(self._prefixes, task_ids), text,
                                                 tf.gather(self._query_lens, task_ids),
                                                 tf.gather(self._mention, task_ids), self._query_len,
                                                 self._conventions)
            return tokens, tf.identity(task_ids)

    # One function for both signatures: `tf.saved_model.save` traces each signature, and the query
    # preprocessing (thousands of graph ops: tokenizer, ragged slicing, their checks) is most of the
    # tracing time; as a function with an input signature it is traced once and called by both.
    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.string, name="query"),
                                  tf.TensorSpec([None], tf.string, name="task")])
    def _embeddings(self, query: tf.Tensor, task: tf.Tensor) -> tf.Tensor:
        tokens, task_ids = self._tokens(query, task)
        return self._embed(tokens, task_ids)

    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.string, name="query"),
                                  tf.TensorSpec([None], tf.string, name="task")])
    def encode(self, query: tf.Tensor, task: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"embeddings": self._embeddings(query, task)}

    # Inputs in the order of every search (queries, k, task); a signature is called by input name.
    @tf.function(autograph=False, input_signature=[tf.TensorSpec([None], tf.string, name="query"),
                                  tf.TensorSpec([], tf.int32, name="k"),
                                  tf.TensorSpec([None], tf.string, name="task")])
    def search(self, query: tf.Tensor, k: tf.Tensor, task: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([tf.debugging.assert_positive(k, message="k must be >= 1")]):
            k = tf.minimum(k, self._num_passages)
        pre_reorder = tf.maximum(k, self._reorder) if self._reorder > 0 else tf.constant(-1)
        rows, scores = self._searcher.search(self._embeddings(query, task), k, pre_reorder)
        rows = tf.cast(rows, tf.int64)
        found = tf.logical_not(tf.math.is_nan(scores))  # ScaNN pads short result lists with NaN scores.

        def lookup(table: tf.lookup.StaticHashTable) -> tf.Tensor:
            return tf.where(found, table.lookup(rows), "")

        return {"passage_ids": lookup(self._passage_ids), "page_ids": lookup(self._page_ids),
                "titles": lookup(self._titles), "scores": scores}


def export_savedmodel(encoder: DualEncoderInference | QuerySideEncoder, index_dir: str, store: PassageStore,
                      output_dir: str) -> dict[str, Any]:
    """Writes the SavedModel to `output_dir` (which must not exist); returns what t5r_export.json records.

    `encoder` is `inference.load_encoder`'s: a model's own network, or a query-side model (its
    query encoder is exported; `index_dir` is its base's index). Raises IndexMismatchError when the
    index was built by another model or for another KB, and UserError for an index of another
    backend than ScaNN.
    """
    if os.path.exists(output_dir):
        raise FileExistsError(f"{output_dir}: already exists; export into a new directory "
                              "(TF Serving reads numbered versions: <model>/1, <model>/2, ...)")
    index = load_index(index_dir)
    if not isinstance(index, ScannIndex):
        raise UserError(f"{index_dir}: an index of backend {index.backend!r}; the SavedModel embeds a ScaNN "
                        "searcher: build one with `t5r index --backend=scann` (ScannConfig.mode='brute_force' "
                        "is exact)")
    index.check(encoder, store.ids())
    network = query_network(encoder)
    with open(os.path.join(index_dir, INDEX_JSON), encoding="utf-8") as f:
        index_manifest = portable.without_paths(json.load(f))
    order = network.training_task_order
    record = {"format": FORMAT, "fingerprint": encoder.fingerprint, "dim": encoder.dim,
              "family": family_of(network.config).name,
              # A query-side model: the fine-tuned query network (this fingerprint) over its base's
              # passage embeddings (the index's fingerprint, above).
              "query_network": {"fingerprint": network.fingerprint, "query_side": network is not encoder},
              "query_len": max(network.tasks.query_input(t).length for t in order),
              # Each task's TaskSpec record (`TaskSpec.to_record`), in the order of its query tower.
              "tasks": {t: network.tasks.spec(t).to_record() for t in order},
              "task_aliases": {alias: task for alias, task in network.tasks.aliases().items() if alias != task},
              "encoder": {"converter": "jax2tf", "serialization": "native (StableHLO in XlaCallModule)",
                          "platforms": ["cpu"], "polymorphic_batch": True},
              "index": index_manifest}
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    with (tempfile.TemporaryDirectory(prefix="t5r-export-", ignore_cleanup_errors=True) as staging,
          replaced_on_success(os.path.abspath(output_dir)) as partial,  # replaces an empty output_dir
          locations_without_directories()):
        tokenizer = query_tokenizer(network, staging)
        record["tokenizer"] = tokenizer.record
        vocabulary = tokenizer.files[0]
        with open(os.path.join(staging, EXPORT_JSON), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(staging, INDEX_JSON), "w", encoding="utf-8") as f:
            json.dump(index_manifest, f, indent=1)
        with open(os.path.join(staging, checkpoint.CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(portable.portable_config(network.config, f"assets/{os.path.basename(vocabulary)}"), f,
                      indent=1, sort_keys=True)
        start = time.time()
        module = RetrievalModule(network, index, index_dir, store, staging, tokenizer)
        tf.saved_model.save(module, partial, signatures={"search": module.search, "encode": module.encode,
                                                         "serving_default": module.search})
        portable.finish(partial)  # `t5r checksum <dir>` verifies a copy before TF Serving loads it
    log.info("export: wrote %s in %.1fs", output_dir, time.time() - start)
    return record
