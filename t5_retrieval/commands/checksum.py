"""`t5r checksum DIR`: verify every recorded checksum of an artefact, or record them (`--accept`).

Every stage verifies what it opens; this command does it on demand and in full (ignoring the
verified stamp), e.g. after copying an index to a serving machine, and refuses a file no record
lists. `--accept` records the checksums of an artefact as it is now: for one written by an older
t5-retrieval, after you have checked it. One a run stopped writing (`t5r_checksums.pending`) may be
incomplete, and is accepted only with `--reason`, which the record keeps. A checkpoint step's record also covers its model
directory's config.gin.
"""

from __future__ import annotations

import argparse
import os
import time

from t5_retrieval import checksums
from t5_retrieval.errors import UserError, shell_command


def add_verify_flag(parser: argparse.ArgumentParser) -> None:
    """`--verify` of the commands that open artefacts: how they check them against their records."""
    parser.add_argument("--verify", choices=checksums.VERIFY_MODES, default="stamp",
                        help="stamp: hash the files changed since their last verification (default); full: hash "
                             "every file, to find a bit that rotted in place (docs/integrity.md)")


def _step_dir(directory: str):  # -> etils.epath.Path | None
    """A checkpoint step, whose record `checkpoint` writes and verifies; None for any other artefact.
    JAX and orbax are imported only for a directory named like a step."""
    if not os.path.basename(os.path.abspath(directory)).isdigit():
        return None
    from etils import epath

    from t5_retrieval import checkpoint

    return epath.Path(os.path.abspath(directory)) if checkpoint.is_step_dir(directory) else None


def _accept(directory: str, reason: str | None) -> tuple[int, int]:
    step_dir = _step_dir(directory)
    if step_dir is not None:
        from t5_retrieval import checkpoint

        checkpoint.write_checksums(step_dir)
        return checkpoint.verify_checksums(step_dir)
    pending = os.path.exists(os.path.join(directory, checksums.PENDING_FILE))
    if pending and not reason:
        raise checksums.ChecksumError(
            f"{directory}: {checksums.PENDING_FILE} says a t5r run was writing this artefact and stopped before it "
            "finished, so its files may be incomplete and --accept would vouch for them; run the command that wrote it "
            "again to rebuild it, or, if you have checked every file: "
            f"t5r checksum --accept --reason='<what you checked>' {shell_command([directory])}")
    accepted = {"reason": reason, "at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                "was_pending": pending} if reason else None
    files = checksums.record(directory, accepted=accepted)["files"]
    return len(files), sum(f["size"] for f in files.values())


def is_export(directory: str) -> bool:
    """`directory` is a `t5r export` or `t5r export-hf` output: a directory made to be copied, which
    carries no stamp of the machine it is on (export/portable.py)."""
    from t5_retrieval.commands.outputs import HF_EXPORT, SAVEDMODEL, kind_of

    found = kind_of(directory)
    return found is not None and found[0] in (SAVEDMODEL, HF_EXPORT)


def _verify(directory: str) -> tuple[int, int]:
    step_dir = _step_dir(directory)
    if step_dir is None:
        return checksums.verify_all(directory, stamp=not is_export(directory))
    from t5_retrieval import checkpoint

    return checkpoint.verify_checksums(step_dir)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="t5r checksum", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="an artefact directory: passage store, embeddings, index, export, "
                                          "checkpoint step")
    parser.add_argument("--accept", action="store_true",
                        help="record the checksums of every file as it is now (for an artefact you trust "
                             "that has none), instead of verifying")
    parser.add_argument("--reason", default=None,
                        help="with --accept: why you trust the files, kept in the record; needed for an artefact "
                             "a run stopped writing (t5r_checksums.pending)")
    args = parser.parse_args(argv)
    if args.reason is not None and (not args.accept or not args.reason.strip()):
        raise UserError(f"--reason={args.reason!r}: a reason is given with --accept, and says what you checked")
    if not os.path.isdir(args.directory):
        raise checksums.ChecksumError(f"{args.directory}: not a directory")
    start = time.perf_counter()
    if args.accept:
        count, size = _accept(args.directory, args.reason and args.reason.strip())
        print(f"t5r checksum: recorded {count} files of {args.directory} ({size / 2**20:.1f} MiB)")
        return 0
    count, size = _verify(args.directory)
    print(f"t5r checksum: {args.directory}: {count} files ({size / 2**20:.1f} MiB) verified in "
          f"{time.perf_counter() - start:.2f} s")
    return 0
