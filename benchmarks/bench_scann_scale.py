"""ScaNN at 1M x 768 and its projection to full KILT (~36M passages): memory per vector, build time,
recall@100 and QPS for the index layouts that could fit 36M vectors in 16 GB of RAM.

Data: `bench_scann.make_data` (clustered, anisotropic, embedding-like 768-d vectors), 1,000 queries,
exact top-100 by brute force as the truth. Layouts (all: a tree of sqrt(n) leaves, then asymmetric
hashing (AH) over blocks of `dims_per_block` dimensions, 16 centres (4-bit codes) per block unless
named `-256`):

  - AH 4 dims/block + exact reordering of the candidates from float32, bfloat16 or int8 copies;
  - AH 2 or 1 dims/block and no reordering copy (the codes are all that is kept);
  - AH with 256 centres per block (8-bit codes, `-256`), 4 or 2 dims/block, no reordering copy.

Memory per vector is measured twice, each layout built in a fresh process: the resident set the
searcher holds (RSS after the build with the input matrix freed, minus RSS before loading it) and
the serialized searcher's bytes (what a server loads from disk; ScaNN stores AH codes a byte each,
in RAM two to a byte). The projection to 36M is resident bytes/vector x 36M; the summary names the
cheapest layout reaching recall@100 >= `--target` within `--budget_gb` at that scale.

    .venv/bin/python benchmarks/bench_scann_scale.py [--n 1000000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
from bench_scann import K, exact_search, make_data, recall

FULL_KILT_PASSAGES = 36_000_000
LAYOUTS = {  # name: (dims per AH block, centres per block (AH hash type), reorder copy or None)
    "ah4+float32": (4, "lut16", "FLOAT32"),
    "ah4+bfloat16": (4, "lut16", "BFLOAT16"),
    "ah4+int8": (4, "lut16", "INT8"),
    "ah2": (2, "lut16", None),
    "ah1": (1, "lut16", None),
    "ah4-256": (4, "lut256", None),
    "ah2-256": (2, "lut256", None),
}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def build(db: np.ndarray, dims_per_block: int, hash_type: str, reorder: str | None, leaves: int):
    from scann.scann_ops.py import scann_ops_pybind
    from scann.scann_ops.py.scann_builder import ReorderType

    n = len(db)
    builder = (scann_ops_pybind.builder(db, K, "dot_product")
               .tree(num_leaves=leaves, num_leaves_to_search=max(1, leaves // 50), training_sample_size=min(n, 100_000),
                     random_init=False)  # k-means++ centres, as `t5r index` builds
               .score_ah(dims_per_block, anisotropic_quantization_threshold=0.2, training_sample_size=min(n, 100_000),
                         hash_type=hash_type))
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


def run_layout(name: str, data: str, to_search: list[int], depths: list[int]) -> dict:
    """One layout in this (fresh) process: build, resident and serialized size, the search sweep."""
    dims_per_block, hash_type, reorder = LAYOUTS[name]
    from scann.scann_ops.py import scann_ops_pybind  # noqa: F401  (resident before the baseline)

    baseline = rss_bytes()
    db = np.load(os.path.join(data, "db.npy"))
    queries, truth = np.load(os.path.join(data, "queries.npy")), np.load(os.path.join(data, "truth.npy"))
    n, leaves = len(db), int(np.sqrt(len(db)))
    start = time.perf_counter()
    searcher = build(db, dims_per_block, hash_type, reorder, leaves)
    build_seconds = time.perf_counter() - start
    del db
    gc.collect()
    resident = rss_bytes() - baseline - queries.nbytes - truth.nbytes
    path = os.path.join(data, f"searcher-{name}")
    os.makedirs(path)
    searcher.serialize(path)
    stored = directory_bytes(path)
    shutil.rmtree(path)
    rows = sweep(searcher, queries, truth, leaves, reorder is not None, to_search, depths)
    return {"dims_per_block": dims_per_block, "hash_type": hash_type, "reorder": reorder, "build_seconds": build_seconds,
            "resident_bytes_per_vector": resident / n, "serialized_bytes_per_vector": stored / n, "sweep": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--layouts", nargs="+", default=[k for k in LAYOUTS if k != "ah2-256"], choices=list(LAYOUTS),
                        help="default: all but ah2-256, whose AH training outgrew 24 GB of RAM at 1M")
    parser.add_argument("--leaves_to_search", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--reorder_depths", type=int, nargs="+", default=[200, 500])
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--budget_gb", type=float, default=16.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_layout(args.child, args.data, args.leaves_to_search, args.reorder_depths)))
        return

    start = time.perf_counter()
    db, queries = make_data(args.n, args.dim, args.queries)
    truth = exact_search(db, queries, K)
    data_seconds = time.perf_counter() - start
    leaves = int(np.sqrt(args.n))
    results = {}
    tmp = tempfile.mkdtemp(prefix="bench_scann_scale_")
    try:
        for name, array in (("db", db), ("queries", queries), ("truth", truth)):
            np.save(os.path.join(tmp, f"{name}.npy"), array)
        del db
        for name in args.layouts:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--data", tmp,
                                    "--leaves_to_search", *map(str, args.leaves_to_search),
                                    "--reorder_depths", *map(str, args.reorder_depths)],
                                   capture_output=True, text=True)
            if proc.returncode != 0:  # e.g. killed for memory: recorded, the other layouts still run
                results[name] = {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
                print(f"  {name}: failed (exit {proc.returncode})", file=sys.stderr, flush=True)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["projected_gb_at_full_kilt"] = r["resident_bytes_per_vector"] * FULL_KILT_PASSAGES / 1e9
            results[name] = r
            best = max(r["sweep"], key=lambda row: (row["recall"], row["qps"]))
            print(f"  {name}: build {r['build_seconds']:.0f} s, {r['resident_bytes_per_vector']:.0f} B/vector resident "
                  f"({r['projected_gb_at_full_kilt']:.1f} GB at 36M), {r['serialized_bytes_per_vector']:.0f} B/vector "
                  f"serialized; best recall {best['recall']:.4f} at {best['qps']:.0f} QPS", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    fitting = []
    for name, r in results.items():
        for row in r.get("sweep", ()):
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
                       for k, v in results.items() if "sweep" in v))
    else:
        summary = (f"ScaNN {args.n:,} x {args.dim}: {choice[2]} reaches recall@100 {choice[3]['recall']:.3f} at "
                   f"{-choice[1]:.0f} QPS (leaves {choice[3]['leaves_to_search']}/{leaves}), "
                   f"{results[choice[2]]['resident_bytes_per_vector']:.0f} B/vector resident -> {choice[0]:.1f} GB at "
                   "36M passages")
    common.write_results("scann_scale", result, summary, args.out)


if __name__ == "__main__":
    main()
