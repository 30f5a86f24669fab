"""The launchers build the right commands: every one ends in `launch/run.py ... -- <t5r args>` with
the distributed flags its cluster needs, and the t5r arguments survive shell quoting unchanged.

(The local multi-process launch is run for real by tests/test_multihost.py.)
"""

import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5R_ARGS = ["train", "--model_dir=/runs/taco dir", "--gin_file=runs/taco.gin", "--gin.MIXTURE_OR_TASK_NAME=['kilt', \"x y\"]"]


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"launch_{name}", os.path.join(REPO, "launch", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


commands = load("commands")
run = load("run")


def after_separator(argv: list[str]) -> list[str]:
    return argv[argv.index("--") + 1:]


def test_local_single_process_has_no_distributed_flags():
    (argv,) = commands.local_commands(T5R_ARGS, python="py")
    assert argv == ["py", "launch/run.py", "--", *T5R_ARGS], argv


def test_local_processes_share_a_loopback_coordinator_with_distinct_ids():
    argvs = commands.local_commands(T5R_ARGS, num_processes=3, port=4567, python="py")
    assert len(argvs) == 3
    for i, argv in enumerate(argvs):
        args, t5r = run.parse(argv[2:])
        assert (args.coordinator, args.num_processes, args.process_id) == ("127.0.0.1:4567", 3, i), argv
        assert t5r == T5R_ARGS, f"process {i}: t5r arguments changed: {t5r}"


def test_slurm_task_takes_its_id_from_its_own_environment_and_the_coordinator_from_the_first_node():
    coordinator = commands.slurm_coordinator(["gpu-node-07", "gpu-node-08"], port=23456)
    assert coordinator == "gpu-node-07:23456"
    argv = commands.slurm_command(T5R_ARGS, coordinator, python=".venv/bin/python", repo_dir="/src/t5 retrieval")
    assert argv[:5] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "bash", "-c"], argv
    script = argv[5]
    assert '"$SLURM_PROCID"' in script and '"$SLURM_NTASKS"' in script, "ids must be expanded per task, by srun's shell"
    # What each task's shell runs, with SLURM's variables as that task sees them.
    expanded = script.replace('"$SLURM_NTASKS"', "2").replace('"$SLURM_PROCID"', "1")
    cd, _, entry = expanded.partition(" && exec ")
    assert shlex.split(cd) == ["cd", "/src/t5 retrieval"]
    entry = shlex.split(entry)
    assert entry[:2] == [".venv/bin/python", "launch/run.py"], entry
    args, t5r = run.parse(entry[2:])
    assert (args.coordinator, args.num_processes, args.process_id) == ("gpu-node-07:23456", 2, 1)
    assert t5r == T5R_ARGS, f"t5r arguments changed through bash -c: {t5r}"


def test_tpu_pod_runs_the_same_auto_detecting_command_on_every_worker():
    argv = commands.tpu_pod_command(T5R_ARGS, tpu="v4-32", zone="us-central2-b", project="proj")
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "v4-32"], argv
    assert {"--zone=us-central2-b", "--worker=all", "--project=proj"} <= set(argv), argv
    (remote,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
    cd, _, entry = remote.partition(" && ")
    assert cd == "cd ~/t5-retrieval", "the repo dir is left unquoted so that ~ expands on the worker"
    entry = shlex.split(entry)
    args, t5r = run.parse(entry[2:])
    assert args.auto and args.coordinator is None, "on a pod jax detects the coordinator itself"
    assert t5r == T5R_ARGS


def test_entry_point_refuses_partial_distributed_flags():
    with pytest.raises(SystemExit):
        run.parse(["--coordinator", "h:1", "--", "train"])
    with pytest.raises(SystemExit):
        run.parse(["--auto", "--coordinator", "h:1", "--num_processes", "2", "--process_id", "0", "--", "train"])


@pytest.mark.parametrize("script, extra", [("local.sh", ["--num_processes", "2"]),
                                           ("tpu_pod.sh", ["--tpu", "v4-8", "--zone", "z"]),
                                           ("slurm_gpu.sbatch", [])])
def test_shell_scripts_print_the_commands_built_in_python(script, extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", script), "--dry_run", *extra, "--", *T5R_ARGS],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    printed = [shlex.split(line) for line in proc.stdout.splitlines()]
    if script == "local.sh":
        expected = commands.local_commands(T5R_ARGS, num_processes=2, python=sys.executable)
    elif script == "tpu_pod.sh":
        expected = [commands.tpu_pod_command(T5R_ARGS, tpu="v4-8", zone="z")]
    else:
        expected = [commands.slurm_command(T5R_ARGS, "$FIRST_NODE:12355", repo_dir=REPO)]
    assert printed == expected, f"{script} printed {printed}, the builder gives {expected}"


def test_the_slurm_script_joins_its_tasks_into_one_jax_job(tmp_path):
    """launch/slurm_gpu.sbatch run for real as far as a CPU host allows: SLURM's `scontrol` and `srun`
    are stand-ins (srun starts SLURM_NTASKS copies of its command, each with its own SLURM_PROCID),
    everything after them is the script's: the coordinator from the first node, each task's id from
    its environment, `jax.distributed` joining both tasks, then the t5r command in each."""
    from process_harness import free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "localhost\\nnode-2\\n"\n')
    (bin_dir / "srun").write_text(
        "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i "$@" > "$LOGS/task$i.log" 2>&1 & done\n'
        "status=0; for job in $(jobs -p); do wait $job || status=1; done; exit $status\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="node-[1-2]", SLURM_NTASKS="2",
               SLURM_SUBMIT_DIR=REPO, PYTHON=sys.executable, PORT=str(free_port()), LOGS=str(tmp_path),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", "slurm_gpu.sbatch"), "--python", sys.executable,
                           "--", "--help"], capture_output=True, text=True, env=env, timeout=600)
    logs = {i: (tmp_path / f"task{i}.log").read_text() for i in range(2)}
    assert proc.returncode == 0, f"{proc.stderr}\n{logs}"
    # jax.distributed.initialize returns in a task only once both have joined (else it fails the task)
    for i, log in logs.items():
        assert "usage: t5r" in log, f"task {i} did not run the t5r command after joining: {log}"
