"""A retrieval Task's preprocessed examples, read once through seqio and cached as numpy.

Training batches must be a pure function of (seed, step) so that a resumed run continues exactly.
A tf.data pipeline's position cannot be saved cheaply, so each Task's split is run through its seqio
source and preprocessors once, in order, and kept as arrays; the batcher then indexes them.

The cache file is named by a digest of everything that decides its content: the Task's name and
split, its source (type, functions' code, arguments, and the size and mtime of the files it lists),
its preprocessors (functions' code, closures, arguments: a helper Task's query length and truncation
among them), the query length the caller sets and its vocabulary's content. Changing any
of them (a preprocessor's code included) makes a new file; a source whose data changes behind an
unchanged function is the one case to clear by hand (delete `<cache_dir>/<task>/`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import types
from typing import Any

import numpy as np

from t5_retrieval.artefact_io import remove_stale_temporaries, replaced_on_success
from t5_retrieval.data.records import DataError
from t5_retrieval.data.tasks.retrieval_tasks import vocabulary_identity

FORMAT_VERSION = 2  # 2: every positive passage of an example ("positives"), not only the first
REQUIRED_FEATURES = ("id", "query", "positive")
log = logging.getLogger(__name__)


@dataclasses.dataclass
class TaskExamples:
    """One split of a Task as the batcher needs it, in the source's order."""

    ids: list[str]
    queries: list[np.ndarray]                      # int32 token ids, ending with the end id
    positives: list[str]                           # KB passage id, "" = none
    negatives: list[tuple[str, ...]] | None        # None when the Task has no "negatives" feature
    gold_pages: list[tuple[str, ...]]
    # Every positive passage, the first being `positives[i]` (one per gold page, e.g. HotpotQA's two);
    # (positives[i],) for a Task without the optional "positives" feature.
    all_positives: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_positives:
            self.all_positives = [(p,) if p else () for p in self.positives]

    def __len__(self) -> int:
        return len(self.ids)


# ----------------------------------------------------------------------------------------------
# What decides a Task's content


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _const(c: Any) -> Any:
    if isinstance(c, types.CodeType):
        return _code(c)
    if isinstance(c, frozenset):  # `x in {"a", "b"}`: its repr's order varies with string hashing
        return sorted(repr(x) for x in c)
    return repr(c)


def _code(code: types.CodeType) -> list[Any]:
    return [code.co_code.hex(), [_const(c) for c in code.co_consts], list(code.co_names)]


def describe(obj: Any) -> Any:
    """A JSON-able description of a source, preprocessor or argument that changes when its code or
    arguments do (and not between processes, unlike `repr` of functions)."""
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, (list, tuple)):
        return [describe(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): describe(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, functools.partial):
        return {"partial": describe(obj.func), "args": describe(obj.args), "keywords": describe(obj.keywords)}
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = obj.__func__ if isinstance(obj, types.MethodType) else obj
        closure = [describe(c.cell_contents) for c in fn.__closure__ or () if _has_contents(c)]
        return {"function": f"{fn.__module__}.{fn.__qualname__}", "code": _code(fn.__code__),
                "defaults": describe(fn.__defaults__), "closure": closure}
    if isinstance(obj, type):
        return {"class": f"{obj.__module__}.{obj.__qualname__}"}
    return {"object": f"{type(obj).__module__}.{type(obj).__qualname__}", "repr": _ADDRESS.sub("", repr(obj))}


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018  (reading an empty cell raises ValueError)
    except ValueError:
        return False
    return True


def _source_files(source: Any, split: str) -> list[str]:
    import seqio

    if hasattr(source, "files"):
        return list(source.files(split))
    if isinstance(source, seqio.FileDataSource):
        return list(source.list_shards(split))
    return []


def _file_identity(path: str) -> Any:
    try:
        st = os.stat(path)
    except OSError:
        return [path, "missing"]
    return [os.path.abspath(path), st.st_size, st.st_mtime_ns]


def fingerprint(task: Any, split: str, query_len: int | None = None) -> str:
    """16 hex digits of the digest of what decides `task`'s examples of `split` (read with `query_len`)."""
    source = task.source
    state = {k: v for k, v in vars(source).items() if k not in ("_caching_permitted",)}
    description = {
        "format": FORMAT_VERSION, "task": task.name, "split": split,
        "source": {"class": describe(type(source)), "state": describe(state),
                   "files": [_file_identity(p) for p in _source_files(source, split)]},
        "preprocessors": describe(list(task.preprocessors)),
        "vocabulary": vocabulary_identity(task.output_features["query"].vocabulary),
    }
    if query_len is not None:  # the caller's sequence_length["query"]
        description["query_len"] = query_len
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Reading through seqio


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.atleast_1d(value)) \
        if np.size(value) else ()


def _with_first(first: str, positives: tuple[str, ...]) -> tuple[str, ...]:
    """An example's positives with its "positive" first (a Task may list it anywhere, or not at all)."""
    return ((first,) if first else ()) + tuple(p for p in positives if p and p != first)


