"""Examples/s of the per-task batch iterator (tokenisation included) vs what a train step consumes.

On the demo data (8 tasks). References timed in the same run: (1) encoding the same strings with the
vocabulary directly (the cost a naive per-step tokenising pipeline would pay); (2) the examples/s
one jitted naive train step consumes at the tiny and small model sizes on the same batches. The
input pipeline must not be the bottleneck: iterator examples/s >= 10x the step's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_iterator(iterator, steps: int, warmup: int = 2) -> float:
    """Training examples (queries) per second over `steps` steps after `warmup` steps."""
    for _ in range(warmup):
        next(iterator)
    start, n = time.perf_counter(), 0
    for _ in range(steps):
        n += sum(len(sub["task_ids"]) for sub in next(iterator).values())
    return n / (time.perf_counter() - start)


def train_step_examples_per_s(iterator, size: str, vocab_size: int, steps: int) -> float:
    """Queries/s consumed by the naive jitted train step (single device) on the iterator's batches."""
    import jax
    import optax

    from t5_retrieval import sharding
    from t5_retrieval.models.build import init_params
    from t5_retrieval.models.dual_encoder import DualEncoder
    from t5_retrieval.models.t5 import T5Config
    from t5_retrieval.train_step import TrainState, make_train_step

    shapes = {"tiny": dict(d_model=64, num_heads=4, d_kv=16, d_ff=128, num_encoder_layers=2, num_decoder_layers=2),
              "small": dict(d_model=512, num_heads=6, d_kv=64, d_ff=1024, num_encoder_layers=8,
                            num_decoder_layers=8)}[size]
    model = DualEncoder(T5Config(vocab_size=vocab_size, dropout_rate=0.0, **shapes))
    mesh = sharding.make_mesh()
    params, _ = init_params(model, jax.random.PRNGKey(0), mesh, sharding.logical_axis_rules())
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    state = TrainState.create(params, optimizer.init(params), jax.random.PRNGKey(1))
    step = jax.jit(make_train_step(model, optimizer, iterator.task_names, per_task=False), donate_argnums=0)
    batches = [next(iterator) for _ in range(steps + 2)]
    for batch in batches[:2]:  # compile; the second call sees committed (donated) state and may compile again
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    start = time.perf_counter()
    for batch in batches[2:]:
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    queries = sum(len(sub["task_ids"]) for sub in batches[1].values())
    return queries * steps / (time.perf_counter() - start)


def main() -> int:
    import seqio

    import tasks  # noqa: F401  (registers the demo tasks)
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import TASKS, write_demo
    from t5_retrieval.data.stores.kb import PassageStore, passage_text
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per_device_batch", type=int, default=64)
    p.add_argument("--num_negatives", type=int, default=2)
    p.add_argument("--step_sizes", default="tiny,small", help="model sizes whose train step is measured")
    p.add_argument("--train_steps", type=int, default=3)
    p.add_argument("--step_per_device_batch", type=int, default=16,
                   help="batch of the measured train step (64 x 3 x 256 tokens at t5-small needs ~30 GB on CPU)")
    p.add_argument("--vocab", default=os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece",
                                                   "sentencepiece.model"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_demo(os.path.join(tmp, "raw"))
        prepare_kb(os.path.join(tmp, "raw", "kb", "pages.jsonl"), tmp)
        prepare_tasks(os.path.join(tmp, "raw"), tmp, TASKS, ("train",))
        prepare_negatives(tmp, TASKS, index=build_bm25_index_for_kb(os.path.join(tmp, "kb")))
        vocab = seqio.SentencePieceVocabulary(a.vocab, extra_ids=100)
        it = make_train_iterator("demo", tmp, None, vocab, 64, 256, a.num_negatives, a.per_device_batch, seed=0)
        rate = measure_iterator(it, a.steps)
        texts = [passage_text(x) for x in PassageStore.open(os.path.join(tmp, "kb"))]
        n = min(len(texts), 2000)
        start = time.perf_counter()
        for t in texts[:n]:
            vocab.encode(t)
        per_text = (time.perf_counter() - start) / n
        naive_rate = 1.0 / (per_text * (2 + a.num_negatives))  # one query + (1 + N) passages per example
        step_it = make_train_iterator("demo", tmp, None, vocab, 64, 256, a.num_negatives, a.step_per_device_batch,
                                      seed=0)
        consumed = {size: train_step_examples_per_s(step_it, size, vocab.vocab_size, a.train_steps)
                    for size in a.step_sizes.split(",") if size}
    result = {"iterator_examples_per_s": rate, "naive_tokenize_examples_per_s": naive_rate,
              "ratio_vs_naive": rate / naive_rate, "steps": a.steps, "per_device_batch": a.per_device_batch,
              "num_negatives": a.num_negatives, "tasks": len(TASKS), "query_len": 64, "passage_len": 256,
              "train_step_examples_per_s": consumed, "step_per_device_batch": a.step_per_device_batch,
              "iterator_over_train_step": {size: rate / r for size, r in consumed.items()}, "target_ratio": 10.0}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "input_pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    over = ", ".join(f"{size} step {r:.0f}/s ({rate / r:.0f}x)" for size, r in consumed.items())
    print(f"input_pipeline: {rate:.0f} examples/s ({rate / naive_rate:.1f}x per-step tokenisation); {over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
