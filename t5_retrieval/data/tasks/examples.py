"""A model's task examples for one split: the one place they are assembled, for `t5r eval`, `t5r mine`,
the stage runner's evaluate and mine stages and DPR-MUF fusion.

Each task's examples are its KILT file `<data_dir>/examples/{dataset}-{split}.jsonl`, with the query
text its registered seqio Task's preprocessors make, else that Task's split (`split_examples`, which
`t5r data negatives` reads too).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Sequence

from t5_retrieval.data import layout
from t5_retrieval.data.records import DataError, Example, read_examples
from t5_retrieval.data.tasks.retrieval_tasks import registered_task, set_data_dir, text_examples, text_preprocessors
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.errors import command_with

log = logging.getLogger(__name__)


def task_examples(tasks: TaskSet, data_dir: str, split: str, names: Sequence[str] = (),
                  command_line: Sequence[str] = ()) -> dict[str, list[Example]]:
    """Examples per task of a model whose tasks are `tasks`, keyed by the model's name of each: the
    tasks `names` name in any form (a Task, its dataset, a Mixture of Tasks), or every task the model
    was trained on. A model that records no tasks (the lexical baseline) reads `dataset_examples`.

    `command_line`, when given, is the command's words (`t5r eval --tasks=...`): the error suggests
    it again with `--tasks` and `--split` changed. Raises UnknownTaskError for a name the model does
    not know, DataError naming every task without examples for `split` (none is left out in silence)."""
    if not tasks:
        return dataset_examples(data_dir, split, names)
    set_data_dir(data_dir)  # a seqio Task over `kilt_examples_source` reads its examples there
    names = list(dict.fromkeys(tasks.resolve(name) for name in tasks.expand(names))) if names else list(tasks)
    datasets = {name: tasks.dataset_of(name) for name in names}
    missing = [name for name in names if not has_split(data_dir, datasets[name], name, split)]
    if missing:
        raise DataError(_missing_examples(tasks, data_dir, split, names, missing, datasets, command_line))
    examples = {}
    for name in names:
        steps = tasks.spec(name).text_preprocessors
        if steps and registered_task(name) is None:  # a KILT file's text as written, not the Task's
            log.warning("task %s: the model trained on its query text as its seqio Task's preprocessors (%s) leave "
                        "it, but %s is scored as written: its seqio Task is not registered to rewrite it (name its "
                        "module with --gin.MIXTURE_OR_TASK_MODULE)", name, ", ".join(steps),
                        layout.examples_path(data_dir, datasets[name], split))
        examples[name] = split_examples(data_dir, datasets[name], name, split)
    return examples


def dataset_examples(data_dir: str, split: str, datasets: Sequence[str] = ()) -> dict[str, list[Example]]:
    """Examples per dataset from `<data_dir>/examples/{dataset}-{split}.jsonl` as written (every such
    file when `datasets` is empty): what a model without tasks, or a table keyed by dataset, reads."""
    if not datasets:
        suffix = f"-{split}.jsonl"
        found = sorted(glob.glob(layout.examples_path(data_dir, "*", split)))
        datasets = [os.path.basename(p)[:-len(suffix)] for p in found]
        if not datasets:
            raise DataError(f"{os.path.dirname(layout.examples_path(data_dir, 'x', split))}: no *{suffix} "
                            "files (run `t5r data tasks`)")
    out = {}
    for dataset in datasets:
        path = layout.examples_path(data_dir, dataset, split)
        if not os.path.exists(path):
            raise DataError(f"{path}: no examples for task {dataset!r}, split {split!r}")
        out[dataset] = read_examples(path)
    return out


def has_split(data_dir: str, dataset: str, task_name: str, split: str) -> bool:
    """`split_examples` has something to read: a KILT file, or a registered seqio Task with `split`."""
    if os.path.exists(layout.examples_path(data_dir, dataset, split)):
        return True
    task = registered_task(task_name)
    return task is not None and split in task.splits


def split_examples(data_dir: str, dataset: str, task_name: str, split: str) -> list[Example]:
    """The model's task `task_name` (reading `dataset`) on `split`, for evaluation and mining.

    The KILT file `<data_dir>/examples/{dataset}-{split}.jsonl` when it exists (KILT's evidence
    sets), with each query's text the registered seqio Task's when the Task's preprocessors rewrite
    it (joined by id: the model trained on their output, not on the file's text; a warning names
    them when the Task has no such split); else the registered seqio Task's split (`text_examples`)."""
    path = layout.examples_path(data_dir, dataset, split)
    task = registered_task(task_name)
    if os.path.exists(path):
        examples = [dataclasses.replace(e, task=task_name) for e in read_examples(path)]
        rewriting = text_preprocessors(task) if task is not None else []
        if task is None or not rewriting:
            return examples
        if split not in task.splits:
            log.warning("task %s: %s is scored as written, but the model trained on the query text seqio Task %s's "
                        "preprocessors (%s) rewrite, and the Task has no split %s to rewrite it", task_name, path,
                        task_name, ", ".join(rewriting), split)
            return examples
        texts = {e.id: e.query for e in text_examples(task, split)}
        missing = [e.id for e in examples if e.id not in texts]
        if missing:
            raise DataError(f"{path}: examples {missing[:3]} ({len(missing)} in all) are not among seqio Task "
                            f"{task_name!r}'s {split} examples, whose preprocessed query text the model reads; "
                            "the file and the Task must hold the same examples")
        return [dataclasses.replace(e, query=texts[e.id]) for e in examples]
    if task is not None:
        return text_examples(task, split)
    raise DataError(f"{path}: no examples for task {task_name!r} (dataset {dataset!r}), split {split!r}, and no "
                    f"registered seqio Task {task_name!r} to read instead (--gin.MIXTURE_OR_TASK_MODULE)")


def _missing_examples(tasks: TaskSet, data_dir: str, split: str, names: Sequence[str], missing: Sequence[str],
                      datasets: dict[str, str], command_line: Sequence[str]) -> str:
    """Which tasks lack `split` examples and why, then each command that scores what can be scored."""
    reasons: list[str] = []
    on_split: dict[str, list[str]] = {}
    for name in missing:
        registered = registered_task(name)
        why = f"no {layout.examples_path(data_dir, datasets[name], split)}"
        if registered is None:
            why += f" and no registered seqio Task {name!r} (no MIXTURE_OR_TASK_MODULE imported registers it)"
        else:
            splits = list(registered.splits)
            why += f", and its seqio Task has the splits {', '.join(splits)}"
            if splits:  # the Task's split of the same kind (train, or one to evaluate on)
                other = next((s for s in splits if (s == "train") == (split == "train")), splits[0])
                on_split.setdefault(other, []).append(name)
        reasons.append(name + (f" (dataset {datasets[name]})" if datasets[name] != name else "") + f": {why}")
    commands = []
    if command_line:
        words = list(command_line)
        commands = [f"to score {', '.join(group)} on {other}, `{command_with(words, tasks=','.join(group), split=other)}`"
                    for other, group in on_split.items()]
        scorable = [name for name in names if name not in missing]
        if scorable:
            commands.append(f"to score the others alone, `{command_with(words, tasks=','.join(scorable))}`")
    return (f"no {split} examples for the model's task{'s' if len(missing) > 1 else ''} {'; '.join(reasons)}"
            + (". Run, " + "; or, ".join(commands) if commands else ""))
