"""ScaNN at 1M x 768 and its projection to full KILT (~36M passages): memory per vector, build time,
recall@100 and QPS for the index layouts that could fit 36M vectors in 16 GB of RAM.

Data: `bench_scann.make_data` (clustered, anisotropic, embedding-like 768-d vectors), 1,000 queries,
exact top-100 by brute force as the truth. Layouts (all: a tree of sqrt(n) leaves, then asymmetric
hashing (AH) with 16 centres per block of `dims_per_block` dimensions, 4 bits per block):

  - AH 4 dims/block + exact reordering of the candidates from float32, bfloat16 or int8 copies;
  - AH 2 or 1 dims/block and no reordering copy (the codes are all that is kept).

Memory per vector is measured twice: the serialized searcher's bytes / n (what a server loads) and
the process's resident-set growth over the build (what the build holds). The projection to 36M is
bytes/vector x 36M; the summary names the cheapest layout reaching recall@100 >= `--target` within
`--budget_gb` at that scale.

    .venv/bin/python benchmarks/bench_scann_scale.py [--n 1000000]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from bench_scann import K, exact_search, make_data, recall  # noqa: E402

FULL_KILT_PASSAGES = 36_000_000
LAYOUTS = {  # name: (dims per AH block, reorder copy or None)
    "ah4+float32": (4, "FLOAT32"),
    "ah4+bfloat16": (4, "BFLOAT16"),
    "ah4+int8": (4, "INT8"),
    "ah2": (2, None),
    "ah1": (1, None),
}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def build(db: np.ndarray, dims_per_block: int, reorder: str | None, leaves: int):
    from scann.scann_ops.py import scann_ops_pybind
    from scann.scann_ops.py.scann_builder import ReorderType

    n = len(db)
    builder = (scann_ops_pybind.builder(db, K, "dot_product")
               .tree(num_leaves=leaves, num_leaves_to_search=max(1, leaves // 50), training_sample_size=min(n, 100_000))
               .score_ah(dims_per_block, anisotropic_quantization_threshold=0.2, training_sample_size=min(n, 100_000)))
    if reorder is not None:
        builder = builder.reorder(500, quantize=getattr(ReorderType, reorder))
    return builder.build()


def sweep(searcher, queries: np.ndarray, truth: np.ndarray, leaves: int, reorder: bool,
          to_search: list[int], depths: list[int]) -> list[dict]:
    rows = []
    for leaves_to_search in to_search:
        for depth in depths if reorder else [K]:
            kwargs = {"pre_reorder_num_neighbors": depth} if reorder else {}
            best = float("inf")
            for _ in range(2):
                start = time.perf_counter()
                found, _ = searcher.search_batched_parallel(queries, final_num_neighbors=K,
                                                            leaves_to_search=min(leaves_to_search, leaves), **kwargs)
                best = min(best, time.perf_counter() - start)
            rows.append({"leaves_to_search": leaves_to_search, "reorder_depth": depth if reorder else None,
                         "recall": recall(np.asarray(found), truth), "qps": len(queries) / best})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--leaves_to_search", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--reorder_depths", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--budget_gb", type=float, default=16.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    start = time.perf_counter()
    db, queries = make_data(args.n, args.dim, args.queries)
    truth = exact_search(db, queries, K)
    data_seconds = time.perf_counter() - start
    leaves = int(np.sqrt(args.n))
    results = {}
    tmp = tempfile.mkdtemp(prefix="bench_scann_scale_")
    try:
        for name in args.layouts:
            dims_per_block, reorder = LAYOUTS[name]
            gc.collect()
            before = rss_bytes()
            t0 = time.perf_counter()
            searcher = build(db, dims_per_block, reorder, leaves)
            build_seconds = time.perf_counter() - t0
            grown = rss_bytes() - before
            path = os.path.join(tmp, name)
            os.makedirs(path)
            searcher.serialize(path)
            stored = directory_bytes(path)
            shutil.rmtree(path)
            rows = sweep(searcher, queries, truth, leaves, reorder is not None, args.leaves_to_search,
                         args.reorder_depths)
            del searcher
            per_vector = stored / args.n
            results[name] = {"dims_per_block": dims_per_block, "reorder": reorder, "build_seconds": build_seconds,
                             "rss_growth_bytes": grown, "serialized_bytes": stored,
                             "bytes_per_vector": per_vector,
                             "projected_gb_at_full_kilt": per_vector * FULL_KILT_PASSAGES / 1e9, "sweep": rows}
            best = max(rows, key=lambda r: r["recall"])
            print(f"  {name}: build {build_seconds:.0f} s, {per_vector:.0f} B/vector "
                  f"({results[name]['projected_gb_at_full_kilt']:.1f} GB at 36M), best recall {best['recall']:.4f} "
                  f"at {best['qps']:.0f} QPS", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    fitting = []
    for name, r in results.items():
        for row in r["sweep"]:
            if row["recall"] >= args.target and r["projected_gb_at_full_kilt"] <= args.budget_gb:
                fitting.append((r["projected_gb_at_full_kilt"], -row["qps"], name, row))
    choice = min(fitting, key=lambda x: (x[0], x[1])) if fitting else None
    result = {"n": args.n, "dim": args.dim, "queries": args.queries, "leaves": leaves, "data_seconds": data_seconds,
              "layouts": results, "target_recall": args.target, "budget_gb": args.budget_gb,
              "choice": None if choice is None else {"layout": choice[2], **choice[3],
                                                     "projected_gb_at_full_kilt": choice[0]},
              "machine": common.machine_info(cpu=common.cpu_model())}
    if choice is None:
        summary = (f"ScaNN {args.n:,} x {args.dim}: no layout reaches recall@100 >= {args.target} within "
                   f"{args.budget_gb:.0f} GB at 36M; " + "; ".join(
                       f"{k} {v['projected_gb_at_full_kilt']:.1f} GB, recall {max(r['recall'] for r in v['sweep']):.3f}"
                       for k, v in results.items()))
    else:
        summary = (f"ScaNN {args.n:,} x {args.dim}: {choice[2]} reaches recall@100 {choice[3]['recall']:.3f} at "
                   f"{-choice[1]:.0f} QPS (leaves {choice[3]['leaves_to_search']}/{leaves}), "
                   f"{results[choice[2]]['bytes_per_vector']:.0f} B/vector -> {choice[0]:.1f} GB at 36M passages")
    common.write_results("scann_scale", result, summary, args.out)


if __name__ == "__main__":
    main()
