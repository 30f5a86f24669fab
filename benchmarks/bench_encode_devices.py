"""Encoding throughput with 1, 2, 4 and 8 forced CPU devices: how well `encode` splits its work.

Each device count runs in its own subprocess (XLA_FLAGS must be set before jax starts). The same
passages are embedded by `DualEncoderInference.encode_tokens`, whose batches are sharded over the
mesh's data axis. Efficiency = passages/s with n devices / passages/s with 1 device: on a machine
with fewer cores than forced devices it measures the sharding overhead, not a speed-up. Each run
also records the CPU time of its encode calls (`cores_busy` = CPU seconds / wall seconds, so how
many cores the device count kept busy) and its embeddings, which must equal the 1-device ones
(`max_abs_diff_vs_first`): a change in speed cannot come from doing different work. A control run
encodes on 1 device with the largest device count's per-device batch (`control_1_device_batch`),
which tells a gain from sharding apart from a gain from smaller per-call batches.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, machine_info, write_results

SIZES = {"tiny": dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, num_encoder_layers=2, num_decoder_layers=2),
         "small": dict(d_model=512, num_heads=6, d_kv=64, d_ff=1024, num_encoder_layers=8, num_decoder_layers=8)}


def measure(size: str, passages: int, length: int, batch: int, repeats: int, embeddings_out: str) -> dict:
    """Runs inside the subprocess: passages/s of encode_tokens on this process's devices; saves the
    embeddings of the last repeat to `embeddings_out` (.npy)."""
    import jax
    import numpy as np

    from t5_retrieval import sharding
    from t5_retrieval.inference import DualEncoderInference
    from t5_retrieval.models.build import init_params
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config

    model = DualEncoder(T5Config(vocab_size=8192, dropout_rate=0.0, **SIZES[size]))
    mesh = sharding.make_mesh()
    params, _ = init_params(model, jax.random.PRNGKey(0), mesh, sharding.logical_axis_rules())
    encoder = DualEncoderInference(model, params, {}, "bench", mesh, batch_size=batch)
    tokens = np.random.default_rng(0).integers(2, 8192, size=(passages, length)).astype(np.int32)
    encoder.encode_tokens(tokens[:batch])  # compile
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        embeddings = encoder.encode_tokens(tokens)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    np.save(embeddings_out, embeddings)
    best = times.index(min(times))
    return {"devices": jax.device_count(), "passages_per_s": passages / times[best], "seconds": times,
            "cpu_seconds": cpu, "cores_busy": cpu[best] / times[best]}


def run_worker(a: argparse.Namespace, devices: int, batch: int, embeddings_out: str) -> dict:
    """One measurement in a fresh process with `devices` forced CPU devices."""
    # the caller's XLA flags (a test's fast-compile ones), without any device count of theirs
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--size={a.size}", f"--passages={a.passages}",
           f"--length={a.length}", f"--batch={batch}", f"--repeats={a.repeats}", f"--embeddings_out={embeddings_out}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"worker with {devices} devices failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--passages", type=int, default=2048)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no_control", action="store_true",
                   help="skip the 1-device run at the largest device count's per-device batch")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--embeddings_out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(measure(a.size, a.passages, a.length, a.batch, a.repeats, a.embeddings_out)))
        return 0
    import numpy as np

    counts = [int(x) for x in a.devices.split(",")]
    runs, first = {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            runs[n] = run_worker(a, n, a.batch, os.path.join(tmp, f"{n}.npy"))
            embeddings = np.load(os.path.join(tmp, f"{n}.npy"))
            first = embeddings if first is None else first
            runs[n]["max_abs_diff_vs_first"] = float(np.abs(embeddings - first).max())
        # Control: is a gain from sharding, or from each device's smaller batch? One device, small batch.
        control, control_batch = None, max(1, a.batch // max(counts))
        if not a.no_control and max(counts) > 1:
            control = run_worker(a, 1, control_batch, os.path.join(tmp, "control.npy"))
            control["max_abs_diff_vs_first"] = float(np.abs(np.load(os.path.join(tmp, "control.npy")) - first).max())
    base = runs[min(runs)]["passages_per_s"]
    efficiency = {n: r["passages_per_s"] / base for n, r in runs.items()}
    result = {"size": a.size, "passages": a.passages, "length": a.length, "batch": a.batch, "runs": runs,
              "efficiency_vs_1_device": efficiency, "machine": machine_info()}
    summary = ", ".join(f"{n} dev {r['passages_per_s']:.0f}/s ({efficiency[n]:.2f}, {r['cores_busy']:.1f} cores)"
                        for n, r in runs.items())
    if control is not None:
        result["control_1_device_batch"] = {"batch": control_batch, **control,
                                            "efficiency_vs_1_device": control["passages_per_s"] / base}
        summary += f"; 1 dev at batch {control_batch}: {control['passages_per_s']:.0f}/s"
    write_results("encode_devices", result, f"{a.size}: {summary}",
                  a.out or os.path.join(RESULTS_DIR, f"encode_devices_{a.size}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
