"""Declaring KILT-style retrieval tasks: one call registers a seqio Task and remembers its spec.

`tasks/` calls `register_kilt_task` / `register_mixture` with names, prefixes and sizes only; the
functions the Tasks run (source, query formatting, tokenisation) live here. The spec side table is
what the numpy batcher (`batches.py`) reads, so seqio and the batcher format queries identically.
Processed examples are found under a data directory set with `set_data_dir` (like seqio's TFDS
data_dir override), because registration happens at import time, before flags are parsed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import gin

from t5_retrieval.data import layout
from t5_retrieval.data.records import read_jsonl
from t5_retrieval.data.text import format_query
from t5_retrieval.data.tokenize import conventions_of

TEMPERATURE = 4.0
TASK_TYPES = ("QA", "FC", "SF", "EL", "DIAL")


@dataclasses.dataclass(frozen=True)
class KiltTaskSpec:
    """What a registered task is: which processed files, which query prefix, how many examples."""

    name: str                      # registered seqio name, e.g. "mini_kilt_fever"
    dataset: str                   # file stem under <data_dir>/examples/, e.g. "fever"
    prefix: str | None             # prefix name ("FEVER" -> "FEVER <extra_id_1> ...") or None
    num_train: int                 # declared train size (mixture rates)
    num_dev: int


TASK_SPECS: dict[str, KiltTaskSpec] = {}
MIXTURES: dict[str, tuple[str, ...]] = {}
_DATA_DIR: list[str] = [os.environ.get("T5R_DATA_DIR", "")]


@gin.configurable
def set_data_dir(data_dir: str) -> None:
    """Where registered tasks read `examples/{dataset}-{split}.jsonl` from."""
    _DATA_DIR[0] = data_dir


def get_data_dir() -> str:
    if not _DATA_DIR[0]:
        raise ValueError("no data directory: call t5_retrieval.data.registry.set_data_dir(...) "
                         "(gin: set_data_dir.data_dir) or set T5R_DATA_DIR")
    return _DATA_DIR[0]


def known_names() -> list[str]:
    return sorted([*TASK_SPECS, *MIXTURES])


def resolve(names: str | Sequence[str]) -> list[KiltTaskSpec]:
    """Task specs for a mixture name, a task name, or a list of task names (mixture order kept)."""
    if isinstance(names, str):
        names = MIXTURES.get(names, (names,))
    specs = []
    for name in names:
        if name not in TASK_SPECS:
            raise KeyError(f"unknown task or mixture {name!r}; known: {', '.join(known_names())}")
        specs.append(TASK_SPECS[name])
    return specs


# ----------------------------------------------------------------------------------------------
# seqio functions (TensorFlow is imported only when a seqio Task is registered or built)


def _examples_dataset(split: str, shuffle_files: bool, seed: int | None = None, *, dataset: str):
    """seqio source: processed examples -> {"id", "query", "positive"} strings (positive may be "")."""
    import tensorflow as tf

    path = layout.examples_path(get_data_dir(), dataset, split)

    def rows():
        for _, row in read_jsonl(path):
            positives = row.get("positive_passages") or [""]
            yield {"id": str(row["id"]), "query": str(row["query"]), "positive": str(positives[0])}

    spec = {k: tf.TensorSpec((), tf.string) for k in ("id", "query", "positive")}
    return tf.data.Dataset.from_generator(rows, output_signature=spec)


def format_queries(dataset, prefix: str | None):
    """seqio preprocessor: KILT input -> `"{PREFIX} <extra_id_1> {normalised query}"` (text.format_query)."""
    import tensorflow as tf

    def fn(ex):
        text = tf.py_function(lambda q: format_query(q.numpy().decode("utf-8"), prefix), [ex["query"]], tf.string)
        text.set_shape(())
        return {**ex, "query": text}

    return dataset.map(fn)


def tokenize_queries(dataset, output_features):
    """seqio preprocessor: tokenises "query" in the vocabulary's conventions (`tokenize.py`): each
    literal `</s>` becomes the separator id (T5: EOS, BERT: [SEP]) and start ids (BERT: [CLS]) go
    first; the end id is the vocabulary's `eos_id`, appended by `append_eos_after_trim`."""
    import tensorflow as tf

    vocab = output_features["query"].vocabulary
    conventions = conventions_of(vocab)

    def fn(ex):
        segments = tf.strings.split(ex["query"], sep="</s>")
        ids = tf.cast(vocab.encode_tf(segments), tf.int32)
        n = tf.shape(segments, out_type=tf.int64)[0]
        eos_lengths = tf.concat([tf.ones([n - 1], tf.int64), tf.zeros([1], tf.int64)], 0)
        eos = tf.RaggedTensor.from_row_lengths(tf.fill([n - 1], conventions.separator_id), eos_lengths)
        query = tf.concat([ids, eos], axis=1).flat_values
        if conventions.start_ids:
            query = tf.concat([tf.constant(conventions.start_ids, tf.int32), query], axis=0)
        return {**ex, "query": query}

    return dataset.map(fn)


def register_kilt_task(name: str, dataset: str, prefix: str | None, num_train: int, num_dev: int,
                       vocabulary=None) -> KiltTaskSpec:
    """Registers one seqio Task (and its spec); the vocabulary defaults to `vocabulary_path()`."""
    import seqio

    spec = KiltTaskSpec(name, dataset, prefix, num_train, num_dev)
    TASK_SPECS[name] = spec
    if name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(functools.partial(_examples_dataset, dataset=dataset),
                                        splits=("train", "dev"),
                                        num_input_examples={"train": num_train, "dev": num_dev}),
        preprocessors=[functools.partial(format_queries, prefix=prefix), tokenize_queries,
                       seqio.preprocessors.append_eos_after_trim],
        output_features={"query": seqio.Feature(vocabulary or _default_vocabulary(), add_eos=True)},
    )
    return spec


def register_mixture(name: str, task_names: Sequence[str], temperature: float = TEMPERATURE) -> None:
    """A seqio Mixture with rates n^(1/T) from the tasks' declared num_input_examples."""
    import seqio

    MIXTURES[name] = tuple(task_names)
    if name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(name)
    seqio.MixtureRegistry.add(
        name, list(task_names),
        default_rate=functools.partial(seqio.mixing_rate_num_examples, temperature=temperature))


@gin.configurable
def vocabulary_path(path: str = "") -> str:
    """The sentencepiece model tasks tokenise with (gin: vocabulary_path.path, or T5R_VOCAB)."""
    return path or os.environ.get("T5R_VOCAB", "")


@functools.cache
def _default_vocabulary():
    """A SentencePieceVocabulary whose model path is read from `vocabulary_path()` at first use,
    so that registering tasks at import time does not fix the vocabulary before gin is parsed."""
    import seqio

    class ConfiguredVocabulary(seqio.SentencePieceVocabulary):
        @property
        def _sentencepiece_model_file(self) -> str:
            path = vocabulary_path()
            if not path:
                raise ValueError("no sentencepiece model: set gin vocabulary_path.path or T5R_VOCAB "
                                 "(or train one with `t5r vocab train`)")
            return path

        @_sentencepiece_model_file.setter
        def _sentencepiece_model_file(self, value: str) -> None:
            del value  # the path is always read from vocabulary_path()

    return ConfiguredVocabulary("", extra_ids=100)
