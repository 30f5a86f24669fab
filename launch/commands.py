"""How each launcher starts the job; every process ends up in `launch/run.py [flags] -- <t5r args>`.

    python launch/commands.py local [--num_processes N] [--port P] [--dry_run] -- train --model_dir=...
    python launch/commands.py slurm [--port P] [--dry_run] -- train ...      (inside an sbatch job)
    python launch/commands.py tpu --tpu NAME --zone ZONE [--project P] [--dry_run] -- train ...

- local: one process, or N processes on this machine joined over 127.0.0.1 (CPU: gloo).
- slurm: one `srun` task per node; the coordinator is the job's first node (from
  SLURM_JOB_NODELIST via `scontrol show hostnames`), each task's id is its SLURM_PROCID.
- tpu: `gcloud compute tpus tpu-vm ssh --worker=all` runs the same command on every host of the
  pod slice; jax detects the pod itself (`--auto`).

The shell scripts next to this file (local.sh, slurm_gpu.sbatch, tpu_pod.sh) only call this
module, so the commands are built (and tested) in one place. `--dry_run` prints them instead.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = "launch/run.py"  # relative to the repository, which every command runs from
DEFAULT_PORT = 12355


def run_command(python: str, t5r_args: Sequence[str], distributed: Sequence[str] = ()) -> list[str]:
    """The entry point's argv: python launch/run.py <distributed flags> -- <t5r args>."""
    return [python, RUN, *distributed, "--", *t5r_args]


def local_commands(t5r_args: Sequence[str], num_processes: int = 1, port: int = DEFAULT_PORT,
                   python: str = sys.executable) -> list[list[str]]:
    """One argv per process on this machine; with N > 1 they join through 127.0.0.1:port."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if num_processes == 1:
        return [run_command(python, t5r_args)]
    return [run_command(python, t5r_args, ["--coordinator", f"127.0.0.1:{port}", "--num_processes",
                                           str(num_processes), "--process_id", str(i)])
            for i in range(num_processes)]


def slurm_coordinator(nodelist_hosts: Sequence[str], port: int = DEFAULT_PORT) -> str:
    """HOST:PORT of the job's first node (the hosts as `scontrol show hostnames` lists them)."""
    if not nodelist_hosts:
        raise ValueError("the SLURM job has no nodes (empty SLURM_JOB_NODELIST?)")
    return f"{nodelist_hosts[0]}:{port}"


def slurm_command(t5r_args: Sequence[str], coordinator: str, python: str = ".venv/bin/python",
                  repo_dir: str = REPO) -> list[str]:
    """`srun` with one task per node; each task reads its id and the task count from SLURM's
    environment (expanded by the task's shell, not here)."""
    entry = run_command(python, t5r_args, ["--coordinator", coordinator])
    script = (f"cd {shlex.quote(repo_dir)} && exec {shlex.join(entry[:4])} "
              '--num_processes "$SLURM_NTASKS" --process_id "$SLURM_PROCID" '
              f"{shlex.join(entry[4:])}")
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c", script]


def tpu_pod_command(t5r_args: Sequence[str], tpu: str, zone: str, project: str | None = None,
                    repo_dir: str = "~/t5-retrieval", python: str = ".venv/bin/python") -> list[str]:
    """The same command on every worker of a TPU VM pod slice; jax finds the pod by itself."""
    remote = f"cd {repo_dir} && {shlex.join(run_command(python, t5r_args, ['--auto']))}"
    command = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}", "--worker=all"]
    if project:
        command.append(f"--project={project}")
    return [*command, f"--command={remote}"]


def run_local(commands: list[list[str]]) -> int:
    """Starts every process and waits; if one fails, the others are stopped (they would wait for it)."""
    procs = [subprocess.Popen(c, cwd=REPO) for c in commands]
    try:
        while procs:
            for proc in list(procs):
                try:
                    code = proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    continue
                procs.remove(proc)
                if code != 0:
                    return code
        return 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return out.stdout.split()


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: launch/commands.py {local,slurm,tpu} [flags] -- <t5r command and flags>")
    split = argv.index("--")
    own, t5r_args = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="launch/commands.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry_run", action="store_true", help="print the commands instead of running them")
    kinds = parser.add_subparsers(dest="kind", required=True)
    local = kinds.add_parser("local")
    local.add_argument("--num_processes", type=int, default=1)
    local.add_argument("--port", type=int, default=DEFAULT_PORT)
    slurm = kinds.add_parser("slurm")
    slurm.add_argument("--port", type=int, default=DEFAULT_PORT)
    slurm.add_argument("--python", default=".venv/bin/python")
    tpu = kinds.add_parser("tpu")
    tpu.add_argument("--tpu", required=True, help="TPU VM name")
    tpu.add_argument("--zone", required=True)
    tpu.add_argument("--project")
    tpu.add_argument("--repo_dir", default="~/t5-retrieval", help="the checkout on the TPU hosts")
    tpu.add_argument("--python", default=".venv/bin/python")
    # --dry_run may come before or after the kind
    dry_run = "--dry_run" in own
    args = parser.parse_args([a for a in own if a != "--dry_run"])
    if not t5r_args:
        parser.error("no t5r command after '--'")
    if args.kind == "local":
        commands = local_commands(t5r_args, args.num_processes, args.port)
    elif args.kind == "slurm":
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if nodelist is None and not dry_run:
            parser.error("slurm: SLURM_JOB_NODELIST is not set; run inside an sbatch job (launch/slurm_gpu.sbatch)")
        hosts = _hostnames(nodelist) if nodelist else ["$FIRST_NODE"]
        commands = [slurm_command(t5r_args, slurm_coordinator(hosts, args.port), args.python)]
    else:
        commands = [tpu_pod_command(t5r_args, args.tpu, args.zone, args.project, args.repo_dir, args.python)]
    if dry_run:
        print("\n".join(shlex.join(c) for c in commands))
        return 0
    if args.kind == "local":
        return run_local(commands)
    os.execvp(commands[0][0], commands[0])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
