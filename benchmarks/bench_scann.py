"""ScaNN vs exact search vs FAISS (HNSW, IVF-Flat) for maximum inner product search.

Data: clustered float32 vectors shaped like dense-retrieval embeddings (768-d; many topical
clusters, a shared anisotropic low-rank component, varying norms), queries drawn the same way.
Every method answers the same queries in batch with the same 2 cores; recall@100 is measured
against exact top-100, and QPS is compared with exact search timed in the same run.

Each approximate method is swept over its search-time knobs (ScaNN: leaves searched x exact
reordering depth; HNSW: efSearch; IVF: nprobe); the summary reports, per method, the fastest
setting reaching the recall target. ScaNN uses sqrt(n) leaves and 4 dims per AH block.
Targets: ScaNN recall@100 >= 0.95 at >= 5x the QPS of exact search, and ahead of HNSW there.

    .venv/bin/python benchmarks/bench_scann.py              # default: 200k x 768 (~10 min on 2 cores)
    .venv/bin/python benchmarks/bench_scann.py --full       # 1M x 768 (3 GB of float32)
Writes benchmarks/results/scann.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

K = 100
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def make_data(n: int, dim: int, n_queries: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Embedding-like vectors with graded similarity: a point sits in a sub-topic (~50 points) of a
    topic (~500) of a domain (~5000); it is the sum of the three centers (weights 0.6, 0.6, 0.5),
    a shared 16-d anisotropic component, variation in a 96-d subspace and a little isotropic noise,
    with norms spread +-20%. A query's top-100 is then its sub-topic plus the closest of its topic:
    graded like real dense-retrieval neighbourhoods, not one isolated blob."""
    rng = np.random.default_rng(seed)

    def unit(shape: tuple[int, ...]) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    n_sub = max(1, n // 50)
    n_topic, n_domain = max(1, n_sub // 10), max(1, n_sub // 100)
    topic_of_sub = rng.integers(0, n_topic, n_sub)
    domain_of_topic = rng.integers(0, n_domain, n_topic)
    subs = (0.6 * unit((n_domain, dim))[domain_of_topic[topic_of_sub]] + 0.6 * unit((n_topic, dim))[topic_of_sub]
            + 0.5 * unit((n_sub, dim))).astype(np.float32)
    shared, local = unit((16, dim)), unit((96, dim))

    def draw(m: int) -> np.ndarray:
        out = np.empty((m, dim), np.float32)
        for start in range(0, m, 50_000):
            rows = min(start + 50_000, m) - start
            x = subs[rng.integers(0, n_sub, rows)].copy()
            x += 0.3 / 4 * rng.standard_normal((rows, 16), dtype=np.float32) @ shared
            x += 0.4 / np.sqrt(96) * rng.standard_normal((rows, 96), dtype=np.float32) @ local
            x += 0.1 / np.sqrt(dim) * rng.standard_normal((rows, dim), dtype=np.float32)
            x *= (rng.uniform(0.8, 1.2, (rows, 1)) / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
            out[start:start + rows] = x
        return out

    return draw(n), draw(n_queries)


def exact_search(db: np.ndarray, queries: np.ndarray, k: int, batch: int = 256) -> np.ndarray:
    out = np.empty((len(queries), k), np.int64)
    for start in range(0, len(queries), batch):
        scores = queries[start:start + batch] @ db.T
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1)
        out[start:start + batch] = np.take_along_axis(top, order, axis=1)
    return out


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(f.tolist()) & set(t.tolist())) / truth.shape[1] for f, t in zip(found, truth)]))


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def bench_scann(db, queries, truth, args) -> list[dict]:
    from scann.scann_ops.py import scann_ops_pybind

    n = len(db)
    leaves = args.scann_leaves or int(np.sqrt(n))
    build_s, searcher = timed(lambda: scann_ops_pybind.builder(db, K, "dot_product")
                              .tree(num_leaves=leaves, num_leaves_to_search=leaves // 20,
                                    training_sample_size=min(n, 50_000), random_init=False)  # as `t5r index`
                              .score_ah(args.scann_dims_per_block, anisotropic_quantization_threshold=0.2,
                                        training_sample_size=min(n, 50_000))
                              .reorder(max(args.scann_reorder)).build())
    rows = []
    for reorder in args.scann_reorder:
        for to_search in args.scann_search:
            to_search = min(to_search, leaves)
            search = functools.partial(searcher.search_batched_parallel, queries, final_num_neighbors=K,
                                       pre_reorder_num_neighbors=max(reorder, K), leaves_to_search=to_search)
            seconds, (found, _) = timed(search, repeats=2)
            rows.append({"method": "scann", "setting": f"leaves {to_search}/{leaves}, reorder {reorder}",
                         "recall": recall(np.asarray(found), truth), "qps": len(queries) / seconds,
                         "build_s": build_s})
            print(f"  scann leaves={to_search} reorder={reorder} (build {build_s:.0f}s): "
                  f"recall {rows[-1]['recall']:.4f} qps {rows[-1]['qps']:.0f}", flush=True)
    del searcher
    return rows


