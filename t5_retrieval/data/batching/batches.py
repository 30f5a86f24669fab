"""Per-task training batches: one sub-batch per task per step, exact and cheap to save/restore.

Each task's (host-local) examples are tokenised once into numpy; batching then only indexes
arrays. Task t's examples form an endless stream of permutations (permutation c seeded by
(seed, task, host, c)), and step s takes stream positions [s * b_t, (s + 1) * b_t). Everything is a
function of (seed, step), so the saved state is just the step and restoring reproduces the exact
following batches. An epoch is one pass over the largest task (floor(n / b) steps); smaller tasks
simply wrap into their next permutation.

Tasks and their rates come from the seqio registries; each Task's examples are read once through
its source and preprocessors and cached as arrays (`materialize.py`), which keeps the position
exact and TensorFlow out of the training loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import gin
import numpy as np

from t5_retrieval import gin_utils
from t5_retrieval.data import layout
from t5_retrieval.data.records import DataError, read_negatives
from t5_retrieval.data.stores.kb import PassageStore, passage_text
from t5_retrieval.data.tasks.materialize import TaskExamples
from t5_retrieval.data.tasks.mixing import sizes_from_rates
from t5_retrieval.data.tasks.retrieval_tasks import DEFAULT_QUERY_LEN
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.data.text import END_ENT, PASSAGE_TEMPLATE, START_ENT
from t5_retrieval.data.tokenizers.conventions import TokenConventions, conventions_of
from t5_retrieval.data.tokenizers.query_inputs import QueryInput, query_ids
from t5_retrieval.data.tokenizers.tokenize import Vocabulary, encode_text, load_vocabulary, vocabulary_digest
from t5_retrieval.errors import ConfigError, UserError, shell_command

log = logging.getLogger(__name__)
if TYPE_CHECKING:
    import jax

# {task: {feature: rows}}: numpy arrays on the host, jax.Arrays (global, sharded) inside the step.
Batch: TypeAlias = "Mapping[str, Mapping[str, np.ndarray | jax.Array]]"
_FILL_STREAM = 7919  # separates the random-negative RNG stream from the permutation streams
_SAMPLE_STREAM = 104729  # and the stream that samples hard negatives from an example's list
HARD_NEGATIVES = ("first", "sampled")
POSITIVE_PASSAGES = ("first", "cycle", "each")
FEW_SHOT_SEED = 128  # fixes the few-shot subset, independent of the run seed and the host


@dataclasses.dataclass
class _TaskData:
    name: str
    query_tokens: np.ndarray      # int32[n, the task's query length]
    positives: np.ndarray         # int64[n] store indices
    all_positives: np.ndarray     # int64[n, P] every positive (column 0 = positives), -1 = none
    negatives: np.ndarray         # int64[n, N] store indices, -1 = missing (filled at random)
    gold_pages: list[frozenset[str]]
    size: int                     # host-local sub-batch size
    skipped: int                  # examples without any positive passage in the KB
    missing_negatives: int        # negative slots that will be filled at random
    positive_passages: str = "first"  # which positive a row trains on (POSITIVE_PASSAGES)
    # int64[n]: the question each row is, where a question has several rows ("each"), so that the
    # loss does not take one row's positive as a negative of the same question's other rows.
    questions: np.ndarray | None = None


class TrainIterator:
    """Yields `{task: {"query_tokens", "passage_tokens", "task_ids"}}` per step (see make_train_iterator).

    With a `passage_table` ([KB size, dim], rows in store order) sub-batches carry the passages'
    stored embeddings as "passage_embeddings" instead of their tokens.
    """

    def __init__(self, tasks: list[_TaskData], store: PassageStore, vocab: Vocabulary, passage_len: int,
                 num_negatives: int, seed: int, host_index: int, host_count: int,
                 features: dict[str, Any] | None = None, passage_table: np.ndarray | None = None):
        self._tasks = tasks
        # How queries and passages become model inputs; recorded with checkpoints for inference.
        self.features = features or {}
        self._store = store
        self._vocab = vocab
        self._passage_len = passage_len
        self._passage_table = passage_table
        self._num_negatives = num_negatives
        self._seed = seed
        self._host = (host_index, host_count)
        self._pages = [store.page_of(pid) for pid in store.ids()]
        self._passage_cache: dict[int, np.ndarray] = {}
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        self.task_names = [t.name for t in tasks]
        self.subbatch_sizes = [t.size for t in tasks]
        largest = max(tasks, key=lambda t: len(t.positives))
        self.steps_per_epoch = max(1, len(largest.positives) // largest.size)
        self.step = 0

    # -- position ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-able position; save it with the checkpoint."""
        return {"step": self.step, "seed": self._seed, "tasks": self.task_names,
                "sizes": self.subbatch_sizes, "host_index": self._host[0], "host_count": self._host[1]}

    def restore(self, state: dict[str, Any]) -> None:
        """Continues from a saved position; the configuration must match the one that saved it.

        Not host_index: a multi-host checkpoint holds process 0's state (the position is the same on
        every host), and each host continues its own shard from it.
        """
        mine = self.state()
        for key in ("seed", "tasks", "sizes", "host_count"):
            if list(np.atleast_1d(state.get(key, []))) != list(np.atleast_1d(mine[key])):
                raise ConfigError(f"iterator state has {key}={state.get(key)!r}, this iterator has {mine[key]!r}; "
                                  "restore with the same tasks, batch sizes, seed and host layout")
        self.step = int(state["step"])

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    # -- batches -------------------------------------------------------------------------------
    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> Batch:
        batch = {t.name: self._subbatch(i, t, self.step) for i, t in enumerate(self._tasks)}
        self.step += 1
        return batch

    def _permutation(self, task_index: int, cycle: int) -> np.ndarray:
        key = (task_index, cycle)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 4 * len(self._tasks):
                self._perm_cache.clear()
            n = len(self._tasks[task_index].positives)
            rng = np.random.default_rng([self._seed, task_index, *self._host, cycle])
            self._perm_cache[key] = rng.permutation(n)
        return self._perm_cache[key]

    def _rows(self, task_index: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The task's example rows of `step`, and for each the pass over the task (cycle) it is in."""
        task = self._tasks[task_index]
        n = len(task.positives)
        positions = np.arange(step * task.size, (step + 1) * task.size)
        return (np.array([self._permutation(task_index, int(p // n))[p % n] for p in positions]), positions // n)

    def _positive(self, task: _TaskData, row: int, cycle: int) -> int:
        """The row's positive passage: its first (a row of its own per positive with ``"each"``), or
        (``"cycle"``) its positives in turn, one per pass."""
        if task.positive_passages != "cycle":
            return int(task.positives[row])
        row_positives = task.all_positives[row][task.all_positives[row] >= 0]
        return int(row_positives[cycle % len(row_positives)])

    def _subbatch(self, task_index: int, task: _TaskData, step: int) -> dict[str, np.ndarray]:
        rows, cycles = self._rows(task_index, step)
        fill_rng = np.random.default_rng([self._seed, _FILL_STREAM, task_index, *self._host, step])
        passage_ids = []
        for row, cycle in zip(rows, cycles):
            positive = self._positive(task, row, int(cycle))
            negs = [int(x) for x in task.negatives[row] if x >= 0]
            if len(negs) < self._num_negatives:
                negs += self._random_negatives(fill_rng, task.gold_pages[row], positive,
                                               negs, self._num_negatives - len(negs))
            passage_ids += [positive, *negs]
        if self._passage_table is not None:
            passages = {"passage_embeddings": self._passage_table[passage_ids]}
        else:
            passages = {"passage_tokens": np.stack([self._passage_tokens(i) for i in passage_ids])}
        questions = {} if task.questions is None else {"query_groups": task.questions[rows].astype(np.int32)}
        return {"query_tokens": task.query_tokens[rows], **passages,
                "task_ids": np.full(len(rows), task_index, np.int32), **questions}

    def _random_negatives(self, rng: np.random.Generator, gold: frozenset[str], positive: int,
                          taken: list[int], count: int) -> list[int]:
        out: list[int] = []
        for _ in range(100 * count + 100):
            if len(out) == count:
                break
            i = int(rng.integers(len(self._pages)))
            if self._pages[i] not in gold and i != positive and i not in taken and i not in out:
                out.append(i)
        if len(out) < count:
            raise DataError(f"could not draw {count} random negatives outside the gold pages from a KB of "
                            f"{len(self._pages)} passages")
        return out

    def _passage_tokens(self, index: int) -> np.ndarray:
        tokens = self._passage_cache.get(index)
        if tokens is None:
            passage = self._store.get(self._store.ids()[index])
            template = self.features.get("passage_template", PASSAGE_TEMPLATE)
            tokens = encode_text(self._vocab, passage_text(passage, template), self._passage_len)
            self._passage_cache[index] = tokens
        return tokens


def _load_vocabulary(vocabulary: Vocabulary | str) -> Vocabulary:
    """A path (sentencepiece model, or a BERT vocab.txt / model directory) or a vocabulary object."""
    return load_vocabulary(vocabulary) if isinstance(vocabulary, str) else vocabulary


def _fit(tokens: np.ndarray, length: int) -> np.ndarray:
    """A Task's query (start ids, text, end id) padded with 0 to `length`. A helper Task's queries
    already fit (its preprocessor cut them); a Task of one's own is cut keeping its start and end
    ids, as `tokenize.tokenize` cuts a text."""
    row = np.concatenate([tokens[:-1][: length - 1], tokens[-1:]])
    out = np.zeros(length, np.int32)
    out[: len(row)] = row
    return out


def choose_negatives(ids: Sequence[str], count: int, hard_negatives: str, seed: int, example_id: str
                     ) -> Sequence[str]:
    """An example's hard negatives for a run: the first `count` of its list (best first), or
    (``"sampled"``) `count` drawn uniformly without replacement from the whole list, in list order,
    the same for every host layout and resume: the RNG is keyed by (seed, example id). The TACO
    paper's text samples the hard negatives from the mined list (top-k minus gold); the authors' KILT
    scripts train on the first of it, in mined order (no shuffle)."""
    if hard_negatives == "first" or len(ids) <= count:
        return ids[:count]
    rng = np.random.default_rng([seed, _SAMPLE_STREAM, zlib.crc32(example_id.encode("utf-8"))])
    return [ids[i] for i in np.sort(rng.choice(len(ids), count, replace=False))]


def _task_data(info: TaskSpec, examples: TaskExamples, negatives: dict[str, tuple[str, ...]] | None,
               store: PassageStore, conventions: TokenConventions, query_len: int, num_negatives: int,
               size: int, negatives_source: str, hard_negatives: str, seed: int) -> _TaskData:
    usable = [i for i, positive in enumerate(examples.positives) if positive]
    if not usable:
        raise DataError(f"task {info.name}: none of its {len(examples)} host-local examples has a positive "
                        "passage in the KB")
    negs = np.full((len(usable), num_negatives), -1, np.int64)
    missing = 0
    for r, i in enumerate(usable):
        if negatives is None:
            ids_of = examples.negatives[i] if examples.negatives is not None else ()
        elif examples.ids[i] in negatives:
            ids_of = negatives[examples.ids[i]]
        else:
            raise DataError(f"{negatives_source}: no negatives for example {examples.ids[i]!r} of task {info.name}")
        chosen = choose_negatives(ids_of, num_negatives, hard_negatives, seed, examples.ids[i])
        ids = [store.index_of(pid) for pid in chosen]
        negs[r, : len(ids)] = ids
        missing += num_negatives - len(ids)
    end = conventions.end_id
    bad = next((examples.ids[i] for i in usable
                if len(examples.queries[i]) == 0 or examples.queries[i][-1] != end), None)
    if bad is not None:
        raise DataError(f"seqio Task {info.name!r}: the query of example {bad!r} does not end with the vocabulary's "
                        f"end id {end}; end the Task's preprocessors with seqio.preprocessors.append_eos_after_trim "
                        "(add_retrieval_task does)")
    width = max(len(examples.all_positives[i]) for i in usable)
    all_positives = np.full((len(usable), width), -1, np.int64)
    for r, i in enumerate(usable):
        row = [store.index_of(p) for p in examples.all_positives[i]]
        all_positives[r, : len(row)] = row
    return _TaskData(
        name=info.name,
        query_tokens=np.stack([_fit(examples.queries[i], query_len) for i in usable]),
        positives=np.array([store.index_of(examples.positives[i]) for i in usable], np.int64),
        all_positives=all_positives,
        negatives=negs,
        gold_pages=[frozenset(examples.gold_pages[i]) for i in usable],
        size=size, skipped=len(examples) - len(usable), missing_negatives=missing)


def one_row_per_positive(data: _TaskData, host_index: int, host_count: int) -> _TaskData:
    """`data` with each example repeated once per positive passage (one per gold page), each copy
    trained on its own positive and sharing the example's query and hard negatives; `questions`
    numbers the examples across hosts (host-local row r of host h is question r * host_count + h)."""
    counts = (data.all_positives >= 0).sum(axis=1)
    source = np.repeat(np.arange(len(counts)), counts)
    return dataclasses.replace(
        data, query_tokens=data.query_tokens[source], positives=data.all_positives[data.all_positives >= 0],
        all_positives=data.all_positives[source], negatives=data.negatives[source],
        gold_pages=[data.gold_pages[i] for i in source], positive_passages="each",
        questions=source.astype(np.int64) * host_count + host_index)


def _subset(examples: TaskExamples, keep: Sequence[int] | np.ndarray) -> TaskExamples:
    return TaskExamples([examples.ids[i] for i in keep], [examples.queries[i] for i in keep],
                        [examples.positives[i] for i in keep],
                        None if examples.negatives is None else [examples.negatives[i] for i in keep],
                        [examples.gold_pages[i] for i in keep], [examples.all_positives[i] for i in keep])


@gin.configurable
def make_train_iterator(mixture_or_task_names: str | Sequence[str], data_dir: str, negatives: str | None,
                        vocabulary: Vocabulary | str, query_len: int | Mapping[str, int] | None, passage_len: int,
                        num_negatives: int, per_device_batch: int, local_data_devices: int = 1, host_index: int = 0,
                        host_count: int = 1, seed: int = 0, split: str = "train",
                        max_examples_per_task: int | None = None, passage_template: str = PASSAGE_TEMPLATE,
                        passage_embeddings: str | None = None, cache_dir: str | None = None,
                        task_module: str | Sequence[str] | None = None,
                        task_module_path: Sequence[str] = (), hard_negatives: str = "first",
                        positive_passages: str | Mapping[str, str] = "first",
                        task_negatives: Mapping[str, str] | None = None) -> TrainIterator:
    """Builds the per-task training iterator over a registered seqio Mixture or Task.

    Names resolve through seqio (`retrieval_tasks.resolve`); per-device sub-batch sizes come from the
    Mixture's own rates (`mixing.sizes_from_rates`), host-local sizes are those times
    `local_data_devices`. Each Task's `split` is read once through seqio and cached under
    `cache_dir` (default `<data_dir>/cache/tasks`; `materialize.py`); `task_module` (t5x's
    MIXTURE_OR_TASK_MODULE) names modules to import first, which register the user's Tasks, from
    the directories `task_module_path` before `sys.path` (`t5r train` records the directory of a
    module only the working directory holds, so that config.gin restarts from anywhere). The
    per-device sub-batch size of each Task is logged.

    Query lengths (gin `QUERY_LEN`): None reads every Task's queries at its own length (the Task
    cuts them, entity linking around the mention: `query_inputs.py`); a number reads every Task's
    at that length; a mapping `{task or dataset: length}` sets the named Tasks' and leaves the
    others theirs. Each Task's sub-batch is padded to its own length; a Task that states none reads
    DEFAULT_QUERY_LEN. The lengths and truncations are recorded per task in the features.

    Negatives: `negatives` is a directory of `{dataset}-{split}.jsonl` negatives files (default
    `<data_dir>/negatives/bm25`); where it has no file for a Task, the Task's own "negatives" feature
    is used. `hard_negatives` picks `num_negatives` of each example's list for the whole run: the
    first ones (``"first"``, best first) or a uniform sample of the whole list (``"sampled"``, seeded
    by `seed` and the example id: `choose_negatives`); when an example has fewer, the rest are
    random KB passages outside its gold pages, drawn deterministically from (seed, task, host, step).
    Examples without a positive passage in the KB are skipped and counted (logged).

    `task_negatives` ({task or dataset: directory}) gives the named Tasks negatives from another
    directory than `negatives` (the TACO recipe's WoW warm-up on negatives its zero-shot model mined,
    the other tasks on BM25's).

    Positives: an example with several positive passages (HotpotQA's two gold pages, one passage per
    page) trains on its first (``positive_passages="first"``, as the TACO and DPR scripts do), on
    each in turn, the next one on every pass over its task (``"cycle"``: a pure function of the
    step, so resume is exact), or once per positive in every pass (``"each"``: the example becomes
    one row per positive, each with that passage as its positive and the example's query and hard
    negatives; the task's sub-batch size stays its mixture rate's, so a pass over it takes that many
    more steps). Two rows of one question in a sub-batch do not take each other's positive as a
    negative (the sub-batch's "query_groups", `losses.in_batch_softmax_loss`). A mapping
    `{task or dataset: mode}` sets the named Tasks' mode and leaves the others "first"
    (`make_train_iterator.positive_passages = {'hotpotqa': 'each'}`).
    Each host reads examples i with i % host_count == host_index (seqio.ShardInfo style).
    `passage_template` is how a passage becomes text (`text.PASSAGE_TEMPLATES`; recorded in the
    features). `max_examples_per_task` keeps a fixed random subset of each task (MT-DPR's few-shot
    regimes: 128 or 1,024 examples), the same on every host and for every `seed`.

    `passage_embeddings`: an embeddings directory of this KB (`t5r encode`) whose vectors stand in
    for the passages, so the passage side is frozen and costs nothing per step (query-side
    training over a fixed index; `train` then requires `init_from` to be the model that wrote
    them). Its identity (`passage_table`) is recorded in the features.
    """
    from t5_retrieval.data.tasks import retrieval_tasks
    from t5_retrieval.data.tasks.materialize import materialize

    gin_utils.import_modules(task_module, task_module_path)
    if hard_negatives not in HARD_NEGATIVES:
        raise ConfigError(f"make_train_iterator.hard_negatives must be one of {HARD_NEGATIVES}, got {hard_negatives!r}")
    modes = positive_passages.values() if isinstance(positive_passages, Mapping) else [positive_passages]
    bad = [m for m in modes if m not in POSITIVE_PASSAGES]
    if bad:
        raise ConfigError(f"make_train_iterator.positive_passages must be one of {POSITIVE_PASSAGES} (or a mapping "
                          f"of task or dataset to one), got {bad[0]!r}")
    if not 0 <= host_index < host_count:
        raise ValueError(f"host_index {host_index} not in [0, {host_count})")
    vocab = _load_vocabulary(vocabulary)
    retrieval_tasks.use_vocabulary(vocabulary)
    retrieval_tasks.set_data_dir(data_dir)
    tasks_and_rates = retrieval_tasks.resolve(mixture_or_task_names)
    infos = [retrieval_tasks.describe(task) for task, _ in tasks_and_rates]
    sizes = sizes_from_rates([rate for _, rate in tasks_and_rates], per_device_batch)
    log.info("sub-batch per device and step (of %d; mixing rate): %s", per_device_batch,
             ", ".join(f"{info.name} {size} ({rate:g})" for info, size, (_, rate) in zip(infos, sizes, tasks_and_rates)))
    lengths = task_query_lens(infos, query_len)
    positive_modes = by_task(infos, positive_passages, "first", "make_train_iterator.positive_passages")
    own_negatives = by_task(infos, task_negatives or {}, None, "make_train_iterator.task_negatives")
    store = PassageStore.open(layout.kb_dir(data_dir))
    negatives_dir = negatives or layout.negatives_dir(data_dir, "bm25")
    cache = os.path.join(data_dir, "cache", "tasks") if cache_dir is None else cache_dir
    task_data = []
    for (task, _), info, size, length, positive_mode, own_dir in zip(tasks_and_rates, infos, sizes, lengths,
                                                                     positive_modes, own_negatives):
        _check_vocabulary(task, vocab)
        _check_query_input(info, length, vocab)
        examples = materialize(task, split, cache or None, length)
        if max_examples_per_task is not None and len(examples) > max_examples_per_task:
            keep = np.random.default_rng(FEW_SHOT_SEED).choice(len(examples), max_examples_per_task, replace=False)
            examples = _subset(examples, np.sort(keep))
        examples = _subset(examples, range(host_index, len(examples), host_count))
        negatives_file = task_negatives_file(own_dir or negatives_dir, info, split)
        if own_dir is not None and negatives_file is None:
            raise DataError(f"make_train_iterator.task_negatives: {own_dir} has no negatives file for task {info.name} "
                            f"({layout.negatives_path(own_dir, info.negatives_name, split)})")
        if negatives_file is not None:
            negatives_of, source = read_negatives(negatives_file), negatives_file
        elif examples.negatives is not None:
            negatives_of, source = None, f"seqio Task {info.name}"
        else:
            raise DataError(f"{layout.negatives_path(negatives_dir, info.negatives_name, split)}: missing, and seqio "
                            f"Task {info.name} has no \"negatives\" feature; "
                            + _negatives_hint(data_dir, negatives_dir, info, split, task_module, task_module_path))
        log.info("task %s: hard negatives from %s", info.name, source)
        if info.negatives_name != info.dataset and negatives_file == layout.negatives_path(negatives_dir, info.dataset,
                                                                                           split):
            log.warning("task %s: its preprocessors (%s) rewrite the query text, and %s holds negatives mined for "
                        "dataset %s's text as written; for negatives of its own text (%s), %s", info.name,
                        ", ".join(info.text_preprocessors), negatives_file, info.dataset,
                        layout.negatives_path(negatives_dir, info.name, split),
                        _negatives_hint(data_dir, negatives_dir, info, split, task_module, task_module_path))
        data = _task_data(info, examples, negatives_of, store, conventions_of(vocab), length,
                          num_negatives, size * local_data_devices, source, hard_negatives, seed)
        if positive_mode == "each":
            data = one_row_per_positive(data, host_index, host_count)
        elif positive_mode == "cycle":
            data = dataclasses.replace(data, positive_passages="cycle")
        if data.skipped or data.missing_negatives:
            logging.warning("task %s: skipped %d examples without a positive in the KB; %d negative slots "
                            "will be filled with random passages", info.name, data.skipped, data.missing_negatives)
        task_data.append(data)
    features: dict[str, Any] = {"vocabulary": os.path.abspath(vocabulary) if isinstance(vocabulary, str) else None,
                # Its content: loading the model refuses a vocabulary changed since (a path is no identity).
                "vocabulary_digest": vocabulary_digest(vocabulary) if isinstance(vocabulary, str) else None,
                # The longest task's query length; each task's own (and its truncation) is under "tasks".
                "query_len": max(lengths), "passage_len": passage_len, "passage_template": passage_template,
                # Each task's `TaskSpec` record at the length it trained at, and "index": its position
                # in the step (and its query tower), explicit because the config is stored with sorted keys.
                "tasks": {info.name: {**dataclasses.replace(info, query_len=length).to_record(), "index": i}
                          for i, (info, length) in enumerate(zip(infos, lengths))}}
    table = None
    if passage_embeddings is not None:
        table, features["passage_embeddings"] = passage_table(passage_embeddings, store)
    return TrainIterator(task_data, store, vocab, passage_len, num_negatives, seed, host_index, host_count,
                         features, table)


def task_negatives_file(negatives_dir: str, info: TaskSpec, split: str) -> str | None:
    """The negatives file task `info` trains with, or None: `{task}-{split}.jsonl`, else the one its
    query text shares (`TaskSpec.negatives_name`: its dataset's, for a task reading the dataset's
    examples as written), else, for a task whose preprocessors rewrite the text, its dataset's (mined
    for the text as written; older versions named every negatives file by dataset)."""
    for name in dict.fromkeys([info.name, info.negatives_name, info.dataset]):
        path = layout.negatives_path(negatives_dir, name, split)
        if os.path.exists(path):
            return path
    return None


def _negatives_hint(data_dir: str, negatives_dir: str, info: TaskSpec, split: str,
                    task_module: str | Sequence[str] | None, task_module_path: Sequence[str]) -> str:
    """What to run for a Task without negatives: `t5r data negatives` over its KILT examples file,
    or over the Task itself with the module that registers it (BM25 negatives go to the default
    directory only)."""
    if os.path.abspath(negatives_dir) != os.path.abspath(layout.negatives_dir(data_dir, "bm25")):
        return f"the negatives directory {negatives_dir} (NEGATIVES) needs a file for it, or the Task that feature"
    own_text = info.negatives_name != info.dataset  # its preprocessors rewrite the query text
    command = ["t5r", "data", "negatives", f"--data_dir={data_dir}", f"--tasks={info.negatives_name}",
               *([f"--splits={split}"] if split != "train" else [])]
    if own_text or not os.path.exists(layout.examples_path(data_dir, info.dataset, split)):
        if not task_module:  # no module to name: no command to give
            return "give the Task that feature, or write {\"id\", \"negatives\"} rows for its examples to that file"
        command += [f"--task_module={m}" for m in ([task_module] if isinstance(task_module, str) else task_module)]
        if task_module_path:
            command.insert(0, "PYTHONPATH=" + os.pathsep.join(task_module_path))
    return f"write BM25 negatives for it with `{shell_command(command)}`"


def task_query_lens(infos: Sequence[TaskSpec], query_len: int | Mapping[str, int] | None) -> list[int]:
    """Each Task's query length: its own, or what `query_len` (gin QUERY_LEN) sets for it (see
    `make_train_iterator`). A mapping key that names none of the Tasks is an error."""
    lengths = by_task(infos, query_len, None, "QUERY_LEN")
    return [int(n) if n is not None else info.query_len or DEFAULT_QUERY_LEN for info, n in zip(infos, lengths)]


def by_task(infos: Sequence[TaskSpec], setting: Any, default: Any, name: str) -> list[Any]:
    """Each Task's value of a per-task setting: `setting` itself, or for a mapping `{task or dataset:
    value}` the named Tasks' values (a Task's name before its dataset) and `default` for the others.
    A mapping key that names none of the Tasks is an error."""
    if not isinstance(setting, Mapping):
        return [setting for _ in infos]
    known = {n for info in infos for n in (info.name, info.dataset)}
    unknown = sorted(set(setting) - known)
    if unknown:
        raise UserError(f"{name} names {unknown}, which are not among this run's tasks "
                        f"({', '.join(info.name for info in infos)}); key it by task name or dataset")
    return [setting.get(info.name, setting.get(info.dataset, default)) for info in infos]


def _check_query_input(info: TaskSpec, length: int, vocab: Vocabulary) -> None:
    """A length too short for a Task's special tokens, prefix and entity markers fails here, naming
    the Task, rather than inside its seqio pipeline."""
    try:
        query_ids(vocab, [f"{START_ENT} {END_ENT}"], QueryInput(info.prefix, length, info.truncation))
    except ValueError as e:
        raise UserError(f"task {info.name}: query length {length}: {e}") from None


def _check_vocabulary(task: Any, vocab: Vocabulary) -> None:
    """A Task must tokenise with the model's vocabulary: token ids mean nothing in another."""
    from t5_retrieval.data.tasks.retrieval_tasks import vocabulary_identity

    if "query" not in task.output_features:
        raise DataError(f"seqio Task {task.name!r} has no \"query\" output feature (it has "
                        f"{sorted(task.output_features)}); a retrieval Task tokenises its queries into \"query\" "
                        "(docs/tasks.md, or register it with t5_retrieval.tasks.add_retrieval_task)")
    theirs, ours = vocabulary_identity(task.output_features["query"].vocabulary), vocabulary_identity(vocab)
    if theirs != ours:
        raise DataError(f"seqio Task {task.name!r} tokenises with a vocabulary of digest {theirs}, the model with "
                        f"digest {ours}; register the Task with the model's vocabulary (add_retrieval_task's "
                        "default is the run's)")


def passage_table(directory: str, store: PassageStore) -> tuple[np.ndarray, dict[str, str]]:
    """The stored embeddings of every KB passage in store order, and their identity: the fingerprint
    of the model that wrote them and a digest of the table (not their directory: a copy of the
    embeddings elsewhere trains the same model)."""
    from t5_retrieval.data.stores import embedding_store

    manifest = embedding_store.read_manifest(directory)
    ids = embedding_store.read_ids(directory)
    if sorted(ids) != sorted(store.ids()):
        raise DataError(f"{directory}: its {len(ids)} passage ids are not those of the KB {store.directory} "
                        f"({len(store.ids())} passages); encode this KB with `t5r encode`")
    matrix = embedding_store.load_matrix(directory)
    row_of = {pid: r for r, pid in enumerate(ids)}
    table = matrix[[row_of[pid] for pid in store.ids()]]
    digest = hashlib.sha256(np.ascontiguousarray(table).tobytes()).hexdigest()[:16]
    return table, {"fingerprint": manifest.fingerprint, "digest": digest}
