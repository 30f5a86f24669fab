"""Retrieval Tasks are seqio Tasks: the contract they meet and the one helper that registers them.

A retrieval Task is any `seqio.Task` whose examples, after its preprocessors, carry

  "id"          string    unique within a split (joins mined negatives files to examples)
  "query"       int32[n]  token ids in the vocabulary's conventions, ending with its end id
  "positive"    string    a KB passage id (training); "" = none in the KB, the example is skipped
  "positives"   string[p] optional: every positive passage (e.g. one per gold page), which
                          `make_train_iterator.positive_passages = 'cycle'` trains on in turn
  "negatives"   string[m] optional: KB passage ids of hard negatives (a negatives directory wins)
  "gold_pages"  string[g] optional: page ids never drawn as random negatives (and graded in eval)

`add_retrieval_task` builds such a Task over any seqio source (jsonl, TFDS, a function) from text
features: the source and the user's preprocessors produce "id", "query" (text), "positive" and the
optional features; the helper appends the query prefix, tokenisation and truncation to the Task's
query length (`query_inputs.py`), and the end id. The KILT, mini-KILT and demo Tasks (the rows of
`shipped.py`) are registered with it over `kilt_examples_source`, each with its own query length,
the first time a name is looked up (`register_shipped`): no caller imports a module for its
registrations. The helper registers a `RetrievalTask` carrying its `TaskSpec` (dataset, query prefix,
length, truncation, text preprocessors); `describe` returns it, and a plain spec for a seqio Task
registered otherwise.

Evaluation, mining and BM25 negatives read a Task's query *text*: "query" as the Task's tokenising
step receives it, after every preprocessor before that step (what seqio's `tokenize` keeps as
"query_pretokenized", t5x's "inputs_pretokenized"). The tokenising step is the helper's, or seqio's
`tokenize` / `tokenize_and_append_eos` in a Task registered with `seqio.TaskRegistry.add`
(`text_examples`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import gin

from t5_retrieval.data import layout
from t5_retrieval.data.records import read_examples
from t5_retrieval.data.tasks import shipped
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.tokenizers.query_inputs import KEEP_BEGINNING, QueryInput, query_ids
from t5_retrieval.data.tokenizers.tokenize import load_vocabulary, vocabulary_digest
from t5_retrieval.errors import ConfigError, UserError

log = logging.getLogger(__name__)
TEMPERATURE = 4.0
# A Task registered without a query length reads this many tokens: the one length every task had
# before each stated its own.
DEFAULT_QUERY_LEN = 64
_DATA_DIR: list[str] = [os.environ.get("T5R_DATA_DIR", "")]
_VOCABULARY: list[Any] = [""]


@gin.configurable
def set_data_dir(data_dir: str) -> None:
    """Where KILT-source Tasks read `examples/{dataset}-{split}.jsonl` from (as seqio's TFDS
    data_dir override: Tasks are registered at import time, before flags are parsed)."""
    _DATA_DIR[0] = data_dir


def get_data_dir() -> str:
    if not _DATA_DIR[0]:
        raise ConfigError("no data directory: call t5_retrieval.data.tasks.retrieval_tasks.set_data_dir(...) "
                          "(gin: set_data_dir.data_dir) or set T5R_DATA_DIR")
    return _DATA_DIR[0]


@gin.configurable
def vocabulary_path(path: str = "") -> str:
    """The vocabulary file `run_vocabulary()` reads when no run has set one (`use_vocabulary`):
    gin `vocabulary_path.path`, else T5R_VOCAB."""
    return path or os.environ.get("T5R_VOCAB", "")


def use_vocabulary(vocabulary: Any) -> None:
    """Makes `run_vocabulary()` (the KILT Tasks' vocabulary) this one, a path or a vocabulary
    object: training sets the model's."""
    _VOCABULARY[0] = vocabulary


class UnknownTaskError(KeyError, ValueError, UserError):
    """A name that is no registered seqio Task or Mixture, or none of a model's tasks (`task_names`).

    Both a KeyError (a missing key of a registry or of the model's tasks) and a ValueError (a bad
    argument), so the callers that catch either keep working."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ----------------------------------------------------------------------------------------------
# The run's vocabulary


@functools.cache
def _load(path: str) -> Any:
    return load_vocabulary(path)


@functools.cache
def run_vocabulary():
    """A seqio Vocabulary that is whatever `vocabulary_path()` names when used (a sentencepiece
    model or a BERT vocab.txt), so Tasks registered at import time tokenise with the run's model."""
    import seqio

    class _RunVocabulary(seqio.Vocabulary):
        def __init__(self):
            super().__init__(extra_ids=0)

        @staticmethod
        def current() -> Any:
            chosen = _VOCABULARY[0] or vocabulary_path()
            if not chosen:
                raise ConfigError("no vocabulary: set gin vocabulary_path.path or T5R_VOCAB (training sets "
                                  "the model's)")
            return _load(chosen) if isinstance(chosen, str) else chosen

        def __getattr__(self, name: str) -> Any:  # token_conventions, encode_batch, tokenizer
            if name.startswith("__"):
                raise AttributeError(name)
            return getattr(self.current(), name)

        @property
        def eos_id(self):
            return self.current().eos_id

        @property
        def unk_id(self):
            return self.current().unk_id

        @property
        def _base_vocab_size(self) -> int:
            return self.current().vocab_size

        def _encode(self, s):
            return self.current().encode(s)

        def _decode(self, ids):
            return self.current().decode(ids)

        def _encode_tf(self, s):
            return self.current().encode_tf(s)

        def _decode_tf(self, ids):
            return self.current().decode_tf(ids)

        def __eq__(self, other) -> bool:
            return isinstance(other, _RunVocabulary)

        def __hash__(self) -> int:
            return hash(_RunVocabulary)

    return _RunVocabulary()


def vocabulary_identity(vocab: Any) -> str:
    """A content digest of a vocabulary (a Task's must be its model's): its file's, as recorded
    with a model (`tokenize.vocabulary_digest`)."""
    if vocab is run_vocabulary():
        vocab = vocab.current()
    if isinstance(vocab, str):
        return vocabulary_digest(vocab)
    path = getattr(vocab, "vocab_file", None) or getattr(vocab, "sentencepiece_model_file", None)
    if path:
        return vocabulary_digest(path)
    import hashlib

    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# The KILT source and the appended preprocessors (TensorFlow is imported only when a Task is built)


def _string_lists(rows: list[list[str]]):
    import tensorflow as tf

    return tf.ragged.constant(rows, dtype=tf.string, ragged_rank=1) if any(rows) else \
        tf.RaggedTensor.from_row_lengths(tf.constant([], tf.string), [0] * len(rows))


def _kilt_examples(split: str, shuffle_files: bool, seed: int | None = None, *, dataset: str):
    """`<data_dir>/examples/{dataset}-{split}.jsonl` (`t5r data tasks`) as contract text features.

    The file is read (and checked: missing fields, duplicate ids name file and lines) before
    TensorFlow sees it, so its errors reach the user as they are."""
    import tensorflow as tf

    del shuffle_files, seed  # one file, read in order: the batcher shuffles, exactly
    examples = read_examples(layout.examples_path(get_data_dir(), dataset, split))
    features = {
        "id": tf.constant([e.id for e in examples], tf.string),
        "query": tf.constant([e.query for e in examples], tf.string),
        "positive": tf.constant([e.positive_passages[0] if e.positive_passages else "" for e in examples],
                                tf.string),
        "positives": _string_lists([list(e.positive_passages) for e in examples]),
        "gold_pages": _string_lists([sorted({p for s in e.gold_pages for p in s}) for e in examples]),
    }
    return tf.data.Dataset.from_tensor_slices(features)


def kilt_examples_source(dataset: str, num_train: int | None = None, num_dev: int | None = None):
    """A seqio source over the processed KILT examples of `dataset` (train and dev splits).

    `num_train` / `num_dev` are the declared sizes seqio's `mixing_rate_num_examples` reads."""
    import seqio

    class _KiltExamplesSource(seqio.FunctionDataSource):
        def __init__(self):
            sizes = {k: v for k, v in (("train", num_train), ("dev", num_dev)) if v is not None}
            super().__init__(functools.partial(_kilt_examples, dataset=dataset), splits=("train", "dev"),
                             num_input_examples=sizes or None)
            self.dataset = dataset

        def files(self, split: str) -> list[str]:
            return [layout.examples_path(get_data_dir(), dataset, split)]

    return _KiltExamplesSource()


def tokenize_queries(dataset, output_features, sequence_length=None, *, prefix: str | None, query_len: int,
                     truncation: str = KEEP_BEGINNING):
    """Appended preprocessor: query text -> token ids as the model reads them (`query_inputs.query_ids`):
    the query prefix, the vocabulary's conventions (a literal `</s>` becomes the separator id, start
    ids such as BERT's [CLS] go first), cut to the Task's `query_len` by its `truncation`, the end
    id left for `append_eos_after_trim`. A caller's `sequence_length["query"]` (seqio's way to set a
    feature's length) replaces `query_len`."""
    import numpy as np
    import tensorflow as tf

    vocab = output_features["query"].vocabulary
    query = QueryInput(prefix, (sequence_length or {}).get("query") or query_len, truncation)

    def ids(text: tf.Tensor) -> np.ndarray:
        return np.asarray(query_ids(vocab, [text.numpy().decode("utf-8")], query)[0], np.int32)

    def fn(ex):
        tokens = tf.py_function(ids, [ex["query"]], tf.int32)
        tokens.set_shape([None])
        return {**ex, "query": tokens}

    return dataset.map(fn)


def add_retrieval_task(name: str, source: Any, *, preprocessors: Sequence[Callable] = (),
                       prefix: str | None = None, vocabulary: Any = None, query_len: int = DEFAULT_QUERY_LEN,
                       truncation: str = KEEP_BEGINNING) -> Any:
    """Registers (or re-registers) a retrieval Task: `source` -> `preprocessors` -> query prefix,
    tokenisation and truncation -> end id. Returns the `seqio.Task`.

    `source`: any seqio DataSource; with `preprocessors` (seqio preprocessors, run first, on text)
    it must yield "id", "query" (text), "positive" and optionally "negatives" and "gold_pages".
    `prefix`: a TACO prefix name ("FEVER" -> "FEVER <extra_id_1> query"), None for none.
    `vocabulary`: a seqio Vocabulary; default `run_vocabulary()`, the vocabulary of the model trained.
    `query_len`: token ids per query, special tokens included (training's `QUERY_LEN` can replace
    it); `truncation`: "beginning" keeps a long query's start, "mention" a window centred on its
    `[START_ENT] ... [END_ENT]` (entity linking; `query_inputs.py`).

    The keyword form of `register_retrieval_task`: the Task's dataset is its KILT source's, else its name.
    """
    spec = TaskSpec(name, getattr(source, "dataset", name), prefix, query_len, truncation)
    return register_retrieval_task(spec, source, preprocessors=preprocessors, vocabulary=vocabulary)


def register_retrieval_task(spec: TaskSpec, source: Any, *, preprocessors: Sequence[Callable] = (),
                            vocabulary: Any = None) -> Any:
    """Registers (or re-registers) the retrieval Task `spec` states, over `source` and `preprocessors`
    (as `add_retrieval_task`), carrying `spec` with its text preprocessors: the qualified names of
    those of `preprocessors` that run before the query is tokenised. Returns the `RetrievalTask`."""
    import seqio

    from t5_retrieval.data.tasks.retrieval_task import RetrievalTask

    query = spec.query_input()  # refuses a spec without a length or with an unknown truncation now
    steps = list(preprocessors)
    text_steps = _text_steps(steps)
    if text_steps is None:
        text_steps = [s for s in steps if not isinstance(s, seqio.CacheDatasetPlaceholder)]
    stated = tuple(_qualified_name(s) for s in text_steps)
    if spec.text_preprocessors and spec.text_preprocessors != stated:
        raise ValueError(f"retrieval Task {spec.name!r}: its spec names text preprocessors "
                         f"{list(spec.text_preprocessors)}, its preprocessors are {list(stated)}")
    spec = dataclasses.replace(spec, text_preprocessors=stated)
    if spec.name in seqio.TaskRegistry.names():
        seqio.TaskRegistry.remove(spec.name)
    return seqio.TaskRegistry.add(
        spec.name,
        task_cls=RetrievalTask,
        spec=spec,
        source=source,
        preprocessors=[*steps, functools.partial(tokenize_queries, prefix=query.prefix, query_len=query.length,
                                                 truncation=query.truncation),
                       seqio.preprocessors.append_eos_after_trim],
        output_features={"query": seqio.Feature(vocabulary or run_vocabulary(), add_eos=True)},
    )


def add_temperature_mixture(name: str, task_names: Sequence[str], temperature: float = TEMPERATURE) -> Any:
    """A seqio Mixture with rates n^(1/T) of the Tasks' declared train sizes (KILT: T = 4)."""
    import seqio

    if name in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(name)
    return seqio.MixtureRegistry.add(
        name, list(task_names),
        default_rate=functools.partial(seqio.mixing_rate_num_examples, temperature=temperature))


@functools.cache
def register_shipped() -> None:
    """Registers the project's Tasks and Mixtures (`shipped.FAMILIES`), once: each row's Task in every
    variant over its KILT examples, and the variants' Mixtures. A name a module of the user's has
    registered already is left as it is (the user's Task wins, whichever was registered first)."""
    import seqio

    tasks, mixtures = set(seqio.TaskRegistry.names()), set(seqio.MixtureRegistry.names())
    for family, rows in shipped.FAMILIES.items():
        for d in rows:
            assert d.task_type in shipped.TASK_TYPES, d
        for variant in shipped.VARIANTS:
            names = []
            for d in rows:
                spec = d.spec(family, variant)
                if spec.name not in tasks:
                    register_retrieval_task(spec, kilt_examples_source(d.task.dataset, d.num_train, d.num_dev))
                names.append(spec.name)
            for name, members in [(f"{family}{variant}", names),
                                  *((f"{family}{variant}_without_{d.task.dataset}", [n for n in names if n != held_out])
                                    for d, held_out in zip(rows, names))]:
                if name not in mixtures:
                    add_temperature_mixture(name, members)


def registries() -> Any:
    """The `seqio` module, its registries holding the project's Tasks and Mixtures (`register_shipped`)
    beside whatever else is registered: every lookup of a name goes through it."""
    import seqio

    register_shipped()
    return seqio


def describe(task: Any) -> TaskSpec:
    """A registered Task's spec: a `RetrievalTask`'s own; for a plain seqio Task a user registered,
    its dataset (its KILT source's, else its name) and its text preprocessors, with no prefix and no
    query length of its own."""
    spec = getattr(task, "spec", None)
    if isinstance(spec, TaskSpec):
        return spec
    return TaskSpec(task.name, getattr(task.source, "dataset", task.name), None,
                    text_preprocessors=tuple(text_preprocessors(task)))


def _declared_order(mixture: Any) -> list[Any]:
    """A Mixture's Tasks in the order it lists them (sub-Mixtures expanded in place), once each.

    seqio's `Mixture.tasks` sorts by name; the declared order is the order of the step's sub-batches
    and of per-task towers, as the user wrote it."""
    import seqio

    out: list[Any] = []
    for name in mixture.rate_per_task_name:
        if name in seqio.TaskRegistry.names():
            found = [seqio.TaskRegistry.get(name)]
        else:
            found = _declared_order(seqio.MixtureRegistry.get(name))
        out += [t for t in found if t not in out]
    return out


def resolve(names: str | Sequence[str]) -> list[tuple[Any, float]]:
    """(seqio Task, mixing rate) for a registered Mixture or Task name, or a list of Task names.

    A Mixture's rates are its own (`Mixture.get_rate`: numbers, rate functions, any temperature); a
    single Task has rate 1; a list of Task names is mixed as the KILT Mixtures are (n^(1/4))."""
    seqio = registries()

    def get(name: str) -> Any:
        known = [*seqio.MixtureRegistry.names(), *seqio.TaskRegistry.names()]
        if name in known:
            return seqio.get_mixture_or_task(name)
        near = difflib.get_close_matches(name, known, n=5)
        raise UnknownTaskError(
            f"unknown seqio Task or Mixture {name!r}" + (f" (did you mean {', '.join(near)}?)" if near else "")
            + "; register it with seqio (e.g. t5_retrieval.tasks.add_retrieval_task) in a module named by "
              "--gin.MIXTURE_OR_TASK_MODULE")

    # seqio's rate functions warn, per Task, that an uncached Task's rate uses its declared size:
    # that is the rate wanted here (the Task cache is ours, not seqio's).
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        if isinstance(names, str):
            found = get(names)
            if isinstance(found, seqio.Mixture):
                return [(task, float(found.get_rate(task))) for task in _declared_order(found)]
            return [(found, 1.0)]
        rate = functools.partial(seqio.mixing_rate_num_examples, temperature=TEMPERATURE)
        return [(t, float(rate(t))) for t in map(get, names)]
    finally:
        absl_logger.setLevel(level)


def _tokenising_steps() -> tuple[Callable, ...]:
    """The preprocessors that turn a Task's "query" text into token ids: the helper's, and seqio's."""
    import seqio

    return tokenize_queries, seqio.preprocessors.tokenize, seqio.preprocessors.tokenize_and_append_eos


def _step_function(step: Any) -> Any:
    return step.func if isinstance(step, functools.partial) else step


def _text_steps(steps: Sequence[Any]) -> list[Any] | None:
    """The preprocessors among `steps` that run before the query is tokenised (seqio's cache
    placeholder left out), or None when none of them is a tokenising step this module knows."""
    import seqio

    tokenising = _tokenising_steps()
    for i, step in enumerate(steps):
        if _step_function(step) in tokenising:
            return [s for s in steps[:i] if not isinstance(s, seqio.CacheDatasetPlaceholder)]
    return None


def _qualified_name(step: Any) -> str:
    fn = _step_function(step)
    named = fn if hasattr(fn, "__qualname__") else type(fn)  # a function, or a callable object's class
    return f"{named.__module__}.{named.__qualname__}"


def text_preprocessors(task: Any) -> list[str]:
    """The qualified names of the preprocessors that may rewrite `task`'s query text before it is
    tokenised (all of its steps but seqio's end-id ones when it has no known tokenising step)."""
    import seqio

    steps = _text_steps(list(task.preprocessors))
    if steps is None:
        known = {*_tokenising_steps(), seqio.preprocessors.append_eos, seqio.preprocessors.append_eos_after_trim}
        steps = [s for s in task.preprocessors
                 if _step_function(s) not in known and not isinstance(s, seqio.CacheDatasetPlaceholder)]
    return [_qualified_name(step) for step in steps]


def text_examples(task: Any, split: str) -> list[Any]:
    """A Task's `split` as evaluation examples: the query text its tokenising step receives (after
    every preprocessor before it; the model adds the prefix and tokenises it as the Task does), the
    `gold_pages` as alternative gold pages (each one alone is an evidence set), the `positive` as
    its passage.

    For `t5r eval`, `t5r mine` and `t5r data negatives` on a Task that has no KILT examples file,
    and for the query text of a Task whose preprocessors rewrite it."""
    import seqio
    import tensorflow as tf

    from t5_retrieval.data.records import DataError, Example

    steps = _text_steps(list(task.preprocessors))
    if steps is None:
        raise DataError(f"seqio Task {task.name!r}: evaluating it needs its query text, which is \"query\" as the "
                        "Task's tokenising step receives it, and none of its preprocessors is one t5r knows: tokenise "
                        "\"query\" with seqio.preprocessors.tokenize (or register the Task with add_retrieval_task)")
    if split not in task.splits:
        raise DataError(f"seqio Task {task.name!r} has no split {split!r} (it has {list(task.splits)}); "
                        "choose one with --split")
    ds = task.source.get_dataset(split=split, shuffle=False)
    for prep in steps:
        ds = seqio.utils.add_kwargs_to_transform(prep, sequence_length=None, output_features=task.output_features)(ds)
    spec = ds.element_spec.get("query") if isinstance(ds.element_spec, dict) else None
    if spec is None or spec.dtype != tf.string or spec.shape.rank != 0:
        raise DataError(f"seqio Task {task.name!r}: its \"query\" before tokenisation is {spec}, not one text per "
                        "example; its preprocessors must leave the query text in \"query\" (docs/tasks.md)")

    def text(value: Any) -> str:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    out = []
    for ex in ds.as_numpy_iterator():
        pages = tuple(text(p) for p in ex.get("gold_pages", ()))
        positive = text(ex.get("positive", b""))
        out.append(Example(id=text(ex["id"]), task=task.name, query=text(ex["query"]),
                           gold_pages=tuple((p,) for p in pages), positive_passages=(positive,) if positive else ()))
    return out


def registered_task(name: str) -> Any | None:
    """The registered seqio Task `name`, or None. Asking for one of the project's Tasks registers them
    (`register_shipped`); asking for any other name in a process that never imported seqio costs no
    TensorFlow import (none is registered there)."""
    seqio = registries() if name in shipped.task_names() else sys.modules.get("seqio")
    return seqio.TaskRegistry.get(name) if seqio is not None and name in seqio.TaskRegistry.names() else None


def file_or_task(name: str) -> TaskSpec:
    """What a name given to `t5r data negatives` stands for: the registered seqio Task `name`, else
    the dataset whose examples files `<data_dir>/examples/{name}-{split}.jsonl` are, as a spec of its
    own (`examples.split_examples` names what is missing)."""
    task = registered_task(name)
    return describe(task) if task is not None else TaskSpec(name, name, None)
