"""TACO's cost inside the whole jitted train step, against the naive multi-task step.

Four steps per (model size, K), each `make_train_step` + `make_optimizer` (clip -> AdamW) on the
same batch, jitted with shardings and a donated state as in `t5_retrieval.train`:

- ``naive``:        multitask=None; the step sums the task gradients as they come (one gradient).
- ``stacked_sum``:  per-task gradients stacked [K, ...] then `naive_sum` (isolates the cost of
                    forming and keeping K gradients from the cost of the transform).
- ``taco_exact``:   per-task gradients + TACO with the exact (radix-select) global median.
- ``taco_approx``:  per-task gradients + TACO with the sampled median (2^18 positions).

TACO runs past burn-in (burn_in_fraction 0), i.e. the softmax-weighted branch; both branches cost
the same since the state and weights are computed every step. Steps are timed round-robin so
machine load hits all alike; ratios to ``naive`` are from the same run.

Sizes: ``tiny`` = gin_configs/models/t5_tiny.gin (d_model 64, 2 layers, vocab 32128);
``small`` = T5 v1.1 small shapes (d_model 512, 6 heads x 64, d_ff 1024, 8 layers) with the
vocabulary reduced to 8192 by default (``--small_vocab 32128`` for the real one). With the
reduced batch every task's sub-batch has the same shape, so the per-task step is one `lax.scan`
and compiles about as fast as the naive one: on a quiet 2-core machine ~20 s per tiny step and
2-3.5 minutes per small one, so ``--sizes tiny small --batch reduced`` takes ~40 minutes and
``--sizes tiny --tasks 6`` ~3. Results are written after every (size, K); with
``JAX_COMPILATION_CACHE_DIR`` (and ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1``) a rerun
reuses what was compiled.

    .venv/bin/python benchmarks/bench_taco_step.py [--sizes tiny small] [--tasks 6 8] [--repeats 3] [--tiny_repeats 20]
        [--batch recipe|reduced]
"""

from __future__ import annotations

import common

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import argparse  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from t5_retrieval import multitask, sharding  # noqa: E402
from t5_retrieval.data.batching.random_batches import RandomBatches  # noqa: E402
from t5_retrieval.models.build import init_params  # noqa: E402
from t5_retrieval.models.dual_encoder import DualEncoder  # noqa: E402
from t5_retrieval.models.t5 import T5Config  # noqa: E402
from t5_retrieval.optim import make_optimizer  # noqa: E402
from t5_retrieval.train_step import TrainState, make_train_step, task_groups  # noqa: E402

TARGET_RATIO = 1.15  # the target: TACO step time <= 1.15x the naive step

# Per-device batch shapes. TACO's cost is O(K x params) per step whatever the batch, so its
# overhead relative to the step depends on the batch: ``recipe`` is what a run trains with
# (gin_configs/runs/base.gin: 64 queries per device split over the tasks, 2 hard negatives,
# queries 64 and passages 256 tokens), ``reduced`` a small CPU-sized batch (the worst case) whose
# 24 queries split evenly over K = 6 and 8 tasks, so that the per-task step is one `lax.scan`
# (`train_step.task_groups`); the recipe batch at K = 6 has two sub-batch sizes (11 and 10).
BATCHES = {
    "recipe": {"per_device_batch": 64, "query_len": 64, "passage_len": 256, "hard_negatives": 2},
    "reduced": {"per_device_batch": 24, "query_len": 32, "passage_len": 64, "hard_negatives": 1},
}


def t5_config(size: str, small_vocab: int) -> T5Config:
    common_fields = dict(mlp_activation="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1)
    if size == "tiny":  # gin_configs/models/t5_tiny.gin
        return T5Config(vocab_size=32128, d_model=64, num_heads=4, d_kv=16, d_ff=128,
                        num_encoder_layers=2, num_decoder_layers=2, **common_fields)
    if size == "small":  # T5 v1.1 small
        return T5Config(vocab_size=small_vocab, d_model=512, num_heads=6, d_kv=64, d_ff=1024,
                        num_encoder_layers=8, num_decoder_layers=8, **common_fields)
    raise ValueError(f"unknown size {size!r}; expected tiny or small")


def variants(median_samples: int) -> dict:
    """name -> (multitask factory or None, per-task gradients?)."""
    return {
        "naive": (None, False),
        "stacked_sum": (multitask.naive_sum, True),
        "taco_exact": (functools.partial(multitask.taco, burn_in_fraction=0.0, median="exact"), True),
        "taco_approx": (functools.partial(multitask.taco, burn_in_fraction=0.0, median="approx",
                                          median_samples=median_samples), True),
    }


class Step:
    """One jitted train step holding its own (donated) state, built like `train.train` does."""

    def __init__(self, model, mesh, rules, factory, per_task: bool, task_names, batch):
        optimizer = make_optimizer(total_steps=1000, num_tasks=len(task_names), multitask=factory)
        params, param_sh = init_params(model, jax.random.PRNGKey(0), mesh, rules)
        opt_sh = sharding.opt_state_shardings(optimizer, params, param_sh, mesh, rules)
        rep = sharding.replicated(mesh)
        state = TrainState.create(params, jax.jit(optimizer.init, out_shardings=opt_sh)(params),
                                  jax.random.PRNGKey(1))
        state_sh = jax.tree.map(lambda _: rep, state).replace(params=param_sh, opt_state=opt_sh)
        self.state = jax.device_put(state, state_sh)
        self.param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        self.num_params = sum(x.size for x in jax.tree.leaves(params))
        taco_state = optax.tree_utils.tree_get(self.state.opt_state, "TacoState")
        self.taco_state_bytes = (None if taco_state is None else
                                 sum(x.nbytes for x in jax.tree.leaves(taco_state)))
        fn = make_train_step(model, optimizer, task_names, per_task=per_task,
                             extra_metrics=None if factory is None else multitask.multitask_metrics)
        batch_sh = jax.tree.map(lambda x: x.sharding, batch)
        start = time.perf_counter()
        self.compiled = jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, rep),
                                donate_argnums=(0,)).lower(self.state, batch).compile()
        self.compile_s = time.perf_counter() - start
        self.batch = batch

    def __call__(self) -> float:
        self.state, metrics = self.compiled(self.state, self.batch)
        jax.block_until_ready(self.state)
        return float(metrics["loss"])


