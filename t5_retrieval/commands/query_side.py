"""`t5r query-side`: flags -> `query_side.fine_tune_query_side`, then its report (the help shows the
method's docstring)."""

from __future__ import annotations

import argparse
import json

from t5_retrieval import logs, query_side
from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.commands.outputs import MODEL, check_output_dir


def main(argv: list[str]) -> int:
    """`t5r query-side`: fine-tune the query encoder on an answer-only QA task over a frozen index."""
    parser = argparse.ArgumentParser(prog="t5r query-side", description=query_side.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint_dir", required=True, help="the base model (t5r train)")
    parser.add_argument("--index_dir", required=True, help="the base model's index (t5r index)")
    parser.add_argument("--embeddings_dir", required=True, help="the embeddings the index was built from")
    parser.add_argument("--kb_dir", required=True, help="the passage store the embeddings cover")
    parser.add_argument("--qa_dir", required=True, help="directory of {task}-{split}-kilt.jsonl answer-only files")
    parser.add_argument("--task", required=True,
                        help="the QA task(s) to adapt to, comma-separated, e.g. nq_open or nq_open,webq")
    parser.add_argument("--as_task", required=True,
                        help="a task of the base model (registered name or dataset) whose query prefix "
                             "the new questions take")
    parser.add_argument("--output_dir", required=True, help="the new query-side model directory")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r query-side", own_kinds=(MODEL,))
    logs.setup()
    report = query_side.fine_tune_query_side(
        args.checkpoint_dir, args.index_dir, args.embeddings_dir, args.kb_dir, args.qa_dir,
        [t for t in args.task.split(",") if t], args.as_task, args.output_dir)
    print(json.dumps(report, indent=1))
    return 0
