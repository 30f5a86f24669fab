"""The one entry point of every launch: join the job's processes, then run a `t5r` command.

    python launch/run.py [distributed flags] -- train --model_dir=... --gin_file=...

Distributed flags (all launchers end here; see launch/commands.py for how each builds them):
  --coordinator HOST:PORT --num_processes N --process_id I   explicit (local multi-process, SLURM)
  --auto                                                     jax's cluster detection (TPU VM pods)
  (none)                                                     a single process

`jax.distributed.initialize` must run before anything touches a JAX backend, which is why this
is a separate script rather than a `t5r` flag. On CPU, cross-process collectives use gloo over TCP
(`jax_cpu_collectives_implementation`, the default in jax 0.10; set here explicitly so that a
changed default cannot silently turn a multi-host CPU run into independent processes).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Splits `[flags] -- t5r args` and parses the flags."""
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1:]
    else:
        own, command = [], argv
    parser = argparse.ArgumentParser(prog="launch/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    parser.add_argument("--auto", action="store_true", help="let jax detect the cluster (TPU VM, SLURM)")
    parser.add_argument("--init_timeout", type=int, default=300, help="seconds to wait for all processes")
    args = parser.parse_args(own)
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in explicit) and None in explicit:
        parser.error("--coordinator, --num_processes and --process_id go together")
    if args.auto and args.coordinator:
        parser.error("--auto and --coordinator exclude each other")
    if not command:
        parser.error("no t5r command after '--'")
    return args, command


def initialize(args: argparse.Namespace) -> None:
    """Joins the job (a no-op for a single process)."""
    import jax

    if args.coordinator is None and not args.auto:
        return
    if "cpu" in os.environ.get("JAX_PLATFORMS", "").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto:
        jax.distributed.initialize(initialization_timeout=args.init_timeout)
    else:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=args.init_timeout)


def main(argv: list[str]) -> int:
    args, command = parse(argv)
    sys.path.insert(0, REPO)
    from t5_retrieval import cli, logs

    logs.setup()  # before jax.distributed, whose absl logging would otherwise claim the root logger
    initialize(args)

    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
