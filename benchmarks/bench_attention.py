"""One T5 encoder self-attention block (the model's own `t5.Attention`: projections, core, output
projection), forward and backward, compiled for one TPU device under each `ATTENTION_IMPL`: the
TPU compiler's cost-model time, FLOPs and HBM bytes of each, against the XLA path in the same run.

T5-base's shapes at the paper's batch by default: 192 passages of 160 tokens per device (64 queries
with a positive and 2 negatives each), 12 heads of 64, bf16 compute with float32 logits, the
relative position bias differentiated. Every time is an estimate of libtpu's cost model (a custom
kernel priced from the cost estimate it carries), not a measurement.

    .venv/bin/python benchmarks/bench_attention.py [--topology v5e:2x2] [--batch 192] [--length 160]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from t5_retrieval.models import attention  # noqa: E402
from t5_retrieval.models.t5 import Attention, RelativePositionBias, T5Config, stack_bias  # noqa: E402
from t5_retrieval.plan import planner  # noqa: E402
from t5_retrieval.plan.programs import CompiledProgram  # noqa: E402

IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_tpu_short")  # the TPU's


def block_gradient(config: T5Config):
    """(params, x, relpos) -> the gradient of sum(attention block(x)) w.r.t. all three: one layer's
    self-attention as the encoder runs it, its bias built by `stack_bias` from the relative position
    table and the padding (every position real here)."""
    block, positions = Attention(config), RelativePositionBias(config, bidirectional=True)

    def loss(params, x, relpos):
        length = x.shape[1]
        mask = jnp.ones(x.shape[:2], bool)
        bias = stack_bias(config, positions.apply({"params": relpos}, length, length), mask, mask)
        return block.apply({"params": params}, x, x, bias, True).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2)), block, positions


def compiled_cost(config: T5Config, batch: int, length: int, target: planner.Target) -> dict[str, Any]:
    device = Mesh(target.devices[:1], ("one",))
    placed = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(device, P()))  # noqa: E731
    gradient, block, positions = block_gradient(config)
    x = jnp.zeros((batch, length, config.d_model), config.compute_dtype)
    plain = Attention(dataclasses.replace(config, attention="xla"))  # the same parameters under every core
    params = jax.eval_shape(lambda: nn.unbox(plain.init(jax.random.PRNGKey(0), x, x, jnp.zeros((1, 1, length, length)),
                                                        True)))
    relpos = jax.eval_shape(lambda: nn.unbox(positions.init(jax.random.PRNGKey(0), length, length)))
    args = jax.tree.map(placed, (params["params"], jax.ShapeDtypeStruct(x.shape, x.dtype), relpos["params"]))
    start = time.perf_counter()
    program = CompiledProgram.read(jax.jit(gradient).lower(*args).compile())
    seconds, unpriced = planner.compiler_seconds(program, target)
    kernels = planner.kernel_costs(program.text, target)["kinds"]
    return {"seconds": seconds, "unpriced_kernel_seconds": unpriced, "flops": program.cost.get("flops"),
            "bytes": program.cost.get("bytes accessed"), "kernels": kernels,
            "compile_seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2", help="a TPU slice; one of its devices is compiled for")
    parser.add_argument("--batch", type=int, default=192, help="sequences per device")
    parser.add_argument("--length", type=int, default=160, help="tokens per sequence")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/attention.json)")
    args = parser.parse_args(argv)
    target = planner.describe_topology(args.topology, 1)
    base = T5Config(d_model=768, num_heads=12, d_kv=64, d_ff=2048, dtype="bfloat16", dropout_rate=0.0)
    costs = {}
    for implementation in IMPLEMENTATIONS:
        config = dataclasses.replace(base, attention=implementation)
        costs[implementation] = compiled_cost(config, args.batch, args.length, target)
        print(f"{implementation}: {costs[implementation]['seconds'] * 1e3:.3f} ms", file=sys.stderr, flush=True)
    xla = costs["xla"]["seconds"]
    result = {"topology": args.topology, "chip": target.chip.name, "batch": args.batch, "length": args.length,
              "heads": base.num_heads, "head_dim": base.d_kv, "flash_padding": {
                  "keys": attention.padded_length(args.length, "pallas_tpu")},
              "implementations": costs, "machine": common.machine_info(blas_env=ORIGINAL_BLAS_ENV)}
    summary = (f"one T5-base attention block, forward and backward, {args.batch} x {args.length} on a "
               f"{target.chip.name} device (cost model): " + ", ".join(
                   f"{name} {c['seconds'] * 1e3:.2f} ms ({c['seconds'] / xla:.2f}x xla)" for name, c in costs.items()))
    common.write_results("attention", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
