"""Examples/s of the per-task batch iterator (tokenisation included), on the demo data.

Reference timed in the same run: encoding the same number of query and passage strings with the
vocabulary directly (the cost a naive per-step tokenising pipeline would pay). `measure_iterator`
is importable so that the trainer benchmark can put it next to train-step throughput.
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


def main() -> int:
    import seqio

    from t5_retrieval.data.batches import make_train_iterator
    from t5_retrieval.data.demo import TASKS, write_demo
    from t5_retrieval.data.kb import PassageStore, passage_text
    from t5_retrieval.data.prepare import prepare_kb, prepare_negatives, prepare_tasks

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per_device_batch", type=int, default=64)
    p.add_argument("--num_negatives", type=int, default=2)
    p.add_argument("--vocab", default=os.path.join(os.path.dirname(seqio.__file__), "test_data", "sentencepiece",
                                                   "sentencepiece.model"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_demo(os.path.join(tmp, "raw"))
        prepare_kb(os.path.join(tmp, "raw", "kb", "pages.jsonl"), tmp)
        prepare_tasks(os.path.join(tmp, "raw"), tmp, TASKS, ("train",))
        prepare_negatives(tmp, TASKS)
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
    result = {"iterator_examples_per_s": rate, "naive_tokenize_examples_per_s": naive_rate,
              "ratio_vs_naive": rate / naive_rate, "steps": a.steps, "per_device_batch": a.per_device_batch,
              "num_negatives": a.num_negatives, "tasks": len(TASKS)}
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "input_pipeline.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"input_pipeline: {rate:.0f} examples/s ({rate / naive_rate:.1f}x per-step tokenisation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
