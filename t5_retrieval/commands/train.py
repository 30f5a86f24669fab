"""`t5r train`: `--model_dir` and the gin flags -> `train.train` (the help shows the trainer's docstring)."""

from __future__ import annotations

import argparse
import os
import shutil

from t5_retrieval import checkpoint, logs
from t5_retrieval import train as trainer
from t5_retrieval.artefact_io import check_writable_dir
from t5_retrieval.commands.gin_flags import TRAIN_MACROS, parse_args
from t5_retrieval.commands.outputs import MODEL, check_output_dir


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r train", description=trainer.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="where checkpoints, config and metrics go")
    args = parse_args(parser, argv, reads=TRAIN_MACROS)
    check_output_dir(args.model_dir, "--model_dir", "t5r train", own_kinds=(MODEL,))
    logs.setup()
    trainer.portable_bindings()
    created = not os.path.exists(args.model_dir)
    check_writable_dir(args.model_dir, "--model_dir")
    # Refused while another run holds the directory: before the `try`, whose clean-up would remove
    # the other run's directory when both saw it missing.
    with trainer.hold_model_dir(args.model_dir):
        try:
            trainer.train(args.model_dir, command_line=True)
        except BaseException:
            if created and not checkpoint.saved_steps(args.model_dir):  # a failed start leaves nothing behind
                shutil.rmtree(args.model_dir, ignore_errors=True)
            raise
    return 0
