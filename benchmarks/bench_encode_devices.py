"""Encoding throughput with 1, 2, 4 and 8 forced CPU devices: how well `encode` splits its work.

Each device count runs in its own subprocess (XLA_FLAGS must be set before jax starts). The same
passages are embedded by `DualEncoderInference.encode_tokens`, whose batches are sharded over the
mesh's data axis. Efficiency = passages/s with n devices / passages/s with 1 device: on a machine
with fewer cores than forced devices it measures the sharding overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_info, write_results  # noqa: E402

SIZES = {"tiny": dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, num_encoder_layers=2, num_decoder_layers=2),
         "small": dict(d_model=512, num_heads=6, d_kv=64, d_ff=1024, num_encoder_layers=8, num_decoder_layers=8)}


def measure(size: str, passages: int, length: int, batch: int, repeats: int) -> dict:
    """Runs inside the subprocess: passages/s of encode_tokens on this process's devices."""
    import jax
    import numpy as np

    from t5_retrieval import sharding
    from t5_retrieval.inference import DualEncoderInference
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config
    from t5_retrieval.train import init_params

    model = DualEncoder(T5Config(vocab_size=8192, dropout_rate=0.0, **SIZES[size]))
    mesh = sharding.make_mesh()
    params, _ = init_params(model, jax.random.PRNGKey(0), mesh, sharding.logical_axis_rules())
    encoder = DualEncoderInference(model, params, {}, "bench", mesh, batch_size=batch)
    tokens = np.random.default_rng(0).integers(2, 8192, size=(passages, length)).astype(np.int32)
    encoder.encode_tokens(tokens[:batch])  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        encoder.encode_tokens(tokens)
        times.append(time.perf_counter() - start)
    return {"devices": jax.device_count(), "passages_per_s": passages / min(times), "seconds": times}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--passages", type=int, default=2048)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(measure(a.size, a.passages, a.length, a.batch, a.repeats)))
        return 0
    runs = {}
    for n in [int(x) for x in a.devices.split(",")]:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--size={a.size}",
               f"--passages={a.passages}", f"--length={a.length}", f"--batch={a.batch}", f"--repeats={a.repeats}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        runs[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = runs[min(runs)]["passages_per_s"]
    efficiency = {n: r["passages_per_s"] / base for n, r in runs.items()}
    result = {"size": a.size, "passages": a.passages, "length": a.length, "batch": a.batch, "runs": runs,
              "efficiency_vs_1_device": efficiency, "machine": machine_info()}
    summary = ", ".join(f"{n} dev {r['passages_per_s']:.0f}/s ({efficiency[n]:.2f})" for n, r in runs.items())
    write_results("encode_devices", result, f"{a.size}: {summary}", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
