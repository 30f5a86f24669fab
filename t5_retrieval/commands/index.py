"""`t5r index`: `--embeddings_dir` -> `retrieval.index.build_index` (backend and ScaNN parameters in gin
or flags) -> `--output_dir`."""

from __future__ import annotations

import argparse

from t5_retrieval import checksums, logs
from t5_retrieval.commands.checksum import add_verify_flag
from t5_retrieval.commands.gin_flags import parse_args
from t5_retrieval.commands.outputs import INDEX, UNFINISHED, check_output_dir
from t5_retrieval.errors import writable_output_dir
from t5_retrieval.retrieval import index as index_lib


def main(argv: list[str]) -> int:
    """`t5r index`: embedding shards -> index directory."""
    parser = argparse.ArgumentParser(prog="t5r index", description=index_lib.__doc__.splitlines()[0])
    parser.add_argument("--embeddings_dir", required=True, help="output of `t5r encode`")
    parser.add_argument("--output_dir", required=True, help="where to write the index")
    parser.add_argument("--staging_dir", default=None, help="disk for the temporary matrix (default: tmp)")
    parser.add_argument("--backend", choices=sorted(index_lib.BACKENDS), default=None,
                        help="scann, or exact (NumPy brute force, for small KBs); default: gin build_index.backend "
                             "(scann)")
    add_verify_flag(parser)  # the shards are hashed in full anyway; `full` adds the manifest and ids
    args = parse_args(parser, argv)
    logs.setup()
    # An index it rewrites, or one a killed `t5r index` left unfinished (its pending marker, no index.json).
    check_output_dir(args.output_dir, "--output_dir", "t5r index", own_kinds=(INDEX, UNFINISHED))
    backend = {} if args.backend is None else {"backend": args.backend}
    with checksums.verification(args.verify), writable_output_dir(args.output_dir, "--output_dir"):
        index = index_lib.build_index(args.embeddings_dir, staging_dir=args.staging_dir, **backend)
        index.save(args.output_dir)
    print(f"t5r index: {len(index)} passages, backend={index.backend}, wrote {args.output_dir}")
    return 0
