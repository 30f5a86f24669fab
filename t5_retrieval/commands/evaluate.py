"""`t5r eval`: retrieve with a model and an index, score every task with the KILT metrics.

`t5r eval --index_dir=... --data_dir=... --output_dir=... (--checkpoint_dir=... | --lexical_baseline_dim=N)`
writes results.json, results.txt, predictions/{task}.jsonl (official KILT format) and
predictions/{task}.trec (TREC run), each keyed and named by the model's name of the task
(`demo_fever`, whether --tasks names it so, by its dataset or by a Mixture). An index built by
`t5r index --backend=bm25` takes no model: it searches the query texts of the examples files, or of
the registered Tasks `--tasks` names (a user's Task module named by `--task_module`).
"""

from __future__ import annotations

import argparse
import os

from t5_retrieval.commands.inputs import add_search_flags, load_search_inputs
from t5_retrieval.retrieval.evaluate import EvalResult, evaluate, format_table, write_results


def main(argv: list[str]) -> int:
    """`t5r eval`: KILT metrics per task for an index and a query encoder."""
    from t5_retrieval.artefact_io import writable_output_dir
    from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
    from t5_retrieval.commands.outputs import check_output_dir

    parser = argparse.ArgumentParser(prog="t5r eval", description=__doc__.splitlines()[0])
    add_search_flags(parser, default_split="dev")
    parser.add_argument("--output_dir", required=True,
                        help="where results.json, results.txt and predictions/{task}.jsonl|.trec are written")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r eval")
    with writable_output_dir(args.output_dir, "--output_dir"):  # checked before retrieval, not after it
        if _is_bm25_index(args):
            result = _evaluate_bm25(args)
        else:
            inputs = load_search_inputs(args)
            result = evaluate(inputs.encoder, inputs.index, inputs.examples, inputs.store)
        write_results(result, args.output_dir)
    print(format_table(result.tables), end="")
    return 0


def _is_bm25_index(args: argparse.Namespace) -> bool:
    """Whether --index_dir holds a BM25 index (its index.json verified before it is read)."""
    from t5_retrieval import checksums
    from t5_retrieval.retrieval.index import read_record

    with checksums.verification(args.verify):
        return read_record(args.index_dir)["backend"] == "bm25"


def _evaluate_bm25(args: argparse.Namespace) -> EvalResult:
    """A BM25 index's rankings of the query texts of `--tasks` (datasets: examples files as written;
    registered Tasks, a user's from `--task_module` too: their own query text), scored as a model's
    are; refuses a model flag, since BM25 has none."""
    from t5_retrieval import checksums, gin_utils
    from t5_retrieval.data import layout
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.data.tasks.examples import dataset_examples, task_examples
    from t5_retrieval.data.tasks.task_names import TaskSet
    from t5_retrieval.errors import UserError, shell_command, without_flags
    from t5_retrieval.retrieval.index import INDEX_JSON, load_index

    model_flags = [flag for flag in ("checkpoint_dir", "step", "lexical_baseline_dim")
                   if getattr(args, flag) is not None]
    if model_flags:
        flags = {f"--{flag}" for flag in model_flags}
        words = without_flags(args.command_line, flags)
        raise UserError(f"{os.path.join(args.index_dir, INDEX_JSON)}: a BM25 index searches the query texts and takes "
                        f"no model ({', '.join(sorted(flags))} given); run `{shell_command(words)}`")
    with checksums.verification(args.verify):
        store = PassageStore.open(args.kb_dir or layout.kb_dir(args.data_dir))
        index = load_index(args.index_dir)
    index.check(passage_ids=store.ids())
    gin_utils.import_modules(args.task_module)  # no model records them: --task_module names them itself
    names = [t for t in args.tasks.split(",") if t]
    if not names:
        return evaluate(None, index, dataset_examples(args.data_dir, args.split), store)
    # A registered Task (a user's, from --task_module) is searched with its own query text; any other name is a dataset
    examples = task_examples(TaskSet.registered(names), args.data_dir, args.split, names, args.command_line)
    return evaluate(None, index, examples, store)
