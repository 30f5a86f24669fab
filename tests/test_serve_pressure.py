"""`t5r serve` when the machine runs short or clients misbehave: file descriptors, a broken model,
invalid text and options, and worker time shared fairly between address ranges."""

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest
from test_retrieval_serve import KB, address, get, make_service, post, search_from, serving

from t5_retrieval import cli
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.retrieval import http_server, scann_index
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def kb_index(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("emb"))
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=256), KB, [p.id for p in KB], directory, progress=False)
    return scann_index.build_scann_index(directory, scann_index.ScannConfig(mode="brute_force"))


# --- invalid text and options -------------------------------------------------------------------

@pytest.mark.parametrize("body, field", [
    (b'{"task": "nq", "query": "capital \\ud800 of France"}', "'query'"),
    (b'{"task": "nq", "queries": ["Paris", "\\udfff"]}', "'queries[1]'"),
])
def test_a_lone_surrogate_in_a_query_gets_400_naming_the_field(kb_index, body, field):
    with serving(make_service(kb_index)) as url:
        status, reply = post(url, body)
        assert status == 400 and f"field {field} is not valid text: a lone surrogate" in reply["error"], (status, reply)


@pytest.mark.parametrize("flags, fragment", [
    (["--port", "70000"], "--port 70000 is not a TCP port: give one in [1, 65535]"),
    (["--port", "-1"], "--port -1 is not a TCP port"),
    (["--host", "evil..host"], "--host 'evil..host' is neither an IP address nor a host name"),
    (["--max_body_memory_mb", "nan"], "--max_body_memory_mb nan: must be a number in"),
    (["--max_body_memory_mb", "inf"], "--max_body_memory_mb inf: must be a number in"),
    (["--max_body_memory_mb", "-1"], "--max_body_memory_mb -1.0: must be a number in"),
    (["--read_timeout_s", "inf"], "--read_timeout_s inf: must be a number in"),
    (["--workers", "0"], "--workers 0: must be a number in [1, 1024]"),
    (["--max_connections", "-5"], "--max_connections -5: must be a number in"),
])
def test_bad_server_options_are_refused_in_one_line_with_exit_2(cli_dirs, capsys, flags, fragment):
    kb_dir, idx_dir = cli_dirs
    codes = []  # main runs in a thread: were the option accepted, it would serve and never return
    thread = threading.Thread(target=lambda: codes.append(cli.main([
        "serve", "--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq",
        "--port", "0", *flags])), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert codes, f"t5r serve started serving with {flags}"
    err = capsys.readouterr().err
    assert codes[0] == 2 and err.startswith("t5r serve: error: ") and fragment in err, (codes, err)
    assert err.count("\n") == 1, f"one line expected: {err!r}"


# --- a broken service, and what it does before it listens ---------------------------------------

class RecordingEncoder(HashedBagOfWordsEncoder):
    """Records each encode call's (task, number of texts); fails with AttributeError while `broken`
    (what a half-imported module gives)."""

    def __init__(self):
        super().__init__(dim=256)
        self.calls: list[tuple[str, int]] = []
        self.broken = False

    def encode_queries(self, texts, task):
        if self.broken:
            raise AttributeError("module 'half_imported' has no attribute 'encode'")
        self.calls.append((task, len(texts)))
        return super().encode_queries(texts, task)


def test_the_server_searches_every_task_and_the_largest_batch_before_it_listens(kb_index):
    encoder = RecordingEncoder()
    service = make_service(kb_index, encoder, max_queries=5, max_query_chars=200)
    httpd = http_server.make_server(service, "127.0.0.1", 0)  # bound, not yet serving
    try:
        assert {"nq", "fever"} <= {task for task, _ in encoder.calls}, encoder.calls
        assert ("nq", 5) in encoder.calls, f"the largest batch (max_queries=5) was not searched: {encoder.calls}"
        assert len(encoder.calls) >= 4, "queries of several lengths, up to max_query_chars, are searched"
    finally:
        httpd.server_close()


def test_a_model_that_cannot_search_stops_the_server_before_it_listens(kb_index):
    encoder = RecordingEncoder()
    encoder.broken = True
    with pytest.raises(Exception, match="the warm-up search fails \\(AttributeError: module 'half_imported'"):
        http_server.make_server(make_service(kb_index, encoder), "127.0.0.1", 0)


def test_health_reports_a_broken_service_with_503_and_the_reason_until_searches_work_again(kb_index):
    encoder = RecordingEncoder()
    with serving(make_service(kb_index, encoder)) as url:
        assert get(url)[0] == 200
        encoder.broken = True
        status, reply = post(url, {"task": "nq", "query": "capital of France"})
        assert status == 500 and reply == {"error": "internal error: AttributeError"}, (status, reply)
        status, health = get(url)
        assert status == 503 and health["status"] == "broken", (status, health)
        assert "warm-up search fails: AttributeError: module 'half_imported'" in health["reason"], health
        encoder.broken = False
        assert post(url, {"task": "nq", "query": "capital of France", "k": 1})[0] == 200
        status, health = get(url)
        assert status == 200 and health["status"] == "ok", "a search that works again: the service recovered"


def test_a_failure_the_warm_up_search_does_not_share_leaves_health_ok(kb_index):
    class OneBadText(HashedBagOfWordsEncoder):
        def encode_queries(self, texts, task):
            if "poison" in texts:
                raise RuntimeError("a bug with one text")
            return super().encode_queries(texts, task)

    with serving(make_service(kb_index, OneBadText(dim=256))) as url:
        assert post(url, {"task": "nq", "query": "poison"})[0] == 500
        status, health = get(url)
        assert status == 200 and health["status"] == "ok", "one request's failure is not the service's"


# --- file descriptors ---------------------------------------------------------------------------

def _limit_descriptors(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_server_fits_its_connections_to_a_low_descriptor_limit_and_keeps_answering(cli_dirs):
    kb_dir, idx_dir = cli_dirs
    env = {k: v for k, v in os.environ.items() if k != http_server.TOKEN_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "t5_retrieval.cli", "serve", "--lexical_baseline_dim", "64",
                             "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0",
                             "--read_timeout_s", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            preexec_fn=_limit_descriptors(160, 160))
    burst: list[socket.socket] = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("t5r serve: http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        url = line.split()[2].rsplit("/", 1)[0]
        for i in range(300):  # twice the descriptor limit, from 6 ranges
            burst.append(socket.create_connection(address(url), timeout=10,
                                                  source_address=(f"127.0.{1 + i // 50}.2", 0)))
        time.sleep(0.5)
        for _ in range(3):
            status, reply = search_from(url, json.dumps({"task": "nq", "query": "capital of Germany", "k": 1}).encode(),
                                        "127.0.0.1")
            assert status == 200 and reply["results"][0]["title"] == "Berlin", (status, reply)
        assert get(url)[0] == 200
    finally:
        for sock in burst:
            sock.close()
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    logged = [line for line in err.splitlines() if line.strip()]
    assert any("file descriptor limit 160" in line and "(--max_connections 1024 lowered)" in line
               for line in logged), logged[:5]
    assert len(logged) < 20, f"{len(logged)} log lines: {logged[:10]}"


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one():
    script = ("import resource; from t5_retrieval.retrieval import http_server as h; "
              "o = h.fit_to_descriptors(h.ServerOptions(max_connections=100)); "
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], o.max_connections)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                            preexec_fn=_limit_descriptors(100, 2048))
    assert result.stdout.split() == ["2048", "100"], (result.stdout, result.stderr[-2000:])


# --- fair worker time ---------------------------------------------------------------------------

def fair_share():
    from t5_retrieval.retrieval import fair_share  # imported here: each test fails on its own before it existed

    return fair_share


def _record(log: list[str], name: str, seconds: float) -> str:
    time.sleep(seconds)
    log.append(name)
    return name


async def _request(queue, where: str, name: str, steps: int, seconds: float,
                   log: list[str], finished: dict[str, float]) -> None:
    job = queue.begin(where)
    try:
        for i in range(steps):
            await queue.run(job, _record, log, f"{name}.{i}", seconds)
    finally:
        queue.end(job)
    finished[name] = time.perf_counter()


def test_a_range_flooding_the_workers_leaves_another_range_a_step_or_two_to_wait():
    async def scenario():
        queue = fair_share().FairQueue(workers=1, max_queued=1000)
        log: list[str] = []
        finished: dict[str, float] = {}
        # Nine ranges, five requests of four 20 ms steps each: 3.6 s of work queued.
        flood = [asyncio.create_task(_request(queue, f"10.0.{r}.0/24", f"r{r}q{q}", 4, 0.02, log, finished))
                 for r in range(9) for q in range(5)]
        await asyncio.sleep(0.3)  # every flooding range has had a step
        arrived = len(log)
        start = time.perf_counter()
        await _request(queue, "192.0.2.0/24", "other", 1, 0.0, log, finished)
        waited = finished["other"] - start
        await asyncio.gather(*flood)
        queue.close()
        return log, arrived, waited

    log, arrived, waited = asyncio.run(scenario())
    ahead = log[arrived:log.index("other.0")]
    # The running step, and one of the range that has used the least time (it is the newcomer's start).
    assert len(ahead) <= 3, f"{len(ahead)} steps ran after the other range's request came: {ahead}"
    assert waited < 0.1, f"the other range waited {waited:.3f} s behind 3.6 s of queued work"


def test_a_flooding_range_gets_no_more_worker_time_than_the_others_when_all_wait():
    async def scenario():
        queue = fair_share().FairQueue(workers=1, max_queued=1000)
        log: list[str] = []
        tasks = [asyncio.create_task(_request(queue, "10.0.0.0/24", f"heavy{q}", 4, 0.01, log, {})) for q in range(10)]
        tasks += [asyncio.create_task(_request(queue, "10.0.1.0/24", f"light{q}", 1, 0.01, log, {})) for q in range(10)]
        await asyncio.gather(*tasks)
        queue.close()
        return log

    log = asyncio.run(scenario())
    first = log[:20]
    light = sum(step.startswith("light") for step in first)
    assert light >= 9, f"in the first 20 steps (equal time each) the light range had {light}: {first}"


def test_when_the_queue_is_full_the_range_with_the_most_waiting_gives_up_its_newest():
    async def scenario():
        queue = fair_share().FairQueue(workers=1, max_queued=3)
        log: list[str] = []
        results = await asyncio.gather(
            *[_request(queue, "10.0.0.0/24", f"flood{q}", 1, 0.05, log, {}) for q in range(4)],
            _delayed(_request(queue, "10.0.1.0/24", "other", 1, 0.0, log, {})), return_exceptions=True)
        queue.close()
        return log, results

    log, results = asyncio.run(scenario())
    assert "other.0" in log, (log, results)
    refused = [r for r in results if isinstance(r, fair_share().Refused)]
    assert len(refused) == 1 and "your address range has the most requests waiting" in str(refused[0]), results
    assert isinstance(results[3], fair_share().Refused), "the newest of the flooding range's requests gives way"


async def _delayed(coroutine):
    await asyncio.sleep(0.01)
    return await coroutine


class SlowEncoder(HashedBagOfWordsEncoder):
    """4 ms per query, like a model: a search of 64 queries is 256 ms of worker time."""

    def encode_queries(self, texts, task):
        time.sleep(0.004 * len(texts))
        return super().encode_queries(texts, task)


def test_over_http_a_range_flooding_with_the_largest_searches_leaves_another_range_served_quickly(kb_index):
    heavy = json.dumps({"task": "nq", "queries": ["capital of Germany"] * 64, "k": 4}).encode()
    light = json.dumps({"task": "nq", "query": "highest mountain", "k": 1}).encode()
    with serving(make_service(kb_index, SlowEncoder(dim=256)), workers=1) as url:
        stop = threading.Event()
        flood_statuses: list[int] = []

        def flood(source: str) -> None:
            while not stop.is_set():
                flood_statuses.append(search_from(url, heavy, source)[0])

        # Eight clients of one /24 (two addresses): first come, first served, each light search would wait
        # behind up to eight of theirs, ~2 s.
        threads = [threading.Thread(target=flood, args=(f"127.0.1.{2 + i % 2}",)) for i in range(8)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            latencies = []
            for _ in range(5):
                start = time.perf_counter()
                status, reply = search_from(url, light, "127.0.0.1")
                latencies.append(time.perf_counter() - start)
                assert status == 200 and reply["results"][0]["title"] == "Mount Everest", (status, reply)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert max(latencies) < 0.5, f"latencies {[round(x, 3) for x in latencies]} s beside a flood of 256 ms searches"
    assert flood_statuses and set(flood_statuses) == {200}, "the flooding range is served too, in its turn"
