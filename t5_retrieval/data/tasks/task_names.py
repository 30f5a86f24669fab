"""Every name a user gives a task, resolved against a model's tasks: this module alone does it.

A trained model records its tasks with its features (`batches.make_train_iterator`):
`{"demo_fever": {"dataset": "fever", "prefix": "fever", "index": 0}, ...}`. A user names a task

- by its registered seqio Task name (`demo_fever`), the model's own name, which chooses the query
  prefix and tower;
- by its dataset (`fever`; the example files are `<data_dir>/examples/{dataset}-{split}.jsonl`),
  when exactly one of the model's tasks reads it;
- by a registered seqio Mixture (`demo`), which stands for the model's Tasks it holds.

Every command, `Searcher`, the search service, the encoders and the results tables map names
through `resolve` (one task) or `expand` (a list of names), so every form works everywhere and fails
with the same messages. A model that records no tasks (the lexical baseline, whose queries have no
prefix) takes every name as its own task and dataset.

The seqio registries are read through `retrieval_tasks`: this module depends on it, not the
other way round.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from t5_retrieval.data.tasks import retrieval_tasks
from t5_retrieval.data.tasks.retrieval_tasks import UnknownTaskError

Tasks = Mapping[str, Mapping[str, Any]]  # a model's features["tasks"]: name -> {"dataset", "prefix", ...}

__all__ = ["Tasks", "UnknownTaskError", "aliases", "dataset_of", "datasets", "expand", "knows", "registered_tasks",
           "resolve"]


def _known(tasks: Tasks) -> str:
    return ", ".join(f"{name} (dataset {spec['dataset']})" if "dataset" in spec else name
                     for name, spec in sorted(tasks.items()))


def _readers(tasks: Tasks, dataset: str) -> list[str]:
    """The model's tasks that read `dataset`'s examples, sorted."""
    return sorted(task for task, spec in tasks.items() if spec.get("dataset") == dataset)


def _mixture_members(tasks: Tasks, name: str) -> list[str] | None:
    """The Tasks of the registered seqio Mixture `name`, in its declared order; None when `name`
    is no registered Mixture. Raises UnknownTaskError when the model was not trained on all of them."""
    # Mixtures live in seqio's registry: a process that never imported seqio has none registered,
    # and a mistyped name then costs no TensorFlow import.
    seqio = sys.modules.get("seqio")
    if seqio is None or name not in seqio.MixtureRegistry.names():
        return None
    members = [task.name for task, _ in retrieval_tasks.resolve(name)]
    unknown = [m for m in members if m not in tasks]
    if unknown:
        raise UnknownTaskError(f"seqio Mixture {name!r} holds {unknown}, which this model was not trained on; "
                               f"it was trained on: {_known(tasks)}")
    return members


def knows(tasks: Tasks, name: str) -> bool:
    """`name` is one of the model's tasks or one of their datasets (no registry needed to resolve it)."""
    return name in tasks or bool(_readers(tasks, name))


def resolve(tasks: Tasks, name: str) -> str:
    """The model's one task that `name` names: itself when registered, else the one task reading
    dataset `name`, else the one Task of the seqio Mixture `name`.

    Raises UnknownTaskError listing the model's tasks and their datasets for any other name, and
    naming the candidates for a dataset that several tasks read or a Mixture of several Tasks."""
    if not tasks or name in tasks:
        return name
    readers = _readers(tasks, name)
    if len(readers) == 1:
        return readers[0]
    if readers:
        raise UnknownTaskError(f"task {name!r} is ambiguous: the model's tasks {readers} all read dataset {name!r}; "
                               "name one of them")
    members = _mixture_members(tasks, name)
    if members is None:
        raise UnknownTaskError(f"unknown task {name!r}; this model was trained on: {_known(tasks)}")
    if len(members) > 1:
        raise UnknownTaskError(f"seqio Mixture {name!r} holds several of the model's tasks, {members}, where one "
                               "task is asked for: name one of them")
    return members[0]


def dataset_of(tasks: Tasks, name: str) -> str:
    """The dataset whose examples the task `name` (any form) reads."""
    task = resolve(tasks, name)
    return tasks.get(task, {}).get("dataset", task)


def datasets(tasks: Tasks) -> list[str]:
    """Every dataset the model was trained on, sorted, once each."""
    return sorted({spec.get("dataset", task) for task, spec in tasks.items()})


def aliases(tasks: Tasks) -> dict[str, str]:
    """Every name `resolve` maps to a task without the seqio registries -> that task: each task's
    registered name (in the model's order), then each dataset only one task reads (sorted)."""
    readers = {d: _readers(tasks, d) for d in datasets(tasks) if d not in tasks}
    return {**{task: task for task in tasks}, **{d: r[0] for d, r in readers.items() if len(r) == 1}}


def expand(tasks: Tasks, names: Sequence[str]) -> list[str]:
    """`names` with each registered seqio Mixture the model does not know by name replaced by its
    Tasks (in the Mixture's order, each once), so `--tasks=<mixture>` names what the model was
    trained on; every other name is kept as given (`resolve` maps it).

    A model that records no tasks takes every name as a dataset."""
    out: list[str] = []
    for name in names:
        members = None if not tasks or knows(tasks, name) else _mixture_members(tasks, name)
        if members is None:
            out.append(name)
        else:
            out += [m for m in members if m not in out]
    return out


def registered_tasks(names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`names` as a model records its tasks, read from the seqio registries: a registered Task's
    dataset and prefix (`retrieval_tasks.describe`), a Mixture's Tasks in its place, and any other
    name as its own dataset (a table of BM25 or of the lexical baseline is keyed by dataset).

    For what holds names but no model, e.g. a results table keyed by a model's task names; the
    caller imports the modules that register them (the project's: `t5_retrieval.tasks`)."""
    import seqio

    registered = {*seqio.MixtureRegistry.names(), *seqio.TaskRegistry.names()}
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        if name not in registered:
            out[name] = {"dataset": name}
            continue
        for task, _ in retrieval_tasks.resolve(name):
            info = retrieval_tasks.describe(task)
            out[info.name] = {"dataset": info.dataset, "prefix": info.prefix}
    return out
