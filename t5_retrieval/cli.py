"""`t5r`: one entry point, one subcommand per pipeline stage, and the one place errors are shown.

Each command lives in `t5_retrieval/commands/` and exposes ``main(argv: list[str]) -> int``; this
file only maps names to them, importing a command lazily so that `t5r --help` stays fast and a
command's heavy dependencies (TensorFlow, ScaNN) load only when it runs. A `UserError` (or a
missing, unwritable or full path) raised anywhere below becomes one line, `t5r <command>: error:
...`, and exit status 2; anything else is a bug and keeps its traceback. Flag syntax errors are
argparse's: the usage line, then the same one line and status 2.
"""

from __future__ import annotations

import errno
import glob
import importlib
import logging
import os
import re
import sys

from t5_retrieval.artefact_io import disk_full, is_disk_full
from t5_retrieval.errors import DEBUG_ENV, DiskFullError, UserError

# gin appends where a configurable raised ("  In call to configurable ..."); a user error says it all.
_GIN_CONTEXT = "\n  In call to configurable"
_OS_ERROR = re.compile(r"\[Errno \d+\] (?P<what>[^:]+): '(?P<path>.*)'")

# name -> ("module:function", one-line help). Two-word commands ("data kb") are written with a space.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("t5_retrieval.commands.train:main", "Train a dual encoder (gin-configured)."),
    "plan": ("t5_retrieval.commands.plan:main",
             "Compile the train and encode steps for a TPU or GPU slice; memory, time, collectives."),
    "data kb": ("t5_retrieval.commands.data:kb_main", "Chunk a KILT knowledge source into passages."),
    "data tasks": ("t5_retrieval.commands.data:tasks_main", "Turn KILT task files into examples."),
    "data negatives": ("t5_retrieval.commands.data:negatives_main", "Mine BM25 hard negatives."),
    "data demo": ("t5_retrieval.commands.data:demo_main", "Write the built-in synthetic KILT-format data."),
    "data download-kilt": ("t5_retrieval.commands.data:download_main", "Download official KILT files."),
    "data slice": ("t5_retrieval.commands.data:slice_main", "Unpack the shipped mini-KILT demo slice (or rebuild it)."),
    "vocab train": ("t5_retrieval.commands.data:vocab_main", "Train a sentencepiece vocabulary on a KB."),
    "analyze": ("t5_retrieval.commands.analyze:main", "TACO task-specialisation figures and numbers."),
    "encode": ("t5_retrieval.commands.encode:main", "Embed the KB with a checkpoint into shards."),
    "index": ("t5_retrieval.commands.index:main", "Build an index: ScaNN or exact from embeddings, BM25 from a KB."),
    "eval": ("t5_retrieval.commands.evaluate:main", "Retrieve and score with the KILT metrics."),
    "mine": ("t5_retrieval.commands.mine:main", "Mine hard negatives with the current model."),
    "fuse": ("t5_retrieval.commands.fuse:main", "DPR-MUF: fuse single-task experts by model uncertainty."),
    "ance": ("t5_retrieval.commands.ance:main", "Warm-up, then ANCE episodes of (mine, train, eval)."),
    "serve": ("t5_retrieval.commands.serve:main", "HTTP search API over an index."),
    "export": ("t5_retrieval.commands.export:main", "One TF SavedModel (tokenizer, encoder, ScaNN) for serving."),
    "export-hf": ("t5_retrieval.commands.export_hf:main", "A Hugging Face (transformers / sentence-transformers) directory."),
    "query-side": ("t5_retrieval.commands.query_side:main", "Fine-tune the query encoder over a frozen index."),
    "results": ("t5_retrieval.commands.results:main", "The mini-KILT results table, row by row (resumable)."),
    "demo": ("t5_retrieval.commands.demo:main", "`make demo`: BM25, MiniLM, naive and TACO rows on the shipped real-data slice."),
    "checksum": ("t5_retrieval.commands.checksum:main", "Verify an artefact's checksums in full, or record them."),
}


def _usage(group: str | None = None) -> str:
    """The command list; for a group ("data"), its subcommands only."""
    names = [n for n in COMMANDS if group is None or n.split()[0] == group]
    width = max(len(name) for name in names)
    head = f"t5r {group} SUBCOMMAND" if group else "t5r COMMAND"
    lines = [f"usage: t5r [--debug] {head.removeprefix('t5r ')} [args...]   ({head} --help for its flags)", ""]
    lines += [f"  {name:<{width}}  {COMMANDS[name][1]}" for name in names]
    return "\n".join(lines)


GROUPS = sorted({name.split()[0] for name in COMMANDS if " " in name})


