"""Run by tests/test_taco_sharded.py in a subprocess with 8 forced CPU devices.

Runs TACO (exact and approx median) for a few steps with params, gradients and state sharded
over a ('data', 'model') mesh, jitted with in/out shardings, and again unsharded on one device;
prints one JSON line with the largest differences, whether the state kept its sharding, and how
many bytes the compiled update all-gathers.
"""

import json
import os
import sys

assert "xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", ""), \
    "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5_retrieval import sharding
from t5_retrieval.multitask import taco
from t5_retrieval.plan import hlo

K, STEPS = 3, 3
SPECS = {"embed": P("model", None), "kernel": P("data", "model"), "bias": P(None), "scale": P("data")}
SHAPES = {"embed": (16, 8), "kernel": (8, 12), "bias": (5,), "scale": (8,)}


def main() -> int:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: (rng.standard_normal((K,) + s) * np.exp(rng.standard_normal((K,) + s))
                  ).astype(np.float32) for n, s in SHAPES.items()} for _ in range(STEPS)]
    param_sh = {n: NamedSharding(mesh, spec) for n, spec in SPECS.items()}
    grad_sh = {n: NamedSharding(mesh, P(None, *spec)) for n, spec in SPECS.items()}
    result = {}
    for median in ("exact", "approx"):
        tx = taco(K, total_steps=10, burn_in_fraction=0.1, beta=0.5, median=median, median_samples=64,
                  state_dtype=jnp.bfloat16)
        state_sh = sharding.opt_state_shardings(tx, params, param_sh, mesh, sharding.logical_axis_rules())
        sharded_params = jax.device_put(params, param_sh)
        state = jax.jit(tx.init, out_shardings=state_sh)(sharded_params)
        update = jax.jit(tx.update, in_shardings=(grad_sh, state_sh, param_sh),
                         out_shardings=(param_sh, state_sh))
        single = jax.jit(tx.update)
        ref_state = tx.init(params)
        out_diff = ema_diff = 0.0
        for g in grads:
            out, state = update(jax.device_put(g, grad_sh), state, sharded_params)
            ref_out, ref_state = single(g, ref_state, params)
            out_diff = max(out_diff, max(float(np.abs(np.asarray(out[n]) - np.asarray(ref_out[n])).max())
                                         for n in SHAPES))
            ema_diff = max(ema_diff, max(
                float(np.abs(np.asarray(state.ema[n], np.float32)
                             - np.asarray(ref_state.ema[n], np.float32)).max()) for n in SHAPES))
        program = update.lower(jax.device_put(grads[0], grad_sh), state, sharded_params).compile().as_text()
        result[median] = {
            "all_gathered_bytes": hlo.collectives(program).get("all-gather", {}).get("bytes", 0),
            "out_max_abs_diff": out_diff,
            "ema_max_abs_diff": ema_diff,
            "ema_specs_match": all(state.ema[n].sharding.spec == P(None, *SPECS[n]) for n in SHAPES),
            "ema_is_distributed": len(state.ema["kernel"].sharding.device_set) == 8,
            "step": int(state.step),
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
