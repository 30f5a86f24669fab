"""What the retrieval commands share: which encoder (`--checkpoint_dir` or the lexical baseline),
and for searching commands which KB, examples and index, opened and checked against each other (a
BM25 index takes no encoder: it searches the query texts)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from t5_retrieval import checksums, gin_utils
from t5_retrieval.commands.checksum import add_verify_flag
from t5_retrieval.data import layout
from t5_retrieval.data.records import Example
from t5_retrieval.data.tasks.examples import task_examples
from t5_retrieval.data.tasks.task_names import TaskSet
from t5_retrieval.data.tasks.task_spec import TaskSpec
from t5_retrieval.errors import UserError, shell_command, without_flags
from t5_retrieval.inference import load_encoder
from t5_retrieval.retrieval.encoder import Encoder, HashedBagOfWordsEncoder
from t5_retrieval.retrieval.index import INDEX_JSON, Index, load_index, read_record


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

    `examples` and `specs` are keyed by the model's name of each task (`--tasks` names them in any
    form), the name `t5r eval`'s results and predictions files and each example's `task` carry; a
    model that records no tasks (the lexical baseline) keys them by the names given, else by dataset;
    without a model (`encoder` None: a BM25 index), a registered Task by its name, any other name as a
    dataset."""

    store: Any  # data.kb.PassageStore
    examples: dict[str, list[Example]]
    specs: dict[str, TaskSpec]  # the same keys -> the task (its dataset, and its negatives files' name)
    index: Index
    encoder: Encoder | None


def add_task_module_flag(parser: argparse.ArgumentParser) -> None:
    """`--task_module`: the user's consent to run the Task module a model's config.gin names."""
    parser.add_argument("--task_module", action="append", default=[], metavar="NAME",
                        help="import this seqio Task module that the model's config.gin records (repeatable); "
                             "it runs as Python code, so a model directory alone never imports one")


def add_search_flags(parser: argparse.ArgumentParser, default_split: str) -> None:
    """Flags shared by the CLIs that search an index with a query encoder over task examples."""
    add_encoder_flags(parser)
    add_task_module_flag(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--data_dir", required=True, help="processed data (examples/, kb/, negatives/)")
    parser.add_argument("--kb_dir", default=None, help="passage store (default: <data_dir>/kb)")
    parser.add_argument("--tasks", default="",
                        help="comma-separated tasks, by dataset (fever) or registered name (demo_fever); "
                             "default: every dataset the model was trained on that has examples for --split")
    parser.add_argument("--split", default=default_split, help="the examples' split to search, e.g. dev or train")
    add_verify_flag(parser)


def load_search_inputs(args: argparse.Namespace) -> SearchInputs:
    """Opens the KB, examples, index and encoder of `add_search_flags`; refuses a mismatched index.

    A BM25 index (dim 0) takes no model: it searches the query texts of the examples files, or of
    the registered Tasks `--tasks` names (a user's from `--task_module`). Raises DataError or
    IndexMismatchError naming the file or field at fault.
    """
    from t5_retrieval.data.stores.kb import PassageStore

    with checksums.verification(args.verify):
        if not read_record(args.index_dir)["dim"]:  # before the index or the KB is loaded
            _refuse_model_flags(args)
        store = PassageStore.open(args.kb_dir or layout.kb_dir(args.data_dir))
        index = load_index(args.index_dir)
        encoder = encoder_from_flags(args) if index.dim else None
    index.check(encoder, store.ids())
    names = [t for t in args.tasks.split(",") if t]
    if encoder is None:
        gin_utils.import_modules(args.task_module)  # no model records them: --task_module names them itself
        tasks = TaskSet.registered(names)
    else:
        import_task_modules(args)
        tasks = encoder.tasks
    examples = task_examples(tasks, args.data_dir, args.split, names, args.command_line)
    return SearchInputs(store, examples, {task: tasks.spec(task) for task in examples}, index, encoder)


def _refuse_model_flags(args: argparse.Namespace) -> None:
    """A BM25 index takes no model: a model flag is refused with the command without it."""
    flags = {f"--{flag}" for flag in ("checkpoint_dir", "step", "lexical_baseline_dim")
             if getattr(args, flag) is not None}
    if flags:
        command = shell_command(without_flags(args.command_line, flags))
        raise UserError(f"{os.path.join(args.index_dir, INDEX_JSON)}: a BM25 index searches the query texts and "
                        f"takes no model ({', '.join(sorted(flags))} given); run `{command}`")


def import_task_modules(args: argparse.Namespace) -> None:
    """Imports the modules that registered the model's own seqio Tasks, as the config.gin of
    `--checkpoint_dir` (or of a query-side model's base) records them (t5x's MIXTURE_OR_TASK_MODULE
    and the directory it came from), unless --gin.MIXTURE_OR_TASK_MODULE names the modules to use.

    A model directory is data someone handed over: a module it records is imported only when
    `--task_module` names it (as transformers' `trust_remote_code`); otherwise a UserError says
    which flag to pass."""
    from t5_retrieval.checkpoint import trained_config_gin

    if args.checkpoint_dir is None or gin_utils.macro_is_set("MIXTURE_OR_TASK_MODULE"):
        return
    config = trained_config_gin(args.checkpoint_dir)
    modules, path = gin_utils.recorded_task_modules(config)
    unnamed = [m for m in modules if m not in args.task_module]
    if unnamed:
        where = f" from {', '.join(path)} (make_train_iterator.task_module_path)" if path else ""
        raise UserError(f"{config}: the model's Tasks are registered by the module(s) {', '.join(unnamed)} it records "
                        f"(make_train_iterator.task_module){where}, and loading a model runs no code it names; if "
                        "you trust them, pass " + " ".join(f"--task_module={m}" for m in unnamed))
    gin_utils.import_modules(args.task_module, path, recorded_in=config)
