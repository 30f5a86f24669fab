"""Every name a user gives a task, resolved against a model's tasks: this module alone does it.

A trained model records its tasks with its features (`batches.make_train_iterator`):
`{"demo_fever": {"dataset": "fever", "prefix": "fever", "index": 0}, ...}`. A user names a task

- by its registered seqio Task name (`demo_fever`), the model's own name, which chooses the query
  prefix and tower;
- by its dataset (`fever`; the example files are `<data_dir>/examples/{dataset}-{split}.jsonl`),
  when exactly one of the model's tasks reads it;
- by a registered seqio Mixture (`demo`), which stands for the model's Tasks it holds.

A `TaskSet` built once from a model's recorded `TaskSpec`s answers every question about names:
every command, `Searcher`, the search service, the encoders and the results tables map names through
its `resolve` (one task) or `expand` (a list of names), so every form works everywhere and fails with
the same messages. A model that records no tasks (the lexical baseline, whose queries have no
prefix) takes every name as its own task and dataset.

Mixtures are looked up in seqio's registry, importing seqio (and registering the project's Tasks
and Mixtures) when a name is neither a task nor a dataset of the model, so the answer never depends
on what happened to be imported before. The
seqio registries are read through `retrieval_tasks`: this module depends on it, not the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.retrieval_tasks import UnknownTaskError
from t5_retrieval.data.tasks.task_spec import TaskSpec, upgrade_records
from t5_retrieval.data.tokenizers.query_inputs import QueryInput

__all__ = ["TaskSet", "UnknownTaskError", "registered_mixture"]

MixtureLookup = Callable[[str], "list[str] | None"]


def registered_mixture(name: str) -> list[str] | None:
    """The Task names of the registered seqio Mixture `name`, in its declared order; None when it is
    no registered Mixture (the project's are registered on this first lookup)."""
    seqio = retrieval_tasks.registries()

    if name not in seqio.MixtureRegistry.names():
        return None
    return [task.name for task, _ in retrieval_tasks.resolve(name)]


class TaskSet:
    """A model's tasks by name, and every name a user may give one (`resolve`, `expand`).

    `mixtures` looks up a seqio Mixture's Tasks (`registered_mixture`); it is asked only about a
    name that is no task and no dataset of the model."""

    def __init__(self, specs: Iterable[TaskSpec], mixtures: MixtureLookup = registered_mixture,
                 positions: Mapping[str, int] | None = None) -> None:
        self._specs = {spec.name: spec for spec in specs}
        self._mixtures = mixtures
        # Each task's position in the model's training step (its query tower), as recorded.
        self._positions = dict(positions or {})

    @classmethod
    def from_features(cls, features: Mapping[str, Any], mixtures: MixtureLookup = registered_mixture) -> TaskSet:
        """The tasks a model records with its features, of any version (`task_spec.upgrade_records`);
        none for one that records none, e.g. the lexical baseline, which then takes every name as its
        own task and dataset."""
        records = upgrade_records(features)
        return cls((TaskSpec.from_record(name, record) for name, record in records.items()), mixtures,
                   {name: int(record["index"]) for name, record in records.items() if "index" in record})

    @classmethod
    def from_records(cls, records: Mapping[str, Mapping[str, Any]],
                     mixtures: MixtureLookup = registered_mixture) -> TaskSet:
        """The tasks a model records as `records` (`features["tasks"]`)."""
        return cls.from_features({"tasks": records}, mixtures)

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self):
        return iter(self._specs)

    def spec(self, name: str) -> TaskSpec:
        """The spec of the task `name` (any form); for a model without tasks, a name's own."""
        task = self.resolve(name)
        return self._specs.get(task) or TaskSpec(task, task, None)

    def position(self, name: str) -> int | None:
        """Task `name`'s position in the model's training step (its query tower), None if not recorded."""
        return self._positions.get(name)

    def training_order(self) -> list[str] | None:
        """The model's tasks in their training step's order (task k's queries take query tower k);
        None when a task's position is not recorded (a model written before towers were tracked)."""
        if any(task not in self._positions for task in self._specs):
            return None
        return sorted(self._specs, key=self._positions.__getitem__)

    def query_input(self, name: str) -> QueryInput:
        """How the model reads the queries of task `name` (any form)."""
        return self.spec(name).query_input()

    def _known(self) -> str:
        return ", ".join(f"{name} (dataset {spec.dataset})" for name, spec in sorted(self._specs.items()))

    def _readers(self, dataset: str) -> list[str]:
        """The model's tasks that read `dataset`'s examples, sorted."""
        return sorted(task for task, spec in self._specs.items() if spec.dataset == dataset)

    def _mixture_members(self, name: str) -> list[str] | None:
        """The Tasks of the seqio Mixture `name`, or None when it is none. Raises UnknownTaskError
        when the model was not trained on all of them."""
        members = self._mixtures(name)
        if members is None:
            return None
        unknown = [m for m in members if m not in self._specs]
        if unknown:
            raise UnknownTaskError(f"seqio Mixture {name!r} holds {unknown}, which this model was not trained on; "
                                   f"it was trained on: {self._known()}")
        return members

    def knows(self, name: str) -> bool:
        """`name` is one of the model's tasks or one of their datasets (no registry needed to resolve it)."""
        return name in self._specs or bool(self._readers(name))

    def resolve(self, name: str) -> str:
        """The model's one task that `name` names: itself when registered, else the one task reading
        dataset `name`, else the one Task of the seqio Mixture `name`.

        Raises UnknownTaskError listing the model's tasks and their datasets for any other name, and
        naming the candidates for a dataset that several tasks read or a Mixture of several Tasks."""
        if not self._specs or name in self._specs:
            return name
        readers = self._readers(name)
        if len(readers) == 1:
            return readers[0]
        if readers:
            raise UnknownTaskError(f"task {name!r} is ambiguous: the model's tasks {readers} all read dataset "
                                   f"{name!r}; name one of them")
        members = self._mixture_members(name)
        if members is None:
            raise UnknownTaskError(f"unknown task {name!r}; this model was trained on: {self._known()}")
        if len(members) > 1:
            raise UnknownTaskError(f"seqio Mixture {name!r} holds several of the model's tasks, {members}, where one "
                                   "task is asked for: name one of them")
        return members[0]

    def dataset_of(self, name: str) -> str:
        """The dataset whose examples the task `name` (any form) reads."""
        return self.spec(name).dataset

    def datasets(self) -> list[str]:
        """Every dataset the model was trained on, sorted, once each."""
        return sorted({spec.dataset for spec in self._specs.values()})

    def aliases(self) -> dict[str, str]:
        """Every name `resolve` maps to a task without the seqio registries -> that task: each task's
        registered name (in the model's order), then each dataset only one task reads (sorted)."""
        readers = {d: self._readers(d) for d in self.datasets() if d not in self._specs}
        return {**{task: task for task in self._specs}, **{d: r[0] for d, r in readers.items() if len(r) == 1}}

    def expand(self, names: Sequence[str]) -> list[str]:
        """`names` with each seqio Mixture the model does not know by name replaced by its Tasks (in
        the Mixture's order, each once), so `--tasks=<mixture>` names what the model was trained on;
        every other name is kept as given (`resolve` maps it).

        A model that records no tasks takes every name as a dataset."""
        out: list[str] = []
        for name in names:
            members = None if not self._specs or self.knows(name) else self._mixture_members(name)
            if members is None:
                out.append(name)
            else:
                out += [m for m in members if m not in out]
        return out

    @classmethod
    def registered(cls, names: Iterable[str]) -> TaskSet:
        """`names` read from the seqio registries: a registered Task's spec (`retrieval_tasks.describe`),
        a Mixture's Tasks in its place, and any other name as its own dataset (a table of BM25 or of
        the lexical baseline is keyed by dataset).

        For what holds names but no model, e.g. a results table keyed by a model's task names (the
        project's Tasks are registered on this lookup, a user's by their module)."""
        seqio = retrieval_tasks.registries()

        registered = {*seqio.MixtureRegistry.names(), *seqio.TaskRegistry.names()}
        specs: dict[str, TaskSpec] = {}
        for name in names:
            if name not in registered:
                specs[name] = TaskSpec(name, name, None)
                continue
            for task, _ in retrieval_tasks.resolve(name):
                spec = retrieval_tasks.describe(task)
                specs[spec.name] = spec
        return cls(specs.values())