def bench(size: str, k: int, args) -> dict:
    cfg = t5_config(size, args.small_vocab)
    model = DualEncoder(cfg)
    mesh, rules = sharding.make_mesh(), sharding.logical_axis_rules()
    task_names = [f"task_{i}" for i in range(k)]
    batch_shape = BATCHES[args.batch]
    passage_len = batch_shape["passage_len"]
    data = RandomBatches(per_device_batch=batch_shape["per_device_batch"], local_data_devices=1,
                         task_names=task_names, vocab_size=cfg.vocab_size,
                         query_len=batch_shape["query_len"], passage_len=passage_len,
                         num_negatives=batch_shape["hard_negatives"])
    row: dict = {"config": {"d_model": cfg.d_model, "num_heads": cfg.num_heads, "d_ff": cfg.d_ff,
                            "layers": cfg.num_encoder_layers, "vocab_size": cfg.vocab_size},
                 "batch": {"preset": args.batch, **batch_shape, "subbatch_sizes": data.sizes}}
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        batch = sharding.global_batch(mesh, next(data))
        row["task_groups"] = task_groups(model, batch, task_names)  # one compiled backward pass per group
        steps = {}
        for name, (factory, per_task) in variants(args.median_samples).items():
            steps[name] = Step(model, mesh, rules, factory, per_task, task_names, batch)
            row[f"{name}_compile_s"] = steps[name].compile_s
            start = time.perf_counter()
            row[f"{name}_first_loss"] = steps[name]()  # warm-up
            print(f"  {size} K={k} {name}: compiled in {steps[name].compile_s:.1f} s, first step "
                  f"{time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
        times = common.interleaved_times(steps, args.tiny_repeats if size == "tiny" else args.repeats)
    row["num_params"] = int(steps["naive"].num_params)
    row["param_bytes"] = int(steps["naive"].param_bytes)
    row["taco_state_bytes_float32"] = int(steps["taco_exact"].taco_state_bytes)
    row["taco_state_over_param_bytes_float32"] = steps["taco_exact"].taco_state_bytes / row["param_bytes"]
    for name in steps:
        row[name] = common.summarize(times[name])
        if name != "naive":  # step time / naive step time (speedup(ours=naive, reference=name))
            row[f"{name}_over_naive"] = common.speedup(times, "naive", name)
        print(f"  {size} K={k} {name}: {row[name]['median_s']:.3f} s/step", file=sys.stderr, flush=True)
    row["taco_approx_meets_target"] = row["taco_approx_over_naive"]["ratio_of_medians"] <= TARGET_RATIO
    row["taco_exact_meets_target"] = row["taco_exact_over_naive"]["ratio_of_medians"] <= TARGET_RATIO
    del steps
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--tasks", type=int, nargs="+", default=[6, 8])
    parser.add_argument("--small_vocab", type=int, default=8192)
    parser.add_argument("--batch", choices=sorted(BATCHES), default="recipe",
                        help="recipe: gin_configs/runs/base.gin's per-device batch; reduced: a CPU-sized one")
    parser.add_argument("--median_samples", type=int, default=1 << 18)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds of the small steps (seconds each)")
    parser.add_argument("--tiny_repeats", type=int, default=20, help="timed rounds of the tiny steps (~0.1-0.4 s each)")
    parser.add_argument("--out", default=None, help="results JSON (default results/taco_step.json)")
    args = parser.parse_args()

    result = {"config": vars(args), "target_ratio": TARGET_RATIO, "blas_env": ORIGINAL_BLAS_ENV,
              "machine": common.machine_info(backend=jax.default_backend(), devices=jax.device_count()),
              "runs": {}}
    parts = []
    for k in args.tasks:  # K outer: a run cut short still has both sizes at the first K
        for size in args.sizes:
            row = bench(size, k, args)
            result["runs"][f"{size}_K{k}"] = row
            ratio = {name: row[f"{name}_over_naive"]["ratio_of_medians"]
                     for name in ("taco_approx", "taco_exact", "stacked_sum")}
            parts.append(f"{size} K={k}: approx {ratio['taco_approx']:.2f}x, exact "
                         f"{ratio['taco_exact']:.2f}x, stacked sum {ratio['stacked_sum']:.2f}x")
            result["machine"]["load_average_1m_end"] = float(np.round(os.getloadavg()[0], 2))
            # Written after every (size, K): compiles are minutes each on a loaded 2-core machine.
            common.write_results("taco_step", result, f"step time / naive step ({args.tiny_repeats} / "
                                 f"{args.repeats} rounds for tiny / small): " + "; ".join(parts), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
