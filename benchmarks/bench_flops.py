"""Achieved FLOP/s of our T5 encoder forward as a fraction of a large float32 GEMM in the same run.

FLOPs are counted analytically for the matmuls only (2*m*n*k each: q/k/v/out projections, attention
scores and weighted sums, the MLP); norms, softmax, GELU and the embedding lookup are left out, so
the fraction is "useful matmul work per second relative to what this CPU's GEMM delivers". XLA's own
`cost_analysis()` count is reported next to it. The encoder (jitted, float32, random weights) and the
reference `jnp.dot` of two N x N matrices are timed round-robin so load changes hit both alike; the
same GEMM in PyTorch (MKL) is timed alongside, since XLA's GEMM speed bounds every model speed-up.

    .venv/bin/python benchmarks/bench_flops.py [--size base] [--batch 16] [--length 128] [--gemm 2048]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_encode import random_tokens, t5_config  # noqa: E402

from t5_retrieval.models.t5 import T5, T5Config  # noqa: E402

TARGET_FRACTION = 0.5


def encoder_matmul_flops(cfg: T5Config, batch: int, length: int) -> dict[str, int]:
    """Matmul FLOPs of one encoder forward over a [batch, length] batch (padding counts: it is computed)."""
    tokens = batch * length
    inner = cfg.num_heads * cfg.d_kv
    mlp_in = 2 if cfg.mlp_activation == "gated-gelu" else 1
    per_layer = {
        "attention_projections": 2 * tokens * cfg.d_model * inner * 4,
        "attention_scores_and_mix": 2 * 2 * tokens * length * inner,
        "mlp": 2 * tokens * cfg.d_model * cfg.d_ff * (mlp_in + 1),
    }
    flops = {name: n * cfg.num_encoder_layers for name, n in per_layer.items()}
    flops["total"] = sum(flops.values())
    return flops


def xla_flops(compiled: jax.stages.Compiled) -> float | None:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older jax returned one dict per device
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="base", help="gin_configs/models/t5_<size>.gin (tiny for smoke tests)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--gemm", type=int, default=2048, help="N of the N x N x N reference jnp.dot")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads for the MKL GEMM reference (XLA's CPU backend uses all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results path (default benchmarks/results/flops.json)")
    args = parser.parse_args(argv)

    cfg = t5_config(args.size)
    model = T5(cfg)
    tokens = jnp.asarray(random_tokens(np.random.default_rng(args.seed), args.batch, args.length, cfg.vocab_size))
    variables = jax.jit(lambda key: model.init(key, (tokens,), method=T5.encode))(jax.random.PRNGKey(args.seed))
    start = time.perf_counter()
    encode = jax.jit(lambda v, t: model.apply(v, (t,), method=T5.encode)[0]).lower(variables, tokens).compile()
    compile_s = time.perf_counter() - start

    key_a, key_b = jax.random.split(jax.random.PRNGKey(args.seed))
    a = jax.random.normal(key_a, (args.gemm, args.gemm), jnp.float32)
    b = jax.random.normal(key_b, (args.gemm, args.gemm), jnp.float32)
    gemm = jax.jit(jnp.dot).lower(a, b).compile()
    torch.set_num_threads(args.threads)
    torch_a, torch_b = torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))

    jax.block_until_ready((encode(variables, tokens), gemm(a, b)))  # warm-up
    torch.mm(torch_a, torch_b)
    times = common.interleaved_times({"encoder": lambda: jax.block_until_ready(encode(variables, tokens)),
                                      "gemm": lambda: jax.block_until_ready(gemm(a, b)),
                                      "torch_gemm": lambda: torch.mm(torch_a, torch_b)}, args.repeats)
    flops = encoder_matmul_flops(cfg, args.batch, args.length)
    gemm_flops = 2 * args.gemm ** 3
    encoder_rate = flops["total"] / np.median(times["encoder"])
    gemm_rate = gemm_flops / np.median(times["gemm"])
    per_round = [flops["total"] / e / (gemm_flops / g) for e, g in zip(times["encoder"], times["gemm"])]
    fraction = encoder_rate / gemm_rate
    xla = xla_flops(encode)
    result = {
        "what": "encoder forward FLOP/s (analytic matmul count) / float32 N^3 GEMM FLOP/s, same run",
        "flop_count": "analytic (matmuls only); xla_cost_analysis_flops for comparison",
        "machine": common.machine_info(jax=jax.__version__, jax_backend=jax.default_backend(),
                                       jax_devices=jax.device_count()),
        "blas_env_at_start": ORIGINAL_BLAS_ENV, "args": vars(args), "config": dataclasses.asdict(cfg),
        "compile_s": compile_s,
        "encoder_flops": flops, "xla_cost_analysis_flops": xla,
        "encoder": {**common.summarize(times["encoder"]), "flops_per_s": encoder_rate},
        "gemm": {**common.summarize(times["gemm"]), "n": args.gemm, "flops_per_s": gemm_rate},
        # The same GEMM in PyTorch (MKL here): how XLA's kernel compares with the baseline's BLAS.
        "torch_gemm": {**common.summarize(times["torch_gemm"]), "threads": args.threads,
                       "flops_per_s": gemm_flops / np.median(times["torch_gemm"])},
        "xla_gemm_over_torch_gemm": common.speedup(times, "gemm", "torch_gemm"),
        "fraction_of_gemm": fraction, "median_of_round_fractions": float(np.median(per_round)),
        "target_fraction": TARGET_FRACTION, "target_met": fraction >= TARGET_FRACTION,
    }
    summary = (f"t5-{args.size} encoder {args.batch}x{args.length}: {encoder_rate / 1e9:.1f} GFLOP/s vs "
               f"{args.gemm}^3 GEMM {gemm_rate / 1e9:.1f} GFLOP/s = {fraction:.0%} of GEMM "
               f"(target {TARGET_FRACTION:.0%} {'met' if result['target_met'] else 'MISSED'}); torch GEMM "
               f"{result['torch_gemm']['flops_per_s'] / 1e9:.1f} GFLOP/s")
    common.write_results("flops", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