def _rows(value: Any) -> list[Any]:
    """A batched feature as one entry per example: ragged (variable length) or dense."""
    if hasattr(value, "row_splits"):  # a RaggedTensorValue: [batch, None]
        return np.split(np.asarray(value.values), np.asarray(value.row_splits)[1:-1])
    return list(value)


def _read(task: Any, split: str, query_len: int | None, batch_size: int = 1024) -> TaskExamples:
    """The Task's examples of `split`, in order, its queries read at `query_len` (seqio's
    `sequence_length`; None: the Task's own). Iterated in ragged batches: tf.data costs a fixed
    overhead per element handed to Python, which batching pays once per 1,024 examples."""
    ds = task.get_dataset(sequence_length=None if query_len is None else {"query": query_len}, split=split,
                          shuffle=False, num_epochs=1, use_cached=False)
    missing = [f for f in REQUIRED_FEATURES if f not in ds.element_spec]
    if missing:
        raise DataError(f"seqio Task {task.name!r} ({split}): its examples lack {missing} (they have "
                        f"{sorted(ds.element_spec)}); a retrieval Task produces \"id\", \"query\" (token ids) and "
                        "\"positive\" (docs/tasks.md)")
    query_spec = ds.element_spec["query"]
    if query_spec.shape.rank != 1 or not query_spec.dtype.is_integer:
        raise DataError(f"seqio Task {task.name!r} ({split}): \"query\" must be token ids (int[n]), got "
                        f"{query_spec.dtype.name}{query_spec.shape}; tokenise it in the Task")
    out = TaskExamples([], [], [], [] if "negatives" in ds.element_spec else None, [], [])
    for batch in ds.ragged_batch(batch_size).as_numpy_iterator():
        out.ids += [_strings(v)[0] for v in _rows(batch["id"])]
        out.queries += [np.asarray(q, np.int32) for q in _rows(batch["query"])]
        out.positives += [_strings(v)[0] if np.size(v) else "" for v in _rows(batch["positive"])]
        n = len(_rows(batch["id"]))
        out.gold_pages += [_strings(v) for v in _rows(batch["gold_pages"])] if "gold_pages" in batch else [()] * n
        first = out.positives[-n:]
        out.all_positives += ([_with_first(f, _strings(v)) for f, v in zip(first, _rows(batch["positives"]))]
                              if "positives" in batch else [(f,) if f else () for f in first])
        if out.negatives is not None:
            out.negatives += [_strings(v) for v in _rows(batch["negatives"])]
    return out


# ----------------------------------------------------------------------------------------------
# The cache


def _save(examples: TaskExamples, path: str) -> None:
    lengths = np.array([len(q) for q in examples.queries], np.int64)
    strings = {"ids": examples.ids, "positives": examples.positives, "gold_pages": examples.gold_pages,
               "negatives": examples.negatives, "all_positives": examples.all_positives}
    with replaced_on_success(path, ".npz") as tmp:
        np.savez(tmp, query_tokens=np.concatenate(examples.queries or [np.zeros(0, np.int32)]),
                 query_lengths=lengths, strings=np.array(json.dumps(strings)))


def _load(path: str) -> TaskExamples:
    with np.load(path, allow_pickle=False) as f:
        tokens, lengths, strings = f["query_tokens"], f["query_lengths"], json.loads(str(f["strings"]))
    queries = np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
    negatives = strings["negatives"]
    return TaskExamples(strings["ids"], list(queries), strings["positives"],
                        None if negatives is None else [tuple(n) for n in negatives],
                        [tuple(g) for g in strings["gold_pages"]], [tuple(p) for p in strings["all_positives"]])


def cache_path(task: Any, split: str, cache_dir: str, query_len: int | None = None) -> str:
    return os.path.join(cache_dir, task.name, f"{split}-{fingerprint(task, split, query_len)}.npz")


def materialize(task: Any, split: str, cache_dir: str | None, query_len: int | None = None) -> TaskExamples:
    """`task`'s examples of `split` after its preprocessors, from the cache when it holds them;
    `query_len` replaces the Task's own query length (seqio's `sequence_length["query"]`).

    Without a `cache_dir` (or an unwritable one) the examples are read through seqio every time."""
    if cache_dir is None:
        return _read(task, split, query_len)
    path = cache_path(task, split, cache_dir, query_len)
    if os.path.exists(path):
        try:
            return _load(path)
        except (OSError, ValueError, KeyError) as e:
            log.warning("%s: unreadable cache (%s); reading Task %s again", path, e, task.name)
    examples = _read(task, split, query_len)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        remove_stale_temporaries(os.path.dirname(path))
        _save(examples, path)
        log.info("cached %d examples of seqio Task %s (%s) in %s", len(examples), task.name, split, path)
    except PermissionError as e:
        log.warning("%s: cannot write the Task cache (%s); the examples are read through seqio each run", path, e)
    return examples
