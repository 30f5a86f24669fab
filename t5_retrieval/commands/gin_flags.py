"""t5x-style gin flags shared by every subcommand: --gin_file, --gin.NAME=value, --gin_search_paths."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from t5_retrieval import gin_utils
from t5_retrieval.errors import UserError


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gin_file", action="append", default=[],
                        help="gin file to load (repeatable; later files override earlier ones).")
    parser.add_argument("--gin_search_paths", "--gin_search_path", action="append", default=[],
                        help="extra directories for gin `include` and --gin_file lookups (comma-separated "
                             "and/or repeated, as in t5x).")


GIN_HELP = ("gin: --gin.NAME=value binds a macro (NAME) or a configurable's parameter (configurable.param), "
            "t5x style: strings are quoted (--gin.DATA_DIR=\"'/data/kilt'\"), and --gin. flags override the gin "
            "files. A value nothing reads is an error naming it.")
# The launch macros (t5x's names) and what they mean, for the commands that read them.
MACROS = {
    "MODEL_DIR": "the model directory (same as --model_dir)",
    "MIXTURE_OR_TASK_NAME": "a registered seqio Task or Mixture to train on",
    "MIXTURE_OR_TASK_MODULE": "module(s) registering your own seqio Tasks and Mixtures, imported before tasks "
                              "are named (--gin.MIXTURE_OR_TASK_MODULE=\"'my_tasks'\"); eval, mine and serve "
                              "import the one the model's config.gin records when --task_module names it, "
                              "or the one this names instead",
    "DATA_DIR": "processed data directory (t5r data ...)",
    "VOCABULARY": "sentencepiece .model or WordPiece vocab.txt",
    "TRAIN_STEPS": "training steps",
    "INITIAL_CHECKPOINT_PATH": "a t5r model or Hugging Face T5/BERT directory to start from",
}
TRAIN_MACROS = tuple(MACROS)
TASK_MODULE = ("MIXTURE_OR_TASK_MODULE",)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str], reads: Sequence[str] = ()) -> argparse.Namespace:
    """Parses a subcommand's argv: gin overrides, gin files, then the parser's own flags. `--help`
    explains the `--gin.` flags and the launch macros in `reads`.

    A malformed `--gin.` flag is a usage error like any malformed flag (argparse's usage line, then
    `t5r <command>: error: ...`); a gin file or binding that cannot work (`gin_utils.apply_command_line`:
    syntax, encoding, unknown or unread names, required macros left unset) raises its ConfigError,
    which `t5r` shows as one line naming the file and line. Both exit with status 2 before any work.
    """
    add_gin_flags(parser)
    parser.epilog = " ".join(filter(None, [parser.epilog, GIN_HELP] + [f"{name}: {MACROS[name]}." for name in reads]))
    try:
        bindings, rest = gin_utils.split_gin_overrides(argv)
    except UserError as e:
        parser.error(str(e))
    args = parser.parse_args(rest)
    args.command_line = [*parser.prog.split(), *argv]  # for an error's suggestions (`errors.command_with`)
    search_paths = [p for arg in args.gin_search_paths for p in arg.split(",") if p]
    gin_utils.apply_command_line(args.gin_file, bindings, search_paths)
    return args
