"""Bounded load test of `t5r serve` on loopback: QPS, p50/p99 latency and errors under load, with
stalled connections open, with one client holding over a thousand sockets, with groups of addresses
holding connections or slow bodies, and with many large bodies.

Builds a synthetic passage store, embeds it with the hashed bag-of-words encoder, indexes it, starts
the real CLI (`python -m t5_retrieval.cli serve --port 0`) as a subprocess, and drives it with 1, 20
and 100 keep-alive HTTP clients (`--clients`, from 127.0.0.1), each level until `--requests` requests
are done or `--max_seconds` pass. Then, each time while 20 clients search from 127.0.0.1:
- `--stalled` connections that send nothing or half a request, from several loopback addresses
  (100 each); the server's threads are counted meanwhile (a thread per connection would show here);
- `--hog_sockets` idle connections from one address of another /24, 127.0.3.2: the server keeps its
  range's share and refuses the rest (503), and the other clients must see no error;
- a connection group: `--group_addresses` addresses, each in a /24 of its own, open
  `--group_sockets` idle connections each and reopen every one the server closes (0.2 s later),
  together more than `--max_connections`: the other clients must see no error;
- a slow-body group: 8 addresses (8 /24s) x 8 connections that declare a 1 MiB body, send one byte
  of it and wait, reopened when closed: the other clients' searches must see no 503.
Then, twice, `--large_bodies` searches with 1 MiB bodies from 8 addresses, all at once, sampling
the server's resident memory before, at its peak and after. Then a cost flood: `--flood_addresses`
addresses (a /24 each) x `--flood_clients` keep-alive clients, each sending the most expensive valid
search (64 queries of 4,096 characters, k=100) again as soon as it is answered, while 20 clients of
20 other /24s search, then 20 clients of one /24. Last, descriptor exhaustion: a fresh server
under RLIMIT_NOFILE `--descriptors` (1024, as `ulimit -n` often is), and a group of
`--exhaust_addresses` x `--exhaust_sockets` idle connections (more than the limit), reopened as
they are closed, while the 20 clients search; then /health, and the server's log lines. A
`GET /health` round trip is the reference for the search overhead.

    .venv/bin/python benchmarks/bench_server.py [--passages 10000 --requests 300 --clients 1 20 100 --stalled 400
                                                 --hog_sockets 1025 --group_addresses 9 --group_sockets 128
                                                 --large_bodies 800 --flood_addresses 9 --flood_clients 20
                                                 --descriptors 1024 --exhaust_addresses 14 --exhaust_sockets 100]
Writes benchmarks/results/server.json and prints one summary line.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import http.client
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

import common
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
STALLED_CLIENTS = 20  # clients searching while the stalled connections (or the hog's) are open
PER_ADDRESS = 100  # stalled connections per loopback source address (one /24 each)
HOG_ADDRESS = "127.0.3.2"  # not in 127.0.0.0/24, the searching clients' range
BODY_BYTES = (1 << 20) - 1  # ServeLimits.max_body_bytes is 1 MiB
BODY_ADDRESSES = 8
SLOW_BODY_ADDRESSES, SLOW_BODY_SOCKETS = 8, 8  # the slow-body group
REOPEN_S = 0.2  # a group reopens a connection the server closed this long after
MAX_QUERIES, MAX_QUERY_CHARS, MAX_K = 64, 4096, 100  # ServeLimits' defaults: the most a valid search may cost

from t5_retrieval.data.records import Passage  # noqa: E402
from t5_retrieval.data.stores import embedding_store  # noqa: E402
from t5_retrieval.data.stores.kb import write_passage_store  # noqa: E402
from t5_retrieval.retrieval import index  # noqa: E402
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder  # noqa: E402

VOCAB = [f"w{i}" for i in range(5000)]


def synthetic_passages(n: int, seed: int = 0) -> list[Passage]:
    rng = np.random.default_rng(seed)
    words = rng.zipf(1.3, size=(n, 60)) % len(VOCAB)
    return [Passage(f"p{i}", f"page{i // 3}", f"Page {i // 3}", " ".join(VOCAB[w] for w in row))
            for i, row in enumerate(words)]


def start_server(kb_dir: str, index_dir: str, dim: int, read_timeout_s: float, descriptors: int | None = None,
                 log: IO[str] | None = None) -> tuple[subprocess.Popen, str, int]:
    """The CLI serving on a free port; with `descriptors`, under that RLIMIT_NOFILE (soft and hard),
    its log to `log`."""
    cmd = [sys.executable, "-m", "t5_retrieval.cli", "serve", "--lexical_baseline_dim", str(dim),
           "--index_dir", index_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0",
           "--read_timeout_s", str(read_timeout_s)]
    limit = None if descriptors is None else functools.partial(
        resource.setrlimit, resource.RLIMIT_NOFILE, (descriptors, descriptors))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL, text=True,
                            preexec_fn=limit)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("t5r serve: http://"):
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}")
    host, port = line.split("http://")[1].split("/")[0].split(":")
    return proc, host, int(port)


def load(host: str, port: int, method: str, path: str, bodies: list[bytes], clients: int, max_seconds: float,
         sources: list[str] | None = None):
    """Sends bodies round-robin from `clients` threads (client i from address `sources[i]`, else
    127.0.0.1); returns latencies (s), errors, wall seconds."""
    latencies: list[float] = []
    errors: list[str] = []
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()
    deadline = time.perf_counter() + max_seconds

    def worker(source: str) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0))
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
                conn = http.client.HTTPConnection(host, port, timeout=30, source_address=(source, 0))
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                if error is not None:
                    errors.append(error)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(sources[i] if sources else "127.0.0.1",)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, errors, time.perf_counter() - start


def stats(latencies: list[float], errors: list[str], wall: float) -> dict:
    ms = np.asarray(latencies) * 1000
    return {"requests": len(latencies), "errors": len(errors), "error_kinds": sorted(set(errors)), "seconds": wall,
            "qps": len(latencies) / wall, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99))}


def open_stalled(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` connections, PER_ADDRESS from each of 127.0.1.1, 127.0.2.1, ... (a /24 each): half send
    nothing, half the head and part of the body of a POST."""
    half = (b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n"
            b"{\"task\": ")
    stalled = []
    for i in range(count):
        sock = socket.create_connection((host, port), timeout=30, source_address=(f"127.0.{i // PER_ADDRESS + 1}.1", 0))
        if i % 2:
            sock.sendall(half)
        stalled.append(sock)
    return stalled