def bench_hnsw(db, queries, truth, args) -> list[dict]:
    import faiss

    index = faiss.IndexHNSWFlat(db.shape[1], args.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = args.hnsw_ef_construction
    build_s, _ = timed(lambda: index.add(db))
    rows = []
    for ef in args.hnsw_ef:
        index.hnsw.efSearch = max(ef, K)
        seconds, (_, found) = timed(lambda: index.search(queries, K), repeats=2)
        rows.append({"method": "faiss_hnsw", "setting": f"M {args.hnsw_m}, efSearch {max(ef, K)}",
                     "recall": recall(found, truth), "qps": len(queries) / seconds, "build_s": build_s})
        print(f"  hnsw ef={ef} (build {build_s:.0f}s): recall {rows[-1]['recall']:.4f} qps {rows[-1]['qps']:.0f}", flush=True)
    return rows


def bench_ivf(db, queries, truth, args) -> list[dict]:
    import faiss

    nlist = int(4 * np.sqrt(len(db)))
    quantizer = faiss.IndexFlatIP(db.shape[1])
    index = faiss.IndexIVFFlat(quantizer, db.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    sample = db[np.random.default_rng(1).choice(len(db), min(len(db), 50 * nlist), replace=False)]
    build_s, _ = timed(lambda: (index.train(sample), index.add(db)))
    rows = []
    for nprobe in args.ivf_nprobe:
        index.nprobe = nprobe
        seconds, (_, found) = timed(lambda: index.search(queries, K), repeats=2)
        rows.append({"method": "faiss_ivf_flat", "setting": f"nlist {nlist}, nprobe {nprobe}",
                     "recall": recall(found, truth), "qps": len(queries) / seconds, "build_s": build_s})
        print(f"  ivf nprobe={nprobe} (build {build_s:.0f}s): recall {rows[-1]['recall']:.4f} "
              f"qps {rows[-1]['qps']:.0f}", flush=True)
    return rows


def best_at(rows: list[dict], method: str, target: float) -> dict | None:
    ok = [r for r in rows if r["method"] == method and r["recall"] >= target]
    return max(ok, key=lambda r: r["qps"]) if ok else None


def summarize(rows: list[dict], target: float) -> dict:
    """Best setting per method at the recall target, and ScaNN vs HNSW at HNSW's own recall."""
    exact = next(r for r in rows if r["method"] == "exact_numpy")
    best = {}
    for method in ("scann", "faiss_hnsw", "faiss_ivf_flat"):
        b = best_at(rows, method, target)
        best[method] = None if b is None else {**b, "speedup_vs_exact": b["qps"] / exact["qps"]}
    scann, hnsw = best["scann"], best["faiss_hnsw"]
    # Equal recall: the fastest ScaNN setting at least as accurate as HNSW's best setting above.
    scann_at_hnsw = best_at(rows, "scann", hnsw["recall"]) if hnsw else None
    return {
        "target_recall": target, "exact_qps": exact["qps"], "best_at_target": best,
        "scann_at_hnsw_recall": scann_at_hnsw,
        "targets_met": {
            "scann_recall_and_5x_exact": bool(scann and scann["speedup_vs_exact"] >= 5),
            "scann_ahead_of_hnsw_at_equal_recall": bool(
                scann and (hnsw is None or (scann_at_hnsw and scann_at_hnsw["qps"] > hnsw["qps"]))),
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200_000)
    parser.add_argument("--full", action="store_true", help="1M x 768 (overrides --n)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--target", type=float, default=0.95, help="recall@100 target")
    parser.add_argument("--scann_leaves", type=int, default=None, help="default sqrt(n)")
    parser.add_argument("--scann_search", type=int, nargs="+", default=[2, 5, 10, 20])
    parser.add_argument("--scann_reorder", type=int, nargs="+", default=[200, 300, 500])
    parser.add_argument("--scann_dims_per_block", type=int, default=4)
    parser.add_argument("--hnsw_m", type=int, default=32)
    parser.add_argument("--hnsw_ef_construction", type=int, default=64)
    parser.add_argument("--hnsw_ef", type=int, nargs="+", default=[100, 200, 400, 800])
    parser.add_argument("--ivf_nprobe", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--skip", nargs="*", default=[], choices=["scann", "hnsw", "ivf"])
    args = parser.parse_args(argv)
    n = 1_000_000 if args.full else args.n

    start = time.perf_counter()
    db, queries = make_data(n, args.dim, args.queries)
    print(f"data: {n} x {args.dim} float32 ({db.nbytes / 2**30:.2f} GiB), {len(queries)} queries, "
          f"{time.perf_counter() - start:.0f}s", flush=True)
    exact_s, truth = timed(lambda: exact_search(db, queries, K), repeats=2)
    exact = {"method": "exact_numpy", "setting": "batched matmul + argpartition", "recall": 1.0,
             "qps": len(queries) / exact_s, "build_s": 0.0}
    print(f"  exact: qps {exact['qps']:.0f}", flush=True)
    rows = [exact]
    if "scann" not in args.skip:
        rows += bench_scann(db, queries, truth, args)
    if "hnsw" not in args.skip:
        rows += bench_hnsw(db, queries, truth, args)
    if "ivf" not in args.skip:
        rows += bench_ivf(db, queries, truth, args)

    result = {"n": n, "dim": args.dim, "queries": len(queries), "k": K, "full_size": n == 1_000_000,
              "cores": os.cpu_count(), "rows": rows, **summarize(rows, args.target),
              "total_s": time.perf_counter() - start}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "scann.json"), "w") as f:
        json.dump(result, f, indent=1)

    def describe(name: str, best: dict | None) -> str:
        return f"{name} none>={args.target}" if best is None else \
            f"{name} {best['qps']:.0f} qps (x{best['speedup_vs_exact']:.1f}, R@100 {best['recall']:.3f})"

    size = "full size" if n == 1_000_000 else "reduced size; --full for 1M"
    best, equal = result["best_at_target"], result["scann_at_hnsw_recall"]
    print(f"bench_scann: {n}x{args.dim} ({size}); exact {exact['qps']:.0f} qps; "
          + "; ".join(describe(m, best[m]) for m in best)
          + (f"; scann at hnsw's recall: {equal['qps']:.0f} qps (R@100 {equal['recall']:.3f})" if equal else "")
          + f"; targets {result['targets_met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