def resolve(argv: list[str]) -> tuple[str, list[str]]:
    """Splits argv into the longest command name that matches and the remaining arguments."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return name, argv[words:]
    known = ", ".join(sorted(COMMANDS))
    raise ValueError(f"unknown command {' '.join(argv[:2])!r}; known commands: {known}")


def user_message(error: BaseException) -> str | None:
    """What `t5r` prints for an error the user can fix; None for a bug (which keeps its traceback)."""
    if isinstance(error, UserError):
        return str(error).split(_GIN_CONTEXT)[0]
    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, NotADirectoryError,
                          IsADirectoryError)):
        # A path the user gave: missing, in the way or not allowed. (gin's re-raised copy keeps the
        # message but not `filename`, hence the parse.)
        text = str(error).split(_GIN_CONTEXT)[0]
        parsed = _OS_ERROR.fullmatch(text)
        return f"{parsed['path']}: {parsed['what']}" if parsed else text
    if is_disk_full(error):
        return str(disk_full(getattr(error, "filename", None) or "the output directory", error))
    if isinstance(error, OSError) and f"[Errno {errno.EROFS}]" in str(error):  # gin's copy loses .errno
        parsed = _OS_ERROR.fullmatch(str(error).split(_GIN_CONTEXT)[0])
        where = parsed["path"] if parsed else error.filename or "the output directory"
        return f"{where}: read-only file system; choose an output directory you can write to"
    return None


# Device files through which this host's processes reach an accelerator: a TPU's chips (/dev/accel*
# on TPU VMs up to v4, VFIO groups from v5e on; libtpu opens one or the other), an NVIDIA GPU (as
# JAX looks for one; /dev/dxg under WSL2) or an AMD GPU (the KFD driver).
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg",
                            "/dev/kfd")


def run_on_cpu_without_accelerators() -> None:
    """On a host without accelerators, JAX runs on the CPU without first trying to start a TPU.

    With libtpu installed (the `tpu` extra, and requirements-dev.txt for `t5r plan`), JAX starts its TPU backend
    in every process that uses it: on a host without TPUs that loads libtpu and has it print its
    complaints ("could not determine TPU accelerator type", "unexpected worker hostname ... from env
    var TPU_WORKER_HOSTNAMES") before JAX falls back to the CPU, which users take for an error.
    `JAX_PLATFORMS=cpu`, JAX's own switch, skips the TPU backend. It is set only where no
    accelerator device file exists and the user has not set JAX_PLATFORMS (even to "", JAX's "choose
    for me"), so a TPU VM or a GPU host keeps JAX's choice. `t5r plan` compiles for TPUs through
    libtpu's topology description, which does not need the TPU backend."""
    if "JAX_PLATFORMS" in os.environ or any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICE_FILES):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"  # read when JAX is imported, here and in the processes a command starts
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.jax_platforms is None:  # an in-process caller imported JAX already
        jax.config.update("jax_platforms", "cpu")


# Commands whose failure leaves library threads and exit handlers that fail again on the way out.
_TEARDOWN_NOISE: list[str] = []


def run() -> None:
    """The `t5r` executable: `main`, then exit.

    After a full disk has been reported in one line, the process ends without interpreter
    finalization (`os._exit`, once output and logs are flushed). A failed orbax save leaves
    tensorstore writes in flight that orbax gives no handle to wait for; their completion callbacks
    run Python from tensorstore's threads whenever the writes finish, and one arriving while the
    interpreter finalizes imports with `sys.meta_path` None, which fails the exit (status 1, a
    traceback). Without finalization there is nothing for them to race; the status is the report's.
    What the libraries' threads still print is not shown (`--debug` shows it, and finalizes)."""
    code = main()
    if _TEARDOWN_NOISE:  # only a one-line report (never `--debug`) adds to it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Runs one command. Errors the user can fix are one line, `t5r <command>: error: <path>: ...`,
    with exit status 2; `t5r --debug <command> ...` (or T5R_DEBUG=1) shows their traceback."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "--debug":
        return _run_command(argv, debug=os.environ.get(DEBUG_ENV, "") not in ("", "0"))
    previous = os.environ.get(DEBUG_ENV)
    os.environ[DEBUG_ENV] = "1"  # libraries that quieten third-party noise read it too
    try:
        return _run_command(argv[1:], debug=True)
    finally:  # an in-process caller's later commands are not in debug mode
        if previous is None:
            del os.environ[DEBUG_ENV]
        else:
            os.environ[DEBUG_ENV] = previous


def _run_command(argv: list[str], debug: bool) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in GROUPS and (len(argv) == 1 or argv[1] in ("-h", "--help")):
        print(_usage(argv[0]))
        return 0
    try:
        name, rest = resolve(argv)
    except ValueError as e:
        print(f"t5r: error: {e}", file=sys.stderr)
        return 2
    if not debug:  # TensorFlow's start-up lines (no CUDA driver, oneDNN, CPU features) say nothing to act on
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    run_on_cpu_without_accelerators()
    target, _ = COMMANDS[name]
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    try:
        return int(function(rest) or 0)
    except Exception as e:  # re-raised unless it is the user's to fix
        message = None if debug else user_message(e)
        if message is None:
            raise
        print(f"t5r {name}: error: {message}", file=sys.stderr)
        if isinstance(e, DiskFullError) or is_disk_full(e):
            _TEARDOWN_NOISE.append(name)
        return 2


if __name__ == "__main__":
    run()
