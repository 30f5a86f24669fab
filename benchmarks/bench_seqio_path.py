"""The seqio data path: materialising Tasks through seqio, reading the cache, batching after it,
against what a t5-base train step at the recipe batch consumes.

Data: the synthetic demo's 8 KILT-shaped Tasks (`demo_*`) at `--examples` training examples in all
(default 100k), over a small KB. Timed in one run:
  - materialisation: every Task's train split read through its seqio source and preprocessors
    (query formatting, sentencepiece tokenisation, EOS) into the cache, cold;
  - the cache read back (what every later run and every resume pays);
  - batching after it: the training iterator at the recipe's per-device batch (64).
The reference is the queries/s one device consumes in a t5-base train step at that batch (64
queries of 64 tokens, 2 hard negatives, 256-token passages): 3x the forward matmul FLOPs
(`bench_flops.encoder_matmul_flops`, the one-step decoder left out) at `--device_tflops` x `--mfu`
(default: an A100's 312 dense bf16 TFLOP/s at 50% utilisation). The projection to full KILT (~2.9M
training examples) is linear in examples.

    .venv/bin/python benchmarks/bench_seqio_path.py [--examples 100000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

FULL_KILT_TRAIN = 2_906_357  # KILT train examples of the 8 datasets (Petroni et al. 2021, Table 1)
RECIPE = {"per_device_batch": 64, "query_len": 64, "passage_len": 256, "num_negatives": 2}


def step_queries_per_s(device_tflops: float, mfu: float) -> float:
    """Queries/s of one device in a t5-base train step at the recipe batch, from matmul FLOPs."""
    from bench_encode import t5_config
    from bench_flops import encoder_matmul_flops

    cfg = t5_config("base")
    b, n = RECIPE["per_device_batch"], RECIPE["num_negatives"]
    forward = (encoder_matmul_flops(cfg, b, RECIPE["query_len"])["total"]
               + encoder_matmul_flops(cfg, b * (1 + n), RECIPE["passage_len"])["total"])
    step_seconds = 3 * forward / (device_tflops * 1e12 * mfu)
    return b / step_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="training examples over the 8 Tasks")
    parser.add_argument("--device_tflops", type=float, default=312.0)
    parser.add_argument("--mfu", type=float, default=0.5)
    parser.add_argument("--batching_steps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from bench_input_pipeline import measure_iterator

    import t5_retrieval.tasks  # noqa: F401
    from t5_retrieval.data.batching.batches import make_train_iterator
    from t5_retrieval.data.kilt.prepare import prepare_kb, prepare_negatives, prepare_tasks
    from t5_retrieval.data.kilt.synthetic import TASKS, write_demo
    from t5_retrieval.data.tasks import retrieval_tasks
    from t5_retrieval.data.tasks.materialize import materialize
    from t5_retrieval.data.tokenizers.train_sentencepiece import train_vocabulary
    from t5_retrieval.retrieval.index import build_bm25_index_for_kb

    tmp = tempfile.mkdtemp(prefix="bench_seqio_")
    try:
        raw, data = os.path.join(tmp, "raw"), os.path.join(tmp, "data")
        write_demo(raw, num_pages=300, train_per_task=args.examples // len(TASKS), dev_per_task=4)
        prepare_kb(os.path.join(raw, "kb", "pages.jsonl"), data)
        prepare_tasks(raw, data, TASKS, ("train",))
        vocabulary = train_vocabulary(os.path.join(data, "kb"), os.path.join(tmp, "spm"), vocab_size=2000)
        retrieval_tasks.set_data_dir(data)
        retrieval_tasks.use_vocabulary(vocabulary)
        tasks = [task for task, _ in retrieval_tasks.resolve("demo")]
        cache = os.path.join(tmp, "cache")

        start = time.perf_counter()
        examples = sum(len(materialize(task, "train", cache)) for task in tasks)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        again = sum(len(materialize(task, "train", cache)) for task in tasks)
        warm = time.perf_counter() - start
        assert again == examples
        cache_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(cache) for f in files)

        prepare_negatives(data, TASKS, top_k=RECIPE["num_negatives"], index=build_bm25_index_for_kb(os.path.join(data, "kb")))
        start = time.perf_counter()
        iterator = make_train_iterator("demo", data, None, vocabulary, RECIPE["query_len"], RECIPE["passage_len"],
                                       RECIPE["num_negatives"], RECIPE["per_device_batch"], cache_dir=cache)
        setup = time.perf_counter() - start
        batching = measure_iterator(iterator, args.batching_steps)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    consumed = step_queries_per_s(args.device_tflops, args.mfu)
    result = {
        "examples": examples,
        "materialize_seconds": cold, "materialize_examples_per_s": examples / cold,
        "cache_read_seconds": warm, "cache_read_examples_per_s": examples / warm,
        "cache_bytes": cache_bytes, "cache_bytes_per_example": cache_bytes / examples,
        "iterator_setup_seconds_from_cache": setup, "batching_examples_per_s": batching,
        "reference": {"model": "t5-base", **RECIPE, "device_tflops": args.device_tflops, "mfu": args.mfu,
                      "step_queries_per_s_per_device": consumed},
        "ratios": {"materialize_vs_step": examples / cold / consumed, "batching_vs_step": batching / consumed},
        "full_kilt_projection": {"examples": FULL_KILT_TRAIN,
                                 "materialize_hours": FULL_KILT_TRAIN / (examples / cold) / 3600,
                                 "cache_gib": FULL_KILT_TRAIN * cache_bytes / examples / 2**30,
                                 "cache_read_minutes": FULL_KILT_TRAIN / (examples / warm) / 60},
        "machine": common.machine_info(cpu=common.cpu_model()),
    }
    summary = (f"seqio path, {examples:,} examples: materialise {examples / cold:,.0f} ex/s "
               f"({result['ratios']['materialize_vs_step']:.1f}x a t5-base step's {consumed:,.0f} q/s/device), "
               f"cache read {examples / warm:,.0f} ex/s, batching {batching:,.0f} ex/s "
               f"({result['ratios']['batching_vs_step']:.1f}x); cache {cache_bytes / examples:.0f} B/example; "
               f"full KILT: {result['full_kilt_projection']['materialize_hours']:.2f} h once, "
               f"{result['full_kilt_projection']['cache_gib']:.2f} GiB")
    common.write_results("seqio_path", result, summary, args.out)


if __name__ == "__main__":
    main()
