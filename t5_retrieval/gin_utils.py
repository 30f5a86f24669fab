"""t5x-style gin flags shared by every subcommand: --gin_file, --gin.NAME=value, --gin_search_path."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

import gin

# The project's gin files ship inside the package (a wheel carries them; `gin_configs/` at the top
# of a source checkout links here), so `--gin_file=models/t5_base.gin` resolves from any directory.
GIN_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gin_configs")


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gin_file", action="append", default=[],
                        help="gin file to load (repeatable; later files override earlier ones).")
    parser.add_argument("--gin_search_path", action="append", default=[],
                        help="extra directories for gin `include` and --gin_file lookups.")


def split_gin_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separates `--gin.NAME=value` bindings (t5x syntax) from the other arguments."""
    bindings, rest = [], []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin."):].partition("=")
            if not sep:
                raise SystemExit(f"--gin.{name}: expected --gin.NAME=value")
            bindings.append(f"{name} = {value}")
        else:
            rest.append(arg)
    return bindings, rest


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
    """Loads gin files (resolved against the search paths and gin_configs/) and applies bindings."""
    for path in [*search_paths, GIN_CONFIGS_DIR]:
        gin.add_config_file_search_path(path)
    # gin probes each search path with a reader that logs "Path not found" at ERROR for every miss.
    logging.disable(logging.ERROR)
    try:
        gin.parse_config_files_and_bindings(list(gin_files), list(bindings), finalize_config=False)
    finally:
        logging.disable(logging.NOTSET)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parses a subcommand's argv: gin overrides, gin files, then the parser's own flags."""
    add_gin_flags(parser)
    bindings, rest = split_gin_overrides(argv)
    args = parser.parse_args(rest)
    parse_gin(args.gin_file, bindings, args.gin_search_path)
    return args