def count_refused(socks: list[socket.socket], wait_s: float = 5.0) -> int:
    """How many of `socks` the server answered with 503 within `wait_s` seconds, all together."""
    deadline = time.monotonic() + wait_s
    count = 0
    for sock in socks:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            count += sock.recv(12).startswith(b"HTTP/1.1 503")
        except OSError:
            pass
    return count


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def large_bodies(host: str, port: int, count: int, pid: int) -> dict:
    """`count` searches with BODY_BYTES bodies from BODY_ADDRESSES addresses (a /24 each), all at once (a thread
    each): statuses, and the server's resident memory before, at its peak (sampled every 20 ms) and
    2 s after."""
    body = json.dumps({"task": "nq", "query": "w1 w2 w3", "k": 10}).encode().ljust(BODY_BYTES)
    head = (b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    statuses: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(count))
    before = rss_mib(pid)
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], rss_mib(pid))

    def worker() -> None:
        while (i := next(next_index, None)) is not None:
            try:
                with socket.create_connection((host, port), timeout=60,
                                              source_address=(f"127.0.{i % BODY_ADDRESSES + 40}.1", 0)) as sock:
                    sock.sendall(head + body)
                    status = sock.recv(12)[9:12].decode() or "closed"
            except OSError as e:
                status = type(e).__name__
            with lock:
                statuses.append(status)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    time.sleep(2)
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    return {"requests": count, "body_bytes": BODY_BYTES, "addresses": BODY_ADDRESSES, "statuses": counts,
            "seconds": wall, "rss_mib_before": before, "rss_mib_peak": peak[0], "rss_mib_after": rss_mib(pid)}


def hold_group(host: str, port: int, addresses: list[str], per_address: int, opening: bytes,
               stop: threading.Event, counts: dict[str, int]) -> None:
    """Holds `per_address` connections from each of `addresses`, each sending `opening` and then
    waiting; one the server closes (refusing it with 503, or at a deadline) is reopened REOPEN_S
    later, until `stop` is set. `counts`: connections opened, closed by the server, refused with 503."""
    selector = selectors.DefaultSelector()
    due = [(0.0, a) for a in addresses for _ in range(per_address)]  # a heap of (when, source address)
    while not stop.is_set():
        while due and due[0][0] <= time.monotonic():
            _, source = heapq.heappop(due)
            try:
                sock = socket.create_connection((host, port), timeout=5, source_address=(source, 0))
                sock.sendall(opening)
            except OSError:
                heapq.heappush(due, (time.monotonic() + REOPEN_S, source))
                continue
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, source)
            counts["opened"] += 1
        for key, _ in selector.select(timeout=0.05):
            try:
                reply = key.fileobj.recv(65536)
            except OSError:
                reply = b""
            counts["refused_503"] += reply.startswith(b"HTTP/1.1 503")
            counts["closed_by_server"] += 1
            selector.unregister(key.fileobj)
            key.fileobj.close()
            heapq.heappush(due, (time.monotonic() + REOPEN_S, key.data))
    counts["held_at_end"] = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    selector.close()


