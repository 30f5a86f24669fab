"""A model's tasks by either of their names: the registered one (`demo_fever`) or its dataset (`fever`).

A trained model records its tasks with its features (`batches.make_train_iterator`):
`{"demo_fever": {"dataset": "fever", "prefix": "fever", "index": 0}, ...}`. Users think in
datasets (the example files are `<data_dir>/examples/{dataset}-{split}.jsonl`), the model in
registered names (which choose the query prefix and tower); every command maps a user's name to the
model's through `resolve`, so both forms work everywhere and fail with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from t5_retrieval.errors import UserError

Tasks = Mapping[str, Mapping[str, Any]]  # a model's features["tasks"]: name -> {"dataset", "prefix", ...}


class UnknownTaskError(KeyError, ValueError, UserError):
    """A task name the model does not know, or a dataset several of its tasks read.

    Both a KeyError (a missing key of the model's tasks) and a ValueError (a bad argument), so the
    callers that catch either keep working."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _known(tasks: Tasks) -> str:
    return ", ".join(f"{name} (dataset {spec['dataset']})" if "dataset" in spec else name
                     for name, spec in sorted(tasks.items()))


def resolve(tasks: Tasks, name: str) -> str:
    """The model's task name for `name`: itself when registered, else the one task reading dataset `name`."""
    if name in tasks:
        return name
    named = sorted(task for task, spec in tasks.items() if spec.get("dataset") == name)
    if len(named) == 1:
        return named[0]
    if named:
        raise UnknownTaskError(f"task {name!r} is ambiguous: the model's tasks {named} all read dataset {name!r}; "
                               "name one of them")
    raise UnknownTaskError(f"unknown task {name!r}; this model was trained on: {_known(tasks)}")


def dataset_of(tasks: Tasks, name: str) -> str:
    """The dataset whose examples the task `name` (either form) reads."""
    task = resolve(tasks, name)
    return tasks[task].get("dataset", task)


def datasets(tasks: Tasks) -> list[str]:
    """Every dataset the model was trained on, sorted, once each."""
    return sorted({spec.get("dataset", task) for task, spec in tasks.items()})


def knows(tasks: Tasks, name: str) -> bool:
    """`name` is one of the model's tasks or one of their datasets."""
    return name in tasks or any(spec.get("dataset") == name for spec in tasks.values())


def expand(tasks: Tasks, names: Sequence[str]) -> list[str]:
    """`names` with each registered seqio Mixture the model does not know by name replaced by its
    Tasks (in the Mixture's order), so `--tasks=<mixture>` names what the model was trained on.

    seqio (and TensorFlow) is imported only for a name the model does not know; a model that records
    no tasks takes every name as a dataset."""
    out: list[str] = []
    for name in names:
        members = None if not tasks or knows(tasks, name) else _mixture_tasks(name)
        if members is None:
            out.append(name)
            continue
        unknown = [m for m in members if m not in tasks]
        if unknown:
            raise UnknownTaskError(f"seqio Mixture {name!r} holds {unknown}, which this model was not trained on; "
                                   f"it was trained on: {_known(tasks)}")
        out += [m for m in members if m not in out]
    return out


def _mixture_tasks(name: str) -> list[str] | None:
    import seqio

    if name not in seqio.MixtureRegistry.names():
        return None
    from t5_retrieval.data.retrieval_tasks import resolve

    return [task.name for task, _ in resolve(name)]
