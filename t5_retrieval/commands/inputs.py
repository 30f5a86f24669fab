"""What the retrieval commands share: which encoder (`--checkpoint_dir` or the lexical baseline),
and for searching commands which KB, examples and index, opened and checked against each other."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from t5_retrieval.errors import UserError
from t5_retrieval.data import layout
from t5_retrieval.data.tasks import task_names
from t5_retrieval.data.records import DataError, Example
from t5_retrieval.data.tasks.retrieval_tasks import has_split, split_examples
from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.encoder import (Encoder, HashedBagOfWordsEncoder, dataset_of, model_task_name,
                                            recorded_tasks)
from t5_retrieval.retrieval.evaluate import load_task_examples
from t5_retrieval.retrieval.index import Index, load_index


def add_encoder_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every retrieval CLI uses to choose its query/passage encoder."""
    parser.add_argument("--checkpoint_dir", help="model directory (t5r train, t5r query-side, or a results row)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--lexical_baseline_dim", type=int, default=None,
                        help="use the hashed bag-of-words baseline of this dim instead of a checkpoint")


def encoder_from_flags(args: argparse.Namespace) -> Encoder:
    if (args.checkpoint_dir is None) == (args.lexical_baseline_dim is None):
        raise UserError("give exactly one of --checkpoint_dir and --lexical_baseline_dim")
    if args.lexical_baseline_dim is not None:
        return HashedBagOfWordsEncoder(args.lexical_baseline_dim)
    return load_encoder(args.checkpoint_dir, step=args.step)  # ConfigError for --step of a query-side model


@dataclasses.dataclass
class SearchInputs:
    """What `t5r eval` and `t5r mine` both start from, checked against each other.

    `examples` and `datasets` are keyed by the task names the user gave (`--tasks`, either form),
    else by dataset; each example's `task` is the model's name for it (its query prefix)."""

    store: Any  # data.kb.PassageStore
    examples: dict[str, list[Example]]
    datasets: dict[str, str]  # the same keys -> the dataset whose example (and negatives) files they are
    index: Index
    encoder: Encoder


def add_search_flags(parser: argparse.ArgumentParser, default_split: str) -> None:
    """Flags shared by the CLIs that search an index with a query encoder over task examples."""
    add_encoder_flags(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--data_dir", required=True, help="processed data (examples/, kb/, negatives/)")
    parser.add_argument("--kb_dir", default=None, help="passage store (default: <data_dir>/kb)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated tasks, by dataset (fever) or registered name (demo_fever); "
                             "default: every dataset the model was trained on that has examples for --split")
    parser.add_argument("--split", default=default_split)


def load_search_inputs(args: argparse.Namespace) -> SearchInputs:
    """Opens the KB, examples, index and encoder of `add_search_flags`; refuses a mismatched index.

    Raises DataError or IndexMismatchError naming the file or field at fault.
    """
    from t5_retrieval.data.stores.kb import PassageStore

    store = PassageStore.open(args.kb_dir or layout.kb_dir(args.data_dir))
    index = load_index(args.index_dir)
    encoder = encoder_from_flags(args)
    index.check(encoder, store.ids())
    examples, datasets = task_examples(encoder, args.data_dir, args.split, [t for t in args.tasks.split(",") if t])
    return SearchInputs(store, examples, datasets, index, encoder)


def register_named_mixtures(tasks: task_names.Tasks, names: Sequence[str]) -> None:
    """Registers the project's seqio Tasks and Mixtures when one of `names` is neither one of the
    model's tasks nor a dataset of one, so it may name one of the project's Mixtures (a
    MIXTURE_OR_TASK_MODULE's are registered by its flag)."""
    if tasks and not all(task_names.knows(tasks, name) for name in names):
        import t5_retrieval.tasks  # noqa: F401  (the project's Mixtures, by name)


def expand_task_names(tasks: task_names.Tasks, names: Sequence[str]) -> list[str]:
    """`names` with registered seqio Mixtures (the project's, or a MIXTURE_OR_TASK_MODULE's) replaced
    by the model's Tasks they hold."""
    register_named_mixtures(tasks, names)
    return task_names.expand(tasks, names)


def task_examples(encoder: Encoder, data_dir: str, split: str, names: Sequence[str]
                  ) -> tuple[dict[str, list[Example]], dict[str, str]]:
    """(examples, dataset) per task name: `names` in either form, or every dataset the model was trained
    on with an examples file for `split` (every file found, for an encoder that records no tasks).

    Raises UnknownTaskError for a name the model does not know, DataError for a missing file."""
    tasks = recorded_tasks(encoder)
    if not tasks:
        examples = load_task_examples(data_dir, split, names)
        return examples, {name: name for name in examples}
    import t5_retrieval.tasks  # noqa: F401  (the project's Tasks, read when a KILT file is missing)

    if not names:
        names = [d for d in task_names.datasets(tasks)
                 if has_split(data_dir, d, task_names.resolve(tasks, d), split)]
        if not names:
            raise DataError(f"{os.path.dirname(layout.examples_path(data_dir, 'x', split))}: no {split} examples "
                            f"for any dataset the model was trained on ({', '.join(task_names.datasets(tasks))})")
    examples, datasets = {}, {}
    for name in expand_task_names(tasks, names):
        task, datasets[name] = model_task_name(encoder, name), dataset_of(encoder, name)
        examples[name] = split_examples(data_dir, datasets[name], task, split)
    return examples, datasets


