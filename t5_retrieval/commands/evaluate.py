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

from t5_retrieval.commands.inputs import add_search_flags, load_search_inputs
from t5_retrieval.retrieval.evaluate import evaluate, format_table, write_results


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
        inputs = load_search_inputs(args)
        result = evaluate(inputs.encoder, inputs.index, inputs.examples, inputs.store,
                          datasets={task: spec.dataset for task, spec in inputs.specs.items()})
        write_results(result, args.output_dir)
    print(format_table(result.tables), end="")
    return 0

