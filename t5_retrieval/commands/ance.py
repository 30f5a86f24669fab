"""`t5r ance`: `--work_dir` and the gin flags -> `ance.ance`, then its last evaluation table."""

from __future__ import annotations

import argparse

from t5_retrieval import ance, logs
from t5_retrieval.commands.gin_flags import TRAIN_MACROS, parse_args
from t5_retrieval.retrieval.evaluate import format_table


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r ance", description=ance.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work_dir", required=True, help="where every stage writes (resumed if it exists)")
    args = parse_args(parser, argv, reads=TRAIN_MACROS)
    logs.setup()
    tables = ance.ance(args.work_dir)
    print(format_table(tables), end="")
    return 0
