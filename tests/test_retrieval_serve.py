"""HTTP search API, exercised with urllib against a running server on 127.0.0.1 (OS-assigned port)."""

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval import cli
from t5_retrieval.commands import serve as serve_command
from t5_retrieval.retrieval import index, scann_index, serve
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder
from t5_retrieval.data.stores.passages import PassageTable

KB = [
    Passage("paris_0", "paris", "Paris", "Paris is the capital and largest city of France."),
    Passage("berlin_0", "berlin", "Berlin", "Berlin is the capital of Germany."),
    Passage("nile_0", "nile", "Nile", "The Nile is a major river in northeastern Africa."),
    Passage("everest_0", "everest", "Mount Everest", "Mount Everest is Earth's highest mountain."),
]


@pytest.fixture(scope="module")
def kb_index(tmp_path_factory) -> index.Index:
    directory = str(tmp_path_factory.mktemp("emb"))
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=256), KB, [p.id for p in KB], directory, progress=False)
    return scann_index.build_scann_index(directory, scann_index.ScannConfig(mode="brute_force"))


def make_service(idx: index.Index, encoder=None, **limits) -> serve.SearchService:
    return serve.SearchService(encoder or HashedBagOfWordsEncoder(dim=256), idx, PassageTable(KB), ["nq", "fever"],
                               serve.ServeLimits(**limits))


@contextlib.contextmanager
def serving(service: serve.SearchService, **options):
    """A real server on 127.0.0.1 (OS-assigned port) in a thread; yields its base URL."""
    httpd = serve.make_server(service, "127.0.0.1", 0, serve.ServerOptions(**options))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(kb_index):
    service = make_service(kb_index, max_k=3, default_k=2, max_queries=2, max_query_chars=50, max_body_bytes=2000)
    with serving(service) as url:
        yield url


def post(url: str, body: bytes | dict, path: str = "/search", headers: dict[str, str] | None = None
         ) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if headers is None else headers
    request = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str, path: str = "/health", headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def address(url: str) -> tuple[str, int]:
    host, port = url[len("http://"):].split(":")
    return host, int(port)


def read_reply(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout bounds each read)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_server_binds_loopback_and_reports_health(server):
    assert server.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(server + "/health", timeout=10) as response:
        health = json.loads(response.read())
    assert health["status"] == "ok" and health["passages"] == 4 and health["tasks"] == ["nq", "fever"]


def test_single_query_returns_ranked_passages_with_ids_titles_and_scores(server):
    status, reply = post(server, {"task": "nq", "query": "capital of Germany", "k": 2})
    assert status == 200, reply
    hits = reply["results"]
    assert [h["rank"] for h in hits] == [1, 2] and hits[0]["passage_id"] == "berlin_0", hits
    assert hits[0]["wikipedia_id"] == "berlin" and hits[0]["title"] == "Berlin"
    assert hits[0]["score"] >= hits[1]["score"]


def test_batched_queries_return_one_ranking_each_with_default_k(server):
    status, reply = post(server, {"task": "fever", "queries": ["highest mountain", "river in Africa"]})
    assert status == 200, reply
    assert [r[0]["passage_id"] for r in reply["results"]] == ["everest_0", "nile_0"]
    assert all(len(r) == 2 for r in reply["results"]), "without k, default_k (2) applies"


def test_inconsistent_limits_are_refused():
    with pytest.raises(ValueError, match="default_k=10 must be in \\[1, max_k=3\\]"):
        serve.ServeLimits(max_k=3)


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"task": "zsre", "query": "x"}, "unknown task 'zsre'"),
    ({"query": "x"}, "field 'task' is required"),
    ({"task": "nq", "query": "   "}, "field 'query' is empty"),
    ({"task": "nq", "query": "x" * 51}, "has 51 characters, more than 50"),
    ({"task": "nq", "queries": ["ok", ""]}, "field 'queries[1]' is empty"),
    ({"task": "nq", "queries": ["a", "b", "c"]}, "3 entries, more than 2"),
    ({"task": "nq", "queries": []}, "non-empty list"),
    ({"task": "nq", "query": "x", "queries": ["y"]}, "exactly one of"),
    ({"task": "nq", "query": "x", "k": 0}, "field 'k' must be an integer in [1, 3]"),
    ({"task": "nq", "query": "x", "k": 4}, "field 'k' must be an integer in [1, 3]"),
    ({"task": "nq", "query": "x", "k": True}, "field 'k'"),
    ({"task": "nq", "query": "x", "topk": 3}, "unknown field(s) ['topk']"),
])
def test_bad_requests_get_400_with_a_json_message(server, body, fragment):
    status, reply = post(server, body)
    assert status == 400 and fragment in reply["error"], (status, reply)


