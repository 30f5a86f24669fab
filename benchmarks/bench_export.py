"""`t5r export`: SavedModel search latency vs the Python search path, export time, SavedModel size.

Builds the tiny demo model directory and brute-force index of the export tests
(`tests/tiny_model.py`, `--pages` pages of synthetic KB), exports it with `export_savedmodel`, loads
the SavedModel with `tf.saved_model.load`, and times, per batch size, one `search` call of the
SavedModel against the Python path on the same queries and index (`retrieval.search.dense_searcher`:
`DualEncoderInference.encode_queries` -> `Index.search`), interleaved round by round. Both return
the same top-k passage ids (checked: `results_match`). The Python path pads every batch to its
encoder batch (64 rows); the SavedModel encodes exactly the rows it gets.

    .venv/bin/python benchmarks/bench_export.py [--pages 200 --batches 1,8,32 --repeats 20]
Writes benchmarks/results/export.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

ORIGINAL_BLAS_ENV = common.reexec_without_env()

import numpy as np  # noqa: E402


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=200, help="synthetic KB pages (~2 passages each)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated query batch sizes")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/export.json)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]

    import tensorflow as tf

    from t5_retrieval.data import layout
    from t5_retrieval.data.records import read_examples
    from t5_retrieval.data.stores.kb import PassageStore
    from t5_retrieval.export.savedmodel import export_savedmodel
    from t5_retrieval.retrieval.index import load_index
    from t5_retrieval.retrieval.search import dense_searcher
    from tests.tiny_model import build_tiny_run

    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        run = build_tiny_run(tmp, num_pages=args.pages)
        encoder, index = run.encoders[0], load_index(run.index_dirs[0])
        store = PassageStore.open(layout.kb_dir(run.data_dir))
        savedmodel = os.path.join(tmp, "serving", "1")
        start = time.perf_counter()
        export_savedmodel(encoder, run.index_dirs[0], store, savedmodel)
        export_s = time.perf_counter() - start
        size = {"total_bytes": _dir_bytes(savedmodel),
                "variables_bytes": _dir_bytes(os.path.join(savedmodel, "variables")),
                "assets_bytes": _dir_bytes(os.path.join(savedmodel, "assets")),
                "saved_model_pb_bytes": os.path.getsize(os.path.join(savedmodel, "saved_model.pb"))}
        start = time.perf_counter()
        search = tf.saved_model.load(savedmodel).signatures["search"]
        load_s = time.perf_counter() - start

        task = "demo_fever"
        python_path = dense_searcher(encoder, index, task)
        pool = [e.query for e in read_examples(layout.examples_path(run.data_dir, "fever", "dev"))]
        by_batch = {}
        for size_ in batches:
            queries = [pool[i % len(pool)] for i in range(size_)]
            inputs = {"query": tf.constant(queries), "task": tf.constant([task] * size_), "k": tf.constant(args.k)}
            start = time.perf_counter()
            served = search(**inputs)  # the first call also builds the ScaNN searcher and compiles
            first_call_s = time.perf_counter() - start
            python = python_path.search(queries, args.k)
            served_ids = served["passage_ids"].numpy().astype(str).tolist()
            match = served_ids == [pids for pids, _ in python]
            max_score_diff = float(np.max(np.abs(served["scores"].numpy() - np.stack([s for _, s in python]))))
            times = common.interleaved_times({
                "savedmodel": lambda inputs=inputs: search(**inputs)["scores"].numpy(),
                "python": lambda queries=queries: python_path.search(queries, args.k)}, args.repeats)
            by_batch[str(size_)] = {"savedmodel": common.summarize(times["savedmodel"]),
                                    "python": common.summarize(times["python"]),
                                    "savedmodel_speedup": common.speedup(times, "savedmodel", "python"),
                                    "savedmodel_first_call_s": first_call_s,
                                    "results_match": match, "max_abs_score_diff": max_score_diff}

    result = {"passages": len(index), "dim": encoder.dim, "k": args.k, "query_len": encoder.features["query_len"],
              "index_mode": index.config.mode, "export_s": export_s, "load_s": load_s, "savedmodel_size": size,
              "by_batch": by_batch, "machine": common.machine_info(blas_env_at_start=ORIGINAL_BLAS_ENV)}
    ratios = ", ".join(f"b={b}: {r['savedmodel']['median_s'] * 1e3:.1f} ms vs {r['python']['median_s'] * 1e3:.1f} ms "
                       f"(x{r['savedmodel_speedup']['ratio_of_medians']:.2f})" for b, r in by_batch.items())
    matched = all(r["results_match"] for r in by_batch.values())
    common.write_results("export", result, f"{len(index)} passages, SavedModel vs Python search per batch: {ratios}; "
                         f"same top-{args.k}: {matched}; export {export_s:.1f} s, {size['total_bytes'] / 1e6:.2f} MB",
                         args.out)
    return 0 if matched else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
