"""`t5r fuse`: flags -> `fusion.fuse.fuse_experts`, then every method's table and the experts' confidences."""

from __future__ import annotations

import argparse
import json

from t5_retrieval import logs
from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.commands.outputs import check_output_dir
from t5_retrieval.fusion import fuse
from t5_retrieval.retrieval.evaluate import format_table


def main(argv: list[str]) -> int:
    """`t5r fuse`: DPR-MUF fusion of single-task experts, scored with the KILT metrics."""
    parser = argparse.ArgumentParser(prog="t5r fuse", description=fuse.__doc__.splitlines()[0])
    parser.add_argument("--expert", action="append", default=[],
                        help="TASK,CHECKPOINT_DIR,INDEX_DIR (repeat per expert; CHECKPOINT_DIR may be lexical:<dim>)")
    parser.add_argument("--data_dir", required=True, help="processed data (examples/, kb/)")
    parser.add_argument("--kb_dir", default=None, help="passage store (default: <data_dir>/kb)")
    parser.add_argument("--tasks", default="", help="comma-separated eval tasks (default: the experts' tasks)")
    parser.add_argument("--split", default="dev", help="split to evaluate")
    parser.add_argument("--train_split", default="train", help="split the ensembles are trained on")
    parser.add_argument("--calibration_split", default="dev", help="split the temperature is calibrated on")
    parser.add_argument("--output_dir", required=True, help="where every fusion method's results are written")
    args = parse_args(parser, argv, reads=TASK_MODULE)
    check_output_dir(args.output_dir, "--output_dir", "t5r fuse")
    logs.setup()
    result = fuse.fuse_experts(args.expert, args.data_dir, args.output_dir, kb_dir=args.kb_dir,
                               tasks=[t for t in args.tasks.split(",") if t], split=args.split,
                               train_split=args.train_split, calibration_split=args.calibration_split)
    for method, evaluation in result.results.items():
        print(f"== {method}")
        print(format_table(evaluation.tables), end="")
    print("== mean confidence (expert x eval task)")
    print(json.dumps(result.confidence, indent=1))
    return 0
