"""One training step: our jitted `make_train_step` vs a PyTorch step built on transformers' T5 or BERT.

Same work on both sides, float32, dropout 0, same initial weights and batch: ST5-EncDec embeddings
(encoder + one decoder step) of the queries and of the passages laid out [pos, neg] per query, the
in-batch softmax loss, backward, clip by global norm 1.0 and an AdamW update (weight decay 0).
Ours is `make_train_step(per_task=False)` with the project optimiser (`make_optimizer`: clip ->
AdamW with warm-up/decay); by default one task holds the whole batch, `--tasks K` splits the same
total batch over K tasks (K sequential forward/backward passes, as in real multi-task training).
PyTorch: loss.backward, clip_grad_norm_, torch.optim.AdamW (`--torch_adamw` picks its kernel).
The first step's losses are compared, compile time is reported separately, and repeats are
interleaved so the speed-up is a ratio from the same run.

`--sizes minilm`: all-MiniLM-L6-v2 (the installed pretrained weights on both sides) as one shared
encoder trained on queries and passages (both towers), its recipe's mean pooling, L2 norm and
logit scale 20, against `transformers.BertModel` doing the same.

    .venv/bin/python benchmarks/bench_train_step.py [--sizes small minilm] [--queries 16] [--tasks 1]
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
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from bench_encode import (  # noqa: E402
    hf_embed,
    hf_t5,
    ours_from_hf,
    t5_config,
    torch_info,
    torch_time_breakdown,
    xla_time_breakdown,
)

from t5_retrieval.data.batching.random_batches import RandomBatches  # noqa: E402
from t5_retrieval.optim import make_optimizer  # noqa: E402
from t5_retrieval.train_step import TrainState, make_train_step  # noqa: E402

TARGET_SPEEDUP = 1.3
LEARNING_RATE = 1e-5


class TorchStep:
    """The reference step: embeddings, in-batch softmax CE (logits times `logit_scale`), backward,
    clip 1.0, AdamW."""

    def __init__(self, model: transformers.T5Model, adamw_kernel: str):
        self.model = model.train()  # dropout_rate is 0, so train mode changes nothing but the flag
        kernel = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}[adamw_kernel]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, **kernel)

    logit_scale = 1.0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return hf_embed(self.model, ids)

    def __call__(self, batch: dict[str, dict[str, torch.Tensor]]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for task_batch in batch.values():  # tasks one after another, like ours
            queries, passages = self.embed(task_batch["query_tokens"]), self.embed(task_batch["passage_tokens"])
            logits = self.logit_scale * queries @ passages.T
            labels = torch.arange(queries.shape[0]) * (passages.shape[0] // queries.shape[0])
            loss = torch.nn.functional.cross_entropy(logits, labels)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return total


class TorchBertStep(TorchStep):
    """The reference step for a BERT dual encoder: masked mean pooling, L2 norm, scaled logits."""

    def __init__(self, model: transformers.BertModel, adamw_kernel: str, logit_scale: float):
        super().__init__(model, adamw_kernel)
        self.logit_scale = logit_scale

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).to(torch.float32)
        hidden = self.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, dim=-1)


def minilm_models(seed: int):
    """Our MiniLM dual encoder (config from models/minilm_l6.gin, pretrained weights) and HF's."""
    import gin

    from t5_retrieval import gin_utils, sharding, train  # noqa: F401  (train: the model file binds train.init_from)
    from t5_retrieval.models.build import build_model, init_params, initial_params, model_config
    from t5_retrieval.models.pretrained import minilm_l6_dir

    gin.clear_config()
    gin_utils.parse_gin(["models/minilm_l6.gin"], ["BertConfig.dropout_rate = 0.0"])
    config = model_config()
    gin.clear_config()
    model = build_model(config)
    params, _ = init_params(model, jax.random.PRNGKey(seed), sharding.make_mesh(), sharding.logical_axis_rules())
    params = initial_params(minilm_l6_dir(), params, config)
    hf = transformers.BertModel.from_pretrained(minilm_l6_dir(), add_pooling_layer=False,
                                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return model, {"params": params}, hf, config


class OursStep:
    """Our jitted step, holding the (donated) state between calls."""

    def __init__(self, model, variables, task_names: list[str], batch: dict, logit_scale: float = 1.0):
        optimizer = make_optimizer(total_steps=1000, num_tasks=len(task_names), learning_rate=LEARNING_RATE)
        params = variables["params"]
        self.state = TrainState.create(params, jax.jit(optimizer.init)(params), jax.random.PRNGKey(0))
        step_fn = make_train_step(model, optimizer, task_names, per_task=False, logit_scale=logit_scale)
        start = time.perf_counter()
        self.compiled = jax.jit(step_fn, donate_argnums=(0,)).lower(self.state, batch).compile()
        self.compile_s = time.perf_counter() - start

    def __call__(self, batch: dict) -> float:
        self.state, metrics = self.compiled(self.state, batch)
        return float(metrics["loss"])  # waits for the step


def bench_size(size: str, queries: int, tasks: int, negatives: int, query_len: int, passage_len: int,
               repeats: int, adamw_kernel: str, seed: int, profile: bool) -> dict:
    if size == "minilm":
        model, variables, hf, config = minilm_models(seed)
        logit_scale, vocab_size, described = config["dual_encoder"]["logit_scale"], config["bert"]["vocab_size"], config
    else:
        cfg = t5_config(size)
        hf = hf_t5(cfg, seed)
        model, variables = ours_from_hf(cfg, hf)
        logit_scale, vocab_size, described = 1.0, cfg.vocab_size, dataclasses.asdict(cfg)
    task_names = [f"task_{k}" for k in range(tasks)]
    data = RandomBatches(per_device_batch=queries, local_data_devices=1, seed=seed, task_names=task_names,
                         vocab_size=vocab_size, query_len=query_len, passage_len=passage_len,
                         num_negatives=negatives)
    np_batch = next(data)
    jax_batch = jax.device_put(np_batch)
    torch_batch = {name: {key: torch.from_numpy(v).long() for key, v in b.items() if key.endswith("tokens")}
                   for name, b in np_batch.items()}

    ours = OursStep(model, variables, task_names, jax_batch, logit_scale)
    theirs = TorchStep(hf, adamw_kernel) if size != "minilm" else TorchBertStep(hf, adamw_kernel, logit_scale)
    ours_loss, theirs_loss = ours(jax_batch), theirs(torch_batch)  # warm-up; same weights -> same loss
    times = common.interleaved_times({"ours": lambda: ours(jax_batch), "transformers": lambda: theirs(torch_batch)},
                                     repeats)
    breakdown = {
        "ours_xla_op_time": xla_time_breakdown(ours.compiled, lambda: ours(jax_batch)),
        "transformers_aten_self_time": torch_time_breakdown(lambda: theirs(torch_batch)),
    } if profile else None
    speed = common.speedup(times, "ours", "transformers")
    return {
        "config": described,
        "batch": {"queries": queries, "tasks": tasks, "queries_per_task": data.sizes,
                  "hard_negatives": negatives, "query_len": query_len, "passage_len": passage_len,
                  "passages": queries * (1 + negatives)},
        "compile_s": ours.compile_s,
        "first_step_loss": {"ours": ours_loss, "transformers": theirs_loss,
                            "match": abs(ours_loss - theirs_loss) <= 1e-3 * max(1.0, abs(theirs_loss))},
        "ours": {**common.summarize(times["ours"]), "steps_per_s": 1 / np.median(times["ours"])},
        "transformers": {**common.summarize(times["transformers"]),
                         "steps_per_s": 1 / np.median(times["transformers"])},
        "speedup": speed, "target_speedup": TARGET_SPEEDUP,
        "target_met": speed["ratio_of_medians"] >= TARGET_SPEEDUP,
        "time_breakdown": breakdown,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small"],
                        help="model sizes: gin_configs/models/t5_<size>.gin (base is slow; tiny for smoke tests), "
                             "or minilm (all-MiniLM-L6-v2, both towers)")
    parser.add_argument("--queries", type=int, default=16, help="total queries per step (all tasks)")
    parser.add_argument("--tasks", type=int, default=1, help="tasks sharing the queries (sequential passes)")
    parser.add_argument("--negatives", type=int, default=1, help="hard negatives per query")
    parser.add_argument("--query_len", type=int, default=32)
    parser.add_argument("--passage_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--torch_adamw", choices=["default", "foreach", "fused"], default="fused",
                        help="torch.optim.AdamW implementation for the reference")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch intra-op threads (XLA's CPU backend uses all cores)")
    parser.add_argument("--profile", action="store_true",
                        help="also record where each side spends its time (one extra profiled step each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="results path (default benchmarks/results/train_step.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    by_size = {size: bench_size(size, args.queries, args.tasks, args.negatives, args.query_len,
                                args.passage_len, args.repeats, args.torch_adamw, args.seed, args.profile)
               for size in args.sizes}
    result = {
        "what": "seconds per train step (embed queries + passages, in-batch softmax, backward, clip, AdamW)",
        "machine": common.machine_info(jax=jax.__version__, jax_backend=jax.default_backend(),
                                       jax_devices=jax.device_count()),
        "blas_env_at_start": ORIGINAL_BLAS_ENV, "blas_env_for_run": "unset",
        "torch": torch_info(args.threads), "args": vars(args), "by_size": by_size,
    }
    summary = "; ".join(
        f"{size} {args.queries}q x {1 + args.negatives}p ({args.tasks} task{'s' if args.tasks > 1 else ''}), "
        f"len {args.query_len}/{args.passage_len}: ours {r['ours']['median_s']:.3f}s vs transformers "
        f"{r['transformers']['median_s']:.3f}s (x{r['speedup']['ratio_of_medians']:.2f}, target "
        f"x{TARGET_SPEEDUP} {'met' if r['target_met'] else 'MISSED'}, compile {r['compile_s']:.1f}s)"
        for size, r in by_size.items())
    common.write_results("train_step", result, summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