def test_oversized_body_and_unknown_paths_are_refused_and_the_server_lives_on(server):
    status, reply = post(server, {"task": "nq", "query": "x", "pad": "y" * 3000})
    assert status == 413 and "limit is 2000" in reply["error"], reply
    status, reply = post(server, {"task": "nq", "query": "x"}, path="/other")
    assert status == 404
    host, port = server[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/search")
    conn.endheaders()  # No Content-Length at all.
    response = conn.getresponse()
    assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    conn.close()
    assert post(server, {"task": "nq", "query": "capital of France", "k": 1})[1]["results"][0]["title"] == "Paris"


def test_service_refuses_an_index_built_by_another_model(tmp_path):
    directory = str(tmp_path / "emb")
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=64), KB, [p.id for p in KB], directory, progress=False)
    idx = scann_index.build_scann_index(directory, scann_index.ScannConfig(mode="brute_force"))
    with pytest.raises(index.IndexMismatchError, match="fingerprint"):
        serve.SearchService(HashedBagOfWordsEncoder(dim=128), idx, PassageTable(KB), ["nq"])


def test_cli_refuses_to_serve_an_index_of_another_model(cli_dirs, capsys):
    kb_dir, idx_dir = cli_dirs
    code = cli.main(["serve", "--lexical_baseline_dim", "32", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq"])
    assert code == 2 and "hashed-bow-v2-dim64" in capsys.readouterr().err


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_without_a_json_content_type_gets_415(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, reply = post(server, {"task": "nq", "query": "capital of France"}, headers=headers)
    assert status == 415 and "application/json" in reply["error"], (status, reply)
    status, _ = post(server, {"task": "nq", "query": "x"}, headers={"Content-Type": "application/json; charset=utf-8"})
    assert status == 200, "a charset parameter on application/json is fine"


def test_deeply_nested_json_gets_400_not_500(kb_index):
    with serving(make_service(kb_index)) as url:
        status, reply = post(url, b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and "nested too deeply" in reply["error"], (status, reply)
        assert post(url, {"task": "nq", "query": "river in Africa", "k": 1})[1]["results"][0]["title"] == "Nile"


def test_a_stalled_connection_is_closed_after_the_read_timeout(kb_index):
    with serving(make_service(kb_index), read_timeout_s=0.5) as url:
        with socket.create_connection(address(url), timeout=10) as half, \
                socket.create_connection(address(url), timeout=10) as silent:
            half.sendall(b"POST /search HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            reply = read_reply(half)
            assert reply.startswith(b"HTTP/1.1 408 "), f"half a request should get 408 and a close, got {reply[:200]!r}"
            assert read_reply(silent) == b"", "a connection that sends nothing should be closed without a reply"


def test_stalled_connections_hold_no_worker(kb_index):
    with serving(make_service(kb_index), workers=1, read_timeout_s=60) as url:
        stalled = [socket.create_connection(address(url), timeout=10) for _ in range(60)]
        try:
            for i, sock in enumerate(stalled[::2]):
                sock.sendall(b"POST /search HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"task\"" if i % 2 else b"GET /hea")
            status, reply = post(url, {"task": "nq", "query": "capital of Germany", "k": 1})
            assert status == 200 and reply["results"][0]["title"] == "Berlin", (status, reply)
        finally:
            for sock in stalled:
                sock.close()


def test_connections_beyond_the_limit_get_503_and_an_oversized_head_431(kb_index):
    with serving(make_service(kb_index), max_connections=2, read_timeout_s=60) as url:
        held = [socket.create_connection(address(url), timeout=10) for _ in range(2)]
        try:
            with socket.create_connection(address(url), timeout=10) as third:
                reply = read_reply(third)
                assert reply.startswith(b"HTTP/1.1 503 ") and b"too many connections" in reply, reply[:300]
            held[0].sendall(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (70 << 10))
            reply = read_reply(held[0])
            assert reply.startswith(b"HTTP/1.1 431 "), reply[:300]
        finally:
            for sock in held:
                sock.close()


class BlockingEncoder(HashedBagOfWordsEncoder):
    """Holds every query encoding until `release` is set, so a test controls when workers are busy."""

    def __init__(self):
        super().__init__(dim=256)
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode_queries(self, texts, task):
        self.entered.set()
        assert self.release.wait(timeout=30), "the test never released the encoder"
        return super().encode_queries(texts, task)


def test_a_full_worker_pool_answers_503_and_recovers(kb_index):
    encoder = BlockingEncoder()
    with serving(make_service(kb_index, encoder), workers=1, max_queued=0) as url:
        first: list = []
        thread = threading.Thread(target=lambda: first.append(post(url, {"task": "nq", "query": "Everest"})))
        thread.start()
        assert encoder.entered.wait(timeout=30), "the first request never reached the encoder"
        status, reply = post(url, {"task": "nq", "query": "Paris"})
        assert status == 503 and "busy" in reply["error"], (status, reply)
        encoder.release.set()
        thread.join(timeout=30)
        assert first and first[0][0] == 200, first
        assert post(url, {"task": "nq", "query": "Paris", "k": 1})[1]["results"][0]["title"] == "Paris"


def test_listen_backlog_holds_a_burst_of_connections_before_they_are_accepted(kb_index):
    httpd = serve.make_server(make_service(kb_index), "127.0.0.1", 0)  # listening, not yet accepting
    burst = []
    try:
        for i in range(64):
            try:
                burst.append(socket.create_connection(("127.0.0.1", httpd.server_address[1]), timeout=3))
            except OSError as e:
                pytest.fail(f"connection {i} of a burst of 64 was refused or timed out ({e}): listen backlog too small")
    finally:
        for sock in burst:
            sock.close()
        httpd.server_close()


def test_token_is_required_on_every_path_when_configured(kb_index):
    with serving(make_service(kb_index), auth_token="s3cret-token") as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
            status, reply = get(url, headers=headers)
            assert status == 401 and "Bearer" in reply["error"], (headers, status, reply)
            status, _ = post(url, {"task": "nq", "query": "x"}, headers={"Content-Type": "application/json", **headers})
            assert status == 401, headers
        good = {"Authorization": "Bearer s3cret-token"}
        assert get(url, headers=good)[0] == 200
        status, reply = post(url, {"task": "nq", "query": "capital of France", "k": 1},
                             headers={"Content-Type": "application/json", **good})
        assert status == 200 and reply["results"][0]["title"] == "Paris", reply


def test_a_non_loopback_host_without_a_token_is_refused_before_binding(kb_index):
    with pytest.raises(ValueError, match="reachable beyond this machine.*--auth_token_file"):
        serve.make_server(make_service(kb_index), "0.0.0.0", 0)


class NamedTaskEncoder(HashedBagOfWordsEncoder):
    """A lexical encoder that, like a trained model, lists the tasks it was trained on."""

    task_names = ["fever", "nq"]


def test_tasks_the_model_does_not_know_are_refused_at_start(kb_index):
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['zsre'\]: this model knows \['fever', 'nq'\]"):
        serve.SearchService(NamedTaskEncoder(dim=256), kb_index, PassageTable(KB), ["nq", "zsre"])


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory) -> tuple[str, str]:
    from t5_retrieval.data.stores.kb import write_passage_store

    root = tmp_path_factory.mktemp("cli")
    kb_dir, emb_dir, idx_dir = (str(root / d) for d in ("kb", "emb", "idx"))
    write_passage_store(((p, None) for p in KB), kb_dir)
    embedding_store.write_embeddings(HashedBagOfWordsEncoder(dim=64), KB, [p.id for p in KB], emb_dir, progress=False)
    scann_index.build_scann_index(emb_dir, scann_index.ScannConfig(mode="brute_force")).save(idx_dir)
    return kb_dir, idx_dir


def test_cli_refuses_an_open_host_without_a_token_and_an_empty_token_file(cli_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
    kb_dir, idx_dir = cli_dirs
    base = ["--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0"]
    assert cli.main(["serve", *base, "--host", "0.0.0.0"]) == 2
    assert "reachable beyond this machine" in capsys.readouterr().err
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert cli.main(["serve", *base, "--auth_token_file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_cli_serves_with_a_token_from_a_file(cli_dirs, tmp_path):
    kb_dir, idx_dir = cli_dirs
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    env = {k: v for k, v in os.environ.items() if k != serve.TOKEN_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "t5_retrieval.cli", "serve", "--lexical_baseline_dim", "64",
                             "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0",
                             "--auth_token_file", str(token_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("t5r serve: http://127.0.0.1:") and "bearer token required" in line, line
        url = line.split()[2].rsplit("/", 1)[0]
        assert get(url)[0] == 401
        status, reply = post(url, {"task": "nq", "query": "capital of Germany", "k": 1},
                             headers={"Content-Type": "application/json", "Authorization": "Bearer file-token"})
        assert status == 200 and reply["results"][0]["title"] == "Berlin", reply
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_names_unknown_and_known_tasks_and_does_not_serve(cli_dirs, capsys, monkeypatch):
    monkeypatch.setattr(serve_command, "encoder_from_flags", lambda args: NamedTaskEncoder(dim=64))
    kb_dir, idx_dir = cli_dirs
    codes = []  # main runs in a thread: were the tasks not checked, it would serve and never return
    thread = threading.Thread(target=lambda: codes.append(cli.main([
        "serve", "--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq,wow", "--port", "0"])),
        daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert codes, "t5r serve started serving with a task the model does not know"
    code, err = codes[0], capsys.readouterr().err
    assert code == 2 and "unknown task(s) ['wow']: this model knows ['fever', 'nq']" in err, (code, err)
