"""Bounded load test of `t5r serve` on loopback: QPS, p50/p99 latency, error count.

Builds a synthetic passage store, embeds it with the hashed bag-of-words encoder, indexes it, starts
the real CLI (`python -m t5_retrieval.cli serve --port 0`) as a subprocess, and drives it with
`--clients` keep-alive HTTP clients until `--requests` requests are done or `--max_seconds` pass.
A `GET /health` round trip, timed in the same run, is the reference for the search overhead.

    .venv/bin/python benchmarks/bench_server.py [--passages 20000 --requests 2000 --clients 4]
Writes benchmarks/results/server.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

from t5_retrieval.data.kb import write_passage_store  # noqa: E402
from t5_retrieval.data.records import Passage  # noqa: E402
from t5_retrieval.data import embedding_store
from t5_retrieval.retrieval import index  # noqa: E402
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder  # noqa: E402

VOCAB = [f"w{i}" for i in range(5000)]


def synthetic_passages(n: int, seed: int = 0) -> list[Passage]:
    rng = np.random.default_rng(seed)
    words = rng.zipf(1.3, size=(n, 60)) % len(VOCAB)
    return [Passage(f"p{i}", f"page{i // 3}", f"Page {i // 3}", " ".join(VOCAB[w] for w in row))
            for i, row in enumerate(words)]


def start_server(kb_dir: str, index_dir: str, dim: int) -> tuple[subprocess.Popen, str, int]:
    cmd = [sys.executable, "-m", "t5_retrieval.cli", "serve", "--lexical_baseline_dim", str(dim),
           "--index_dir", index_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("t5r serve: http://"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    host, port = line.split("http://")[1].split("/")[0].split(":")
    return proc, host, int(port)


def load(host: str, port: int, method: str, path: str, bodies: list[bytes], clients: int, max_seconds: float):
    """Sends bodies round-robin from `clients` threads; returns latencies (s), errors, wall seconds."""
    latencies: list[float] = []
    errors: list[str] = []
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()
    deadline = time.perf_counter() + max_seconds

    def worker() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        while time.perf_counter() < deadline:
            with lock:
                i = next(next_index, None)
            if i is None:
                break
            start = time.perf_counter()
            error = None
            try:
                headers = {"Content-Type": "application/json"} if method == "POST" else {}
                conn.request(method, path, body=bodies[i] if method == "POST" else None, headers=headers)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    error = f"HTTP {response.status}"
            except (OSError, http.client.HTTPException) as e:
                error = type(e).__name__
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=30)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if error is not None:
                    errors.append(error)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors, time.perf_counter() - start


def stats(latencies: list[float], errors: list[str], wall: float) -> dict:
    ms = np.asarray(latencies) * 1000
    return {"requests": len(latencies), "errors": len(errors), "seconds": wall, "qps": len(latencies) / wall,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--max_seconds", type=float, default=60.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        passages = synthetic_passages(args.passages)
        kb_dir, emb_dir, index_dir = (os.path.join(tmp, d) for d in ("kb", "emb", "idx"))
        write_passage_store(((p, None) for p in passages), kb_dir)
        encoder = HashedBagOfWordsEncoder(args.dim)
        embedding_store.write_embeddings(encoder, passages, [p.id for p in passages], emb_dir, progress=False)
        index.build_index(emb_dir).save(index_dir)

        rng = np.random.default_rng(1)
        bodies = [json.dumps({"task": "nq", "k": args.k, "query": " ".join(
            VOCAB[w] for w in rng.zipf(1.3, size=8) % len(VOCAB))}).encode() for _ in range(args.requests)]
        proc, host, port = start_server(kb_dir, index_dir, args.dim)
        try:
            health = stats(*load(host, port, "GET", "/health", bodies, args.clients, args.max_seconds))
            search = stats(*load(host, port, "POST", "/search", bodies, args.clients, args.max_seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    result = {"passages": args.passages, "dim": args.dim, "clients": args.clients, "k": args.k,
              "search": search, "health_reference": health,
              "search_vs_health_qps": search["qps"] / health["qps"], "zero_errors": search["errors"] == 0}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "server.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"bench_server: {search['requests']} searches over {args.passages} passages with {args.clients} clients: "
          f"{search['qps']:.0f} qps, p50 {search['p50_ms']:.1f} ms, p99 {search['p99_ms']:.1f} ms, "
          f"{search['errors']} errors (GET /health: {health['qps']:.0f} qps)")
    return 0 if search["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
