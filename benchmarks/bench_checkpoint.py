"""Checkpoint cost and preemption cost.

1. Save and restore time vs parameter bytes, through `t5_retrieval.checkpoint` (orbax, the same
   manager and items as training), and the part of each spent on the per-file sha256 checksums.
   The saved state is shaped like a training state with Adam: parameters (several leaves of a
   T5-like mix of matrix sizes) plus two moment trees, i.e. 3x the parameter bytes on disk. Save
   and restore are timed round-robin per size; restore goes into the arrays' shardings as training
   does.
2. Resume overhead: a tiny `t5r train` run (subprocess) is killed with SIGKILL at random moments
   and restarted until it finishes. Per kill: steps repeated (last step computed before the kill
   minus the step it resumed from; expected ~checkpoint_every / 2), and the restart's wall time
   from process start to its first new step (imports, restore, compile from the persistent cache).

    .venv/bin/python benchmarks/bench_checkpoint.py [--sizes_mb 1 16 64 256] [--repeats 3]
        [--kills 3] [--checkpoint_every 10] [--steps 60]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from t5_retrieval import checkpoint  # noqa: E402

TINY_GIN = ["--gin_file=models/t5_tiny.gin"] + [f"--gin.{b}" for b in (
    "VOCAB_SIZE=64", "D_MODEL=16", "D_FF=32", "NUM_LAYERS=1", "NUM_HEADS=2", "D_KV=8", "DROPOUT=0.1",
    "train.batches=@RandomBatches", "RandomBatches.vocab_size=64", "RandomBatches.num_negatives=1",
    "train.per_device_batch=4", "train.log_every=1")]


def training_like_state(param_bytes: int, seed: int = 0) -> dict:
    """{params, mu, nu} float32 trees of ~param_bytes each, leaves in a T5-like mix of shapes."""
    rng = np.random.default_rng(seed)
    d = 64
    while 12 * d * d * 4 * 8 < param_bytes and d < 4096:  # ~8 layers of 12 d^2 matrices
        d *= 2
    params, total, i = {}, 0, 0
    while total < param_bytes:
        rows = [d, d, 4 * d][i % 3]
        cols = min(4 * d, max(1, (param_bytes - total) // (4 * rows))) if i % 3 == 2 else d
        params[f"layer_{i:03d}"] = jnp.asarray(rng.standard_normal((rows, int(cols)), dtype=np.float32))
        total += rows * int(cols) * 4
        i += 1
    # Random moments too: constant arrays would compress to nothing on disk.
    mu = {k: jnp.asarray(0.01 * rng.standard_normal(v.shape, dtype=np.float32)) for k, v in params.items()}
    nu = {k: jnp.asarray(1e-4 * rng.random(v.shape, dtype=np.float32)) for k, v in params.items()}
    return {"step": jnp.zeros((), jnp.int32), "params": params, "mu": mu, "nu": nu}


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def time_save_restore(sizes_mb: list[float], repeats: int, root: str) -> dict:
    return {str(size_mb): time_one_size(size_mb, repeats, root) for size_mb in sizes_mb}


def time_one_size(size_mb: float, repeats: int, root: str) -> dict:
    """Save, restore and their checksum parts for one state size, timed round-robin."""
    state = training_like_state(int(size_mb * 2**20))
    abstract = checkpoint.abstract_like(state)
    directory = os.path.join(root, f"ckpt_{size_mb}")
    mngr = checkpoint.manager(directory, max_to_keep=2, writer=True)
    step = [0]

    def save() -> None:
        step[0] += 1
        checkpoint.save(mngr, step[0], state, {"step": step[0]})

    def restore() -> None:
        restored, _ = checkpoint.restore(mngr, abstract)
        jax.block_until_ready(restored)

    def checksum() -> None:  # what save spends on it: hash every file of the step, write the list
        checkpoint.write_checksums(mngr.directory / str(step[0]))

    def verify() -> None:  # what restore spends on it
        checkpoint.verify_checksums(mngr.directory / str(step[0]))  # raises unless every file matches

    save()  # first save creates the directory layout; not timed
    restore()
    times = common.interleaved_times({"save": save, "restore": restore, "checksum": checksum, "verify": verify},
                                     repeats)
    restored, _ = checkpoint.restore(mngr, abstract)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    param_bytes, total = tree_bytes(state["params"]), tree_bytes(state)
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(directory, str(step[0])))
               for f in fs)
    result = {
        "param_bytes": param_bytes, "state_bytes": total, "disk_bytes": disk,
        "leaves": len(jax.tree.leaves(state)), "restored_equal": same,
        "save": {**common.summarize(times["save"]),
                 "mb_per_s": total / 2**20 / statistics.median(times["save"])},
        "restore": {**common.summarize(times["restore"]),
                    "mb_per_s": total / 2**20 / statistics.median(times["restore"])},
        # Included in save and restore above; as a share of them.
        "checksum_at_save": {**common.summarize(times["checksum"]),
                             "share_of_save": statistics.median(times["checksum"]) / statistics.median(times["save"])},
        "verify_at_restore": {**common.summarize(times["verify"]),
                              "share_of_restore": statistics.median(times["verify"])
                              / statistics.median(times["restore"])},
    }
    shutil.rmtree(directory)
    return result


def _last_logged_step(model_dir: str) -> int:
    path = os.path.join(model_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        steps = [json.loads(line)["step"] for line in f if line.strip().endswith("}")]
    return max(steps, default=0)


def _completed_checkpoints(model_dir: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(model_dir) if n.isdigit()) if os.path.isdir(model_dir) else []


def resume_overhead(kills: int, checkpoint_every: int, steps: int, root: str, seed: int = 0) -> dict:
    """Kills a tiny training run `kills` times at random moments; measures the repeated work."""
    rng = random.Random(seed)
    model_dir = os.path.join(root, "resume", "model")
    os.makedirs(os.path.dirname(model_dir), exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(REPO, ".pytest_cache", "xla"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    command = [sys.executable, "-m", "t5_retrieval.cli", "train", "--model_dir", model_dir, *TINY_GIN,
               f"--gin.train.num_steps={steps}", f"--gin.train.checkpoint_every={checkpoint_every}"]
    log = open(os.path.join(root, "resume", "train.log"), "w")
    records, restart_s, resumed = [], [], []
    for attempt in range(kills + 1):
        before = _last_logged_step(model_dir)
        resumed_from = max(_completed_checkpoints(model_dir), default=0)
        resumed.append(resumed_from)
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        first_new = None
        # Kill at a random step past the first new one (so that every run makes progress).
        target = min(steps - 1, resumed_from + 1 + rng.randrange(2 * checkpoint_every))
        while proc.poll() is None:
            logged = _last_logged_step(model_dir)
            if first_new is None and logged > before:
                first_new = time.perf_counter() - start
            if attempt < kills and logged >= target:
                time.sleep(rng.uniform(0, 0.05))
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                last = _last_logged_step(model_dir)  # read after the kill: nothing more can be logged
                records.append({"killed_after_step": last, "resumed_from": resumed_from,
                                "seconds_to_first_new_step": first_new})
                break
            time.sleep(0.005)
        if first_new is not None and attempt > 0:
            restart_s.append(first_new)
        if proc.returncode == 0:
            break
    log.close()
    # Steps repeated by each restart: what the killed run had done beyond the checkpoint it left.
    for record, next_resume in zip(records, resumed[1:]):
        record["next_resumed_from"] = next_resume
        record["steps_repeated"] = record["killed_after_step"] - next_resume
    repeated = [r["steps_repeated"] for r in records if "steps_repeated" in r]
    finished = _completed_checkpoints(model_dir)[-1:] == [steps]
    return {"checkpoint_every": checkpoint_every, "steps": steps, "kills": records, "finished": finished,
            "mean_steps_repeated": statistics.mean(repeated) if repeated else None,
            # A kill uniformly at random between checkpoints loses 0..checkpoint_every-1 steps.
            "uniform_kill_mean_steps_repeated": (checkpoint_every - 1) / 2,
            "restart_to_first_new_step_s": common.summarize(restart_s) if restart_s else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes_mb", type=float, nargs="+", default=[1, 16, 64, 256],
                        help="parameter MB per state (the saved state is 3x: params + Adam moments)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--checkpoint_every", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: a temp dir)")
    parser.add_argument("--out", default=None, help="results JSON (default results/checkpoint.json)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir)
    try:
        sizes = time_save_restore(args.sizes_mb, args.repeats, root)
        resume = resume_overhead(args.kills, args.checkpoint_every, args.steps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"machine": common.machine_info(), "blas_env_at_start": ORIGINAL_BLAS_ENV, "jax": jax.__version__,
              "save_restore_by_param_mb": sizes, "resume": resume}
    largest = sizes[str(args.sizes_mb[-1])]
    summary = (f"{args.sizes_mb[-1]:g} MB params ({largest['state_bytes'] / 2**20:.0f} MB state): save "
               f"{largest['save']['median_s']:.2f}s ({largest['save']['mb_per_s']:.0f} MB/s), restore "
               f"{largest['restore']['median_s']:.2f}s ({largest['restore']['mb_per_s']:.0f} MB/s), of which checksums "
               f"{largest['checksum_at_save']['median_s']:.2f}s / {largest['verify_at_restore']['median_s']:.2f}s; "
               f"resume after kill: "
               f"{resume['mean_steps_repeated']} steps repeated (every {args.checkpoint_every}), restart "
               + (f"{resume['restart_to_first_new_step_s']['median_s']:.1f}s to first new step"
                  if resume["restart_to_first_new_step_s"] else "n/a"))
    common.write_results("checkpoint", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