def under_group(host: str, port: int, addresses: list[str], per_address: int, opening: bytes,
                bodies: list[bytes], max_seconds: float) -> dict:
    """The searching clients' stats while a group (`hold_group`) holds what it can."""
    stop = threading.Event()
    counts = {"opened": 0, "closed_by_server": 0, "refused_503": 0}
    group = threading.Thread(target=hold_group, args=(host, port, addresses, per_address, opening, stop, counts))
    group.start()
    try:
        deadline = time.monotonic() + 10  # until the group has opened every connection once
        while counts["opened"] < len(addresses) * per_address and time.monotonic() < deadline:
            time.sleep(0.05)
        search = stats(*load(host, port, "POST", "/search", bodies, STALLED_CLIENTS, max_seconds))
    finally:
        stop.set()
        group.join()
    return {"addresses": addresses, "per_address": per_address, "group": counts, "other_clients": STALLED_CLIENTS,
            "search": search}


def max_cost_body(rng: np.random.Generator, queries: int = MAX_QUERIES, chars: int = MAX_QUERY_CHARS,
                  k: int = MAX_K) -> bytes:
    """The most expensive valid search ServeLimits allows: `queries` queries of `chars` characters
    (real words of the KB), `k` results each."""
    texts = [" ".join(VOCAB[w] for w in rng.integers(0, len(VOCAB), size=chars))[:chars].strip()
             for _ in range(queries)]
    return json.dumps({"task": "nq", "queries": texts, "k": k}).encode()


