"""TACO transform cost on a T5-shaped parameter tree: update time vs the naive sum, median cost,
and optimiser-state memory with fp32 and bf16 EMA.

Default: a T5 tree with t5-small's vocabulary and depth but d_model 128 / d_ff 512 (~6M params)
so the run takes a few minutes on 2 shared CPU cores; ``--d_model 512 --d_ff 2048`` is t5-small
(~60M params; needs ~10 GB and much longer).
Writes benchmarks/results/taco_transform.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import functools
import sys

import common  # benchmarks/common.py: interleaved timing, machine info, results JSON
import jax
import jax.numpy as jnp
import numpy as np

from t5_retrieval import multitask
from t5_retrieval.multitask.median import taco_global_median


def lower_median_sorted(x: jax.Array) -> jax.Array:
    """The baseline the radix select is timed against: lower median along axis 1 by sorting.

    For x >= 0 the int32 bit patterns of float32 sort in the same order as the values, and XLA
    sorts int32 ~6x faster than float32 on CPU.
    """
    n = x.shape[1]
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.sort(bits, axis=1)[:, (n - 1) // 2], jnp.float32)


def t5_param_shapes(vocab: int, d_model: int, d_ff: int, layers: int, heads: int, d_kv: int):
    """Shapes of a T5 v1.0 encoder-decoder (shared embedding, relative-position biases)."""
    inner = heads * d_kv
    attn = {"q": (d_model, inner), "k": (d_model, inner), "v": (d_model, inner), "o": (inner, d_model)}
    mlp = {"wi": (d_model, d_ff), "wo": (d_ff, d_model)}
    enc = {f"layer_{i}": {"attn": attn, "mlp": mlp, "ln1": (d_model,), "ln2": (d_model,)}
           for i in range(layers)}
    dec = {f"layer_{i}": {"self": attn, "cross": attn, "mlp": mlp, "ln1": (d_model,),
                          "ln2": (d_model,), "ln3": (d_model,)} for i in range(layers)}
    return {"embed": (vocab, d_model), "encoder": enc, "decoder": dec,
            "enc_rel_bias": (32, heads), "dec_rel_bias": (32, heads),
            "enc_norm": (d_model,), "dec_norm": (d_model,)}


def _timed(candidates: dict, repeats: int) -> dict[str, list[float]]:
    """Compiles and warms up every candidate, then times them round-robin (load hits all alike)."""
    blocking = {name: (lambda fn=fn: jax.block_until_ready(fn())) for name, fn in candidates.items()}
    for fn in blocking.values():
        fn()
    return common.interleaved_times(blocking, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--d_ff", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--tasks", type=int, nargs="+", default=[6, 8])
    parser.add_argument("--median_samples", type=int, default=1 << 18)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="results JSON (default results/taco_transform.json)")
    parser.add_argument("--float_sorts", action="store_true",
                        help="also time jnp.median and a float32 sort (slow on CPU).")
    args = parser.parse_args()

    shapes = t5_param_shapes(args.vocab, args.d_model, args.d_ff, args.layers, 8, args.d_model // 8)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    key = jax.random.PRNGKey(0)
    params = jax.tree_util.tree_map(
        lambda s: 0.05 * jax.random.normal(jax.random.fold_in(key, sum(s)), s), shapes,
        is_leaf=is_shape)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    result = {"num_params": int(num_params), "param_bytes": int(param_bytes), "config": vars(args),
              "machine": common.machine_info(backend=jax.default_backend(),
                                             devices=jax.device_count()),
              "by_tasks": {}}

    for k in args.tasks:
        grads = jax.tree_util.tree_map(
            lambda p, k=k: jax.random.normal(jax.random.fold_in(key, p.size % 997), (k,) + p.shape)
            * jnp.exp(jax.random.normal(key, (k,) + p.shape)), params)
        row = {}
        transforms = {
            "naive_sum": multitask.naive_sum(k, total_steps=10),
            "taco_exact": multitask.taco(k, total_steps=10, burn_in_fraction=0.0, median="exact"),
            "taco_approx": multitask.taco(k, total_steps=10, burn_in_fraction=0.0, median="approx",
                                   median_samples=args.median_samples),
        }
        updates = {}
        for name, tx in transforms.items():
            state, update = tx.init(params), jax.jit(tx.update)
            updates[name] = functools.partial(update, grads, state, params)
        times = _timed(updates, args.repeats)
        for name in transforms:
            row[name] = common.summarize(times[name])
            print(f"  K={k} {name}: {row[name]['median_s']:.3f} s/update", file=sys.stderr, flush=True)
        for name in ("taco_exact", "taco_approx"):
            row[f"{name}_vs_naive"] = common.speedup(times, "naive_sum", name)

        sens = jax.jit(lambda g, p: jax.tree_util.tree_map(lambda a, b: jnp.abs(b[None] * a), g, p))(
            grads, params)
        flat = jax.jit(lambda s, k=k: jnp.concatenate(
            [x.reshape(k, -1) for x in jax.tree_util.tree_leaves(s)], 1))(sens)
        medians = {
            "median_radix_exact": jax.jit(lambda s: taco_global_median(s, "exact")),
            "median_sort_int_bits": jax.jit(lower_median_sorted),
        }
        if args.float_sorts:  # XLA:CPU float sorts are ~6x slower than int32 ones: opt-in
            medians["median_jnp_median"] = jax.jit(lambda x: jnp.median(x, axis=1))
            medians["median_sort_float"] = jax.jit(
                lambda x: jnp.sort(x, axis=1)[:, (x.shape[1] - 1) // 2])
        median_fns = {name: functools.partial(fn, sens if "radix" in name else flat) for name, fn in medians.items()}
        approx_median = jax.jit(lambda s: taco_global_median(s, "approx", args.median_samples))
        median_fns["median_approx"] = functools.partial(approx_median, sens)
        times = _timed(median_fns, args.repeats)
        for name in median_fns:
            row[name] = common.summarize(times[name])
            print(f"  K={k} {name}: {row[name]['median_s']:.3f} s", file=sys.stderr, flush=True)
        exact = np.asarray(medians["median_radix_exact"](sens))
        row["radix_equals_sort"] = bool(np.array_equal(
            exact, np.asarray(medians["median_sort_int_bits"](flat))))
        approx = np.asarray(approx_median(sens))
        row["approx_median_max_rel_err"] = float(np.abs(approx / exact - 1).max())
        del sens, flat, median_fns

        for dtype in ("float32", "bfloat16"):
            shape = jax.eval_shape(multitask.taco(k, 1, burn_in_fraction=0.0, state_dtype=jnp.dtype(dtype)).init, params)
            state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shape))
            row[f"state_bytes_{dtype}"] = int(state_bytes)
            row[f"state_over_param_bytes_{dtype}"] = state_bytes / param_bytes
        result["by_tasks"][str(k)] = row
        del grads, updates

    parts = []
    for k, row in result["by_tasks"].items():
        parts.append(
            f"K={k}: exact {row['taco_exact_vs_naive']['ratio_of_medians']:.1f}x, approx "
            f"{row['taco_approx_vs_naive']['ratio_of_medians']:.1f}x naive time; median radix "
            f"{row['median_radix_exact']['median_s']:.2f}s, int sort "
            f"{row['median_sort_int_bits']['median_s']:.2f}s, approx "
            f"{row['median_approx']['median_s']:.3f}s; state "
            f"{row['state_over_param_bytes_float32']:.0f}x/{row['state_over_param_bytes_bfloat16']:.0f}x"
            " params (fp32/bf16)")
    common.write_results("taco_transform", result,
                         f"{num_params / 1e6:.1f}M params: " + "; ".join(parts), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
