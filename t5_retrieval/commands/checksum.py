"""`t5r checksum DIR`: verify every recorded checksum of an artefact, or record them (`--accept`).

Every stage verifies what it opens; this command does it on demand and in full (ignoring the
verified stamp), e.g. after copying an index to a serving machine. `--accept` records the checksums
of an artefact as it is now: for one written by an older t5-retrieval, after you have checked it.
"""

from __future__ import annotations

import argparse
import os
import time

from t5_retrieval import checksums


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r checksum", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="an artefact directory: passage store, embeddings, index, export, "
                                          "checkpoint step")
    parser.add_argument("--accept", action="store_true",
                        help="record the checksums of every file as it is now (for an artefact you trust "
                             "that has none), instead of verifying")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.accept:
        if not os.path.isdir(args.directory):
            raise checksums.ChecksumError(f"{args.directory}: not a directory")
        files = checksums.record(args.directory)["files"]
        print(f"t5r checksum: recorded {len(files)} files of {args.directory} "
              f"({sum(f['size'] for f in files.values()) / 2**20:.1f} MiB)")
        return 0
    count, size = checksums.verify_all(args.directory)
    print(f"t5r checksum: {args.directory}: {count} files ({size / 2**20:.1f} MiB) verified in "
          f"{time.perf_counter() - start:.2f} s")
    return 0
