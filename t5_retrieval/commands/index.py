"""`t5r index`: `--embeddings_dir` -> `retrieval.index.build_index` (backend and ScaNN parameters in gin
or flags) -> `--output_dir`; or, with `--backend=bm25`, `--kb_dir` -> `build_bm25_index_for_kb` -> `--output_dir`."""

from __future__ import annotations

import argparse
import os

from t5_retrieval import checksums, logs
from t5_retrieval.artefact_io import writable_output_dir
from t5_retrieval.commands.checksum import add_verify_flag
from t5_retrieval.commands.gin_flags import parse_args
from t5_retrieval.commands.outputs import INDEX, UNFINISHED, check_output_dir
from t5_retrieval.data.stores import bm25 as _bm25  # noqa: F401  (gin: index_passages.k1, .b)
from t5_retrieval.errors import UserError
from t5_retrieval.retrieval import index as index_lib


def main(argv: list[str]) -> int:
    """`t5r index`: embedding shards (or a KB, for BM25) -> index directory."""
    parser = argparse.ArgumentParser(prog="t5r index", description=index_lib.__doc__.splitlines()[0])
    parser.add_argument("--embeddings_dir", default=None, help="output of `t5r encode` (the scann and exact backends)")
    parser.add_argument("--kb_dir", default=None,
                        help="passage store to index with --backend=bm25 (t5r data kb: <data_dir>/kb)")
    parser.add_argument("--output_dir", required=True, help="where to write the index")
    parser.add_argument("--staging_dir", default=None, help="disk for the temporary matrix (default: tmp)")
    parser.add_argument("--backend", choices=sorted(index_lib.BACKENDS), default=None,
                        help="scann, exact (NumPy brute force, for small KBs), or bm25 (query texts over --kb_dir, "
                             "no model); default: gin build_index.backend (scann)")
    add_verify_flag(parser)  # the shards are hashed in full anyway; `full` adds the manifest and ids
    args = parse_args(parser, argv)
    logs.setup()
    bm25 = args.backend == "bm25"
    if (args.embeddings_dir is None) == (args.kb_dir is None):
        raise UserError("give exactly one of --embeddings_dir (t5r encode's output: scann, exact) and --kb_dir "
                        "(a passage store, <data_dir>/kb: --backend=bm25)")
    if bm25 and args.kb_dir is None:
        raise UserError("--backend=bm25 indexes a KB's texts: give --kb_dir (<data_dir>/kb), not --embeddings_dir")
    if args.kb_dir is not None and not bm25:
        raise UserError(f"--kb_dir is indexed by --backend=bm25 only: t5r index --backend=bm25 --kb_dir={args.kb_dir} "
                        f"--output_dir={args.output_dir}")
    # An index it rewrites, or one a killed `t5r index` left unfinished (its pending marker, no index.json).
    check_output_dir(args.output_dir, "--output_dir", "t5r index", own_kinds=(INDEX, UNFINISHED))
    backend = {} if args.backend is None else {"backend": args.backend}
    with checksums.verification(args.verify), writable_output_dir(args.output_dir, "--output_dir"):
        if bm25:
            index: index_lib.Index = index_lib.build_bm25_index_for_kb(os.path.abspath(args.kb_dir))
        else:
            index = index_lib.build_index(args.embeddings_dir, staging_dir=args.staging_dir, **backend)
        index.save(args.output_dir)
    print(f"t5r index: {len(index)} passages, backend={index.backend}, wrote {args.output_dir}")
    return 0