def cost_flood(host: str, port: int, addresses: list[str], per_address: int, body: bytes,
               stop: threading.Event, counts: dict[str, int]) -> None:
    """`per_address` keep-alive clients from each of `addresses`, each sending `body` again as soon
    as it is answered, until `stop` is set. `counts`: replies by status, and connection errors."""
    lock = threading.Lock()

    def client(source: str) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60, source_address=(source, 0))
        while not stop.is_set():
            try:
                conn.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                outcome = str(response.status)
            except (OSError, http.client.HTTPException) as e:
                outcome = type(e).__name__
                conn.close()
                conn = http.client.HTTPConnection(host, port, timeout=60, source_address=(source, 0))
                time.sleep(REOPEN_S)
            with lock:
                counts[outcome] = counts.get(outcome, 0) + 1
        conn.close()

    threads = [threading.Thread(target=client, args=(a,)) for a in addresses for _ in range(per_address)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def under_cost_flood(host: str, port: int, addresses: list[str], per_address: int, flood_body: bytes,
                     bodies: list[bytes], max_seconds: float) -> dict:
    """The searching clients' stats while `cost_flood` runs (after it has run for 2 s): first 20
    clients of 20 /24s of their own (127.0.100.1, 127.0.101.1, ...), then 20 clients of one /24
    (127.0.0.1), who share its one share of the workers."""
    stop = threading.Event()
    counts: dict[str, int] = {}
    flood = threading.Thread(target=cost_flood, args=(host, port, addresses, per_address, flood_body, stop, counts))
    flood.start()
    try:
        time.sleep(2)
        own_ranges = [f"127.0.{100 + i}.1" for i in range(STALLED_CLIENTS)]
        search = stats(*load(host, port, "POST", "/search", bodies, STALLED_CLIENTS, max_seconds, own_ranges))
        one_range = stats(*load(host, port, "POST", "/search", bodies, STALLED_CLIENTS, max_seconds))
    finally:
        stop.set()
        flood.join()
    return {"addresses": addresses, "per_address": per_address, "body_bytes": len(flood_body),
            "flood_replies": dict(sorted(counts.items())), "other_clients": STALLED_CLIENTS, "search": search,
            "search_from_one_range": one_range}


def descriptor_exhaustion(kb_dir: str, index_dir: str, dim: int, descriptors: int, addresses: list[str],
                          per_address: int, bodies: list[bytes], max_seconds: float) -> dict:
    """A fresh server under RLIMIT_NOFILE `descriptors`, a group holding more connections than that
    (`hold_group`, reopening what is closed), and the searching clients' stats meanwhile; the
    server's log lines and bytes, and /health after."""
    with tempfile.TemporaryFile("w+") as log:
        proc, host, port = start_server(kb_dir, index_dir, dim, read_timeout_s=4 * max_seconds,
                                        descriptors=descriptors, log=log)
        try:
            group = under_group(host, port, addresses, per_address, b"", bodies, max_seconds)
            health = stats(*load(host, port, "GET", "/health", bodies[:20], 1, max_seconds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        log.seek(0)
        lines = log.read().splitlines()
    return {"descriptors": descriptors, **group, "health_after": health, "server_log_lines": len(lines),
            "server_log_bytes": sum(len(line) + 1 for line in lines), "server_log_first": lines[:3]}


def still_open(sock: socket.socket) -> bool:
    """True if the server has neither closed nor answered this connection."""
    sock.setblocking(False)
    try:
        sock.recv(1)  # an answer (408, 503) or b"" (closed): not held open any more
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


def thread_count(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=300, help="searches per concurrency level")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 20, 100])
    parser.add_argument("--stalled", type=int, default=400, help="connections held open sending nothing or half")
    parser.add_argument("--hog_sockets", type=int, default=1025,
                        help=f"idle connections one client ({HOG_ADDRESS}) opens")
    parser.add_argument("--group_addresses", type=int, default=9,
                        help="addresses (a /24 each) of the connection group")
    parser.add_argument("--group_sockets", type=int, default=128, help="connections per address of that group")
    parser.add_argument("--large_bodies", type=int, default=800, help="searches with 1 MiB bodies")
    parser.add_argument("--flood_addresses", type=int, default=9, help="addresses (a /24 each) of the cost flood")
    parser.add_argument("--flood_clients", type=int, default=20,
                        help="clients per address of the cost flood, each sending the most expensive valid search")
    parser.add_argument("--descriptors", type=int, default=1024,
                        help="RLIMIT_NOFILE of the server of the descriptor-exhaustion attack")
    parser.add_argument("--exhaust_addresses", type=int, default=14,
                        help="addresses (a /24 each) of the descriptor-exhaustion group")
    parser.add_argument("--exhaust_sockets", type=int, default=100, help="connections per address of that group")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--max_seconds", type=float, default=8.0, help="per level")
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
        # The stalled connections must outlive the phase that measures searches next to them.
        proc, host, port = start_server(kb_dir, index_dir, args.dim, read_timeout_s=4 * args.max_seconds)
        try:
            health = stats(*load(host, port, "GET", "/health", bodies, 1, args.max_seconds))
            search = {str(c): stats(*load(host, port, "POST", "/search", bodies, c, args.max_seconds))
                      for c in args.clients}
            idle_threads = thread_count(proc.pid)
            stalled = open_stalled(host, port, args.stalled)
            try:
                time.sleep(0.5)  # let the server accept them all
                under_stall = stats(*load(host, port, "POST", "/search", bodies, STALLED_CLIENTS, args.max_seconds))
                stalled_threads = thread_count(proc.pid)
                open_after = sum(still_open(sock) for sock in stalled)
            finally:
                for sock in stalled:
                    sock.close()
            hog = [socket.create_connection((host, port), timeout=30, source_address=(HOG_ADDRESS, 0))
                   for _ in range(args.hog_sockets)]
            try:
                time.sleep(0.5)
                hog_refused = count_refused(hog[-(args.hog_sockets // 2):])  # the cap holds the first ones
                under_hog = stats(*load(host, port, "POST", "/search", bodies, STALLED_CLIENTS, args.max_seconds))
                hog_open = sum(still_open(sock) for sock in hog)
            finally:
                for sock in hog:
                    sock.close()
            group = under_group(host, port, [f"127.0.{10 + i}.1" for i in range(args.group_addresses)],
                                args.group_sockets, b"", bodies, args.max_seconds)
            slow_head = (b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n{" % (1 << 20))
            slow_bodies = under_group(host, port, [f"127.0.{20 + i}.1" for i in range(SLOW_BODY_ADDRESSES)],
                                      SLOW_BODY_SOCKETS, slow_head, bodies, args.max_seconds)
            # Twice: memory the allocator keeps after the first burst must be reused by the second, not added to.
            bodies_runs = [large_bodies(host, port, args.large_bodies, proc.pid) for _ in range(2)]
            flood = under_cost_flood(host, port, [f"127.0.{60 + i}.1" for i in range(args.flood_addresses)],
                                     args.flood_clients, max_cost_body(rng), bodies, args.max_seconds)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        exhaustion = descriptor_exhaustion(kb_dir, index_dir, args.dim, args.descriptors,
                                           [f"127.0.{80 + i}.1" for i in range(args.exhaust_addresses)],
                                           args.exhaust_sockets, bodies, args.max_seconds)

    errors = (sum(r["errors"] for r in search.values()) + under_stall["errors"] + under_hog["errors"]
              + group["search"]["errors"] + slow_bodies["search"]["errors"] + flood["search"]["errors"]
              + flood["search_from_one_range"]["errors"]
              + exhaustion["search"]["errors"] + exhaustion["health_after"]["errors"])
    result = {"machine": common.machine_info(), "passages": args.passages, "dim": args.dim, "k": args.k,
              "search_by_clients": search, "health_reference_1_client": health,
              "stalled": {"connections": args.stalled, "per_address": PER_ADDRESS, "still_open_after": open_after,
                          "clients": STALLED_CLIENTS, "search": under_stall,
                          "server_threads_idle": idle_threads, "server_threads_with_stalled": stalled_threads},
              "one_client_many_sockets": {"address": HOG_ADDRESS, "sockets": args.hog_sockets,
                                          "refused_503_of_the_last_half": hog_refused, "held_open": hog_open,
                                          "other_clients": STALLED_CLIENTS, "search": under_hog},
              "connection_group": group, "slow_body_group": slow_bodies,
              "large_bodies": bodies_runs, "cost_flood": flood, "descriptor_exhaustion": exhaustion,
              "errors": errors}
    levels = ", ".join(f"{c} clients p50 {r['p50_ms']:.1f}/p99 {r['p99_ms']:.1f} ms {r['qps']:.0f} qps "
                       f"{r['errors']} err" for c, r in search.items())
    common.write_results("server", result, (
        f"{args.passages} passages: {levels}; with {open_after}/{args.stalled} stalled connections open: "
        f"{STALLED_CLIENTS} clients p50 {under_stall['p50_ms']:.1f}/p99 {under_stall['p99_ms']:.1f} ms "
        f"{under_stall['errors']} err, server threads {idle_threads} -> {stalled_threads}; one client with "
        f"{args.hog_sockets} sockets ({hog_open} held open): {STALLED_CLIENTS} other clients p50 "
        f"{under_hog['p50_ms']:.1f}/p99 {under_hog['p99_ms']:.1f} ms {under_hog['errors']} err; "
        + "; ".join(f"{name} ({len(g['addresses'])} /24s x {g['per_address']}; of its {g['group']['opened']} "
                    f"connections the server closed {g['group']['closed_by_server']}, {g['group']['refused_503']} "
                    f"with 503): {STALLED_CLIENTS} other clients p50 "
                    f"{g['search']['p50_ms']:.1f}/p99 {g['search']['p99_ms']:.1f} ms {g['search']['errors']} err "
                    f"{g['search']['error_kinds']}"
                    for name, g in (("connection group", group), ("slow-body group", slow_bodies)))
        + f"; {args.large_bodies} x 1 MiB bodies, twice: "
        + "; ".join(f"{r['statuses']} RSS {r['rss_mib_before']:.0f} -> peak {r['rss_mib_peak']:.0f} -> "
                    f"{r['rss_mib_after']:.0f} MiB" for r in bodies_runs)
        + f"; cost flood ({len(flood['addresses'])} /24s x {flood['per_address']} clients of {MAX_QUERIES} x "
          f"{MAX_QUERY_CHARS}-char queries, k={MAX_K}: replies {flood['flood_replies']}): {STALLED_CLIENTS} other "
          f"clients of a /24 each p50 {flood['search']['p50_ms']:.1f}/p99 {flood['search']['p99_ms']:.1f} ms "
          f"{flood['search']['errors']} err {flood['search']['error_kinds']}, of one /24 p50 "
          f"{flood['search_from_one_range']['p50_ms']:.1f}/p99 {flood['search_from_one_range']['p99_ms']:.1f} ms "
          f"{flood['search_from_one_range']['errors']} err"
        + f"; descriptor exhaustion (RLIMIT_NOFILE {exhaustion['descriptors']}, {len(exhaustion['addresses'])} /24s x "
          f"{exhaustion['per_address']}; of its {exhaustion['group']['opened']} connections the server closed "
          f"{exhaustion['group']['closed_by_server']}): {STALLED_CLIENTS} other clients p50 "
          f"{exhaustion['search']['p50_ms']:.1f}/p99 {exhaustion['search']['p99_ms']:.1f} ms "
          f"{exhaustion['search']['errors']} err {exhaustion['search']['error_kinds']}, /health after "
          f"{exhaustion['health_after']['errors']} err, server log {exhaustion['server_log_lines']} lines"
        + f"; {errors} errors in all"))
    return 0 if errors == 0 and open_after == args.stalled else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
