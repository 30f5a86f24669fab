"""HTTP search API, exercised with urllib and raw sockets against a running server on 127.0.0.1 (OS-assigned port)."""

import asyncio
import contextlib
import http.client
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import uvicorn

from t5_retrieval import cli
from t5_retrieval.commands import serve as serve_command
from t5_retrieval.data.records import Passage
from t5_retrieval.data.stores import embedding_store
from t5_retrieval.data.stores.passages import PassageTable
from t5_retrieval.retrieval import http_server, index, scann_index, serve
from t5_retrieval.retrieval.encoder import HashedBagOfWordsEncoder

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
def running(service: serve.SearchService, warm_up: bool = True, **options):
    """A real server on 127.0.0.1 (OS-assigned port) in a thread; yields its base URL and the server."""
    httpd = http_server.make_server(service, "127.0.0.1", 0, http_server.ServerOptions(**options), warm_up)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def serving(service: serve.SearchService, **options):
    """A real server on 127.0.0.1 (OS-assigned port) in a thread; yields its base URL."""
    with running(service, **options) as (url, _):
        yield url


def wait_for_held(httpd: http_server.SearchServer, expected: int, why: str) -> None:
    """Polls, for up to 10 s, until the server's bodies hold `expected` bytes (its event loop counts them)."""
    deadline = time.monotonic() + 10
    while httpd.bodies.held != expected:
        if time.monotonic() > deadline:
            pytest.fail(f"{why}: bodies hold {httpd.bodies.held} bytes, expected {expected}")
        time.sleep(0.01)


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


def json_reply(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of one whole response; fails if the body is not JSON."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert headers.get("content-type", "").startswith("application/json"), f"not a JSON reply: {raw[:300]!r}"
    return int(lines[0].split()[1]), headers, json.loads(body)


def exchange(url: str, request: bytes, source: str = "127.0.0.1") -> tuple[int, dict[str, str], dict]:
    """Sends raw `request` bytes from address `source`, reads until the server closes: (status, headers, JSON)."""
    with socket.create_connection(address(url), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(request)
        return json_reply(read_reply(sock))


def search_head(length: int, *extra: bytes) -> bytes:
    """The head of a `POST /search` with a JSON body of `length` bytes (not sent)."""
    return (b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Type: application/json\r\n"
            + b"".join(line + b"\r\n" for line in extra) + b"Content-Length: %d\r\n\r\n" % length)


def search_body(length: int, query: str = "capital of Germany") -> bytes:
    """A valid search body padded with spaces (JSON whitespace) to exactly `length` bytes."""
    return json.dumps({"task": "nq", "query": query, "k": 1}).encode().ljust(length)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the next response on a kept-alive connection."""
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def search_from(url: str, body: bytes, source: str) -> tuple[int, dict]:
    """`POST /search` of raw `body` from address `source` (http.client: keep-alive, Content-Length)."""
    conn = http.client.HTTPConnection(*address(url), timeout=10, source_address=(source, 0))
    try:
        conn.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


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


def test_keep_alive_requests_are_not_held_by_delayed_acks(server):
    # A reply's head and body are two writes: with Nagle on, each waits for the client's delayed
    # ACK (40 ms or more on Linux); with it off, a loopback round trip takes well under a millisecond.
    conn = http.client.HTTPConnection(*address(server), timeout=10)
    try:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            times.append(time.perf_counter() - start)
    finally:
        conn.close()
    assert sorted(times)[len(times) // 2] < 0.03, f"median keep-alive round trip {sorted(times)} s"


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
    code = cli.main(["serve", "--lexical_baseline_dim", "32", "--index_dir", idx_dir, "--kb_dir", kb_dir,
                     "--tasks", "nq"])
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


def test_a_number_of_5000_digits_gets_400_not_500(kb_index):
    with serving(make_service(kb_index)) as url:
        status, reply = post(url, b'{"task": "nq", "query": "x", "k": ' + b"9" * 5000 + b"}")
        assert status == 400 and "has 5000 digits; at most 18" in reply["error"], (status, reply)


def test_a_stalled_connection_is_closed_after_the_read_timeout(kb_index):
    with serving(make_service(kb_index), read_timeout_s=0.5) as url:
        with socket.create_connection(address(url), timeout=10) as half, \
                socket.create_connection(address(url), timeout=10) as silent:
            half.sendall(search_head(100) + b"{")
            status, _, reply = json_reply(read_reply(half))
            assert status == 408 and "no complete request within 0.5 s" in reply["error"], (status, reply)
            assert read_reply(silent) == b"", "a connection that sends nothing should be closed without a reply"


def test_stalled_connections_hold_no_worker(kb_index):
    with serving(make_service(kb_index), workers=1, read_timeout_s=60) as url:
        stalled = [socket.create_connection(address(url), timeout=10) for _ in range(60)]
        try:
            for i, sock in enumerate(stalled[::2]):
                sock.sendall(search_head(50) + b'{"task"' if i % 2 else b"GET /hea")
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
                status, headers, reply = json_reply(read_reply(third))
                assert status == 503 and "too many connections" in reply["error"], reply
                assert headers["retry-after"] == "1", headers
            held[0].sendall(b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"a" * (70 << 10))
            status, _, reply = json_reply(read_reply(held[0]))
            assert status == 431 and "request head over 65536 bytes" in reply["error"], (status, reply)
        finally:
            for sock in held:
                sock.close()


def test_addresses_of_one_range_share_its_connection_cap_and_another_range_is_served(kb_index):
    with serving(make_service(kb_index), max_connections=32, max_connections_per_range=4, read_timeout_s=60) as url:
        # Four addresses of 127.0.1.0/24, four sockets each: the range as a whole keeps 4.
        group = [socket.create_connection(address(url), timeout=10, source_address=(f"127.0.1.{2 + i // 4}", 0))
                 for i in range(16)]
        try:
            refused = [json_reply(read_reply(sock)) for sock in group[4:]]
            assert all(status == 503 and "from 127.0.1.0/24 (limit 4 per address range)" in reply["error"]
                       and headers["retry-after"] == "1" for status, headers, reply in refused), refused
            status, reply = post(url, {"task": "nq", "query": "capital of Germany", "k": 1})
            assert status == 200 and reply["results"][0]["title"] == "Berlin", (
                "127.0.0.1 must be served while 127.0.1.0/24 holds all it may", status, reply)
        finally:
            for sock in group:
                sock.close()


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither answered nor closed `sock` (nothing to read yet)."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def test_an_address_counts_in_the_ipv4_24_or_the_ipv6_64_it_is_in_as_configured():
    options = http_server.ServerOptions()
    assert options.address_range("203.0.113.77") == "203.0.113.0/24"
    assert options.address_range("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert options.address_range("::ffff:203.0.113.77") == "203.0.113.0/24", "an IPv4-mapped address is IPv4"
    narrow = http_server.ServerOptions(ipv4_range_prefix=32, ipv6_range_prefix=48)
    assert narrow.address_range("203.0.113.77") == "203.0.113.77/32"
    assert narrow.address_range("2001:db8:1:2:aaaa::1") == "2001:db8:1::/48"
    with pytest.raises(ValueError, match="ipv4_range_prefix must be a number in \\[0, 32\\]"):
        http_server.ServerOptions(ipv4_range_prefix=33)


def test_when_the_server_is_full_the_largest_range_yields_an_idle_slot_to_a_smaller_one(kb_index):
    # Two ranges hold all 8 slots, idle; a client of a third range takes the place of the oldest
    # connection of the first range, which is closed as an idle keep-alive connection is.
    with serving(make_service(kb_index), max_connections=8, max_connections_per_range=4, read_timeout_s=60) as url:
        group = [socket.create_connection(address(url), timeout=10, source_address=(f"127.0.{1 + i // 4}.2", 0))
                 for i in range(8)]
        try:
            status, reply = search_from(url, search_body(100), "127.0.0.1")
            assert status == 200 and reply["results"][0]["title"] == "Berlin", (status, reply)
            assert read_reply(group[0]) == b"", "the oldest connection of the first range should have been closed"
            assert all(still_open(sock) for sock in group[1:]), "only one slot was needed"
        finally:
            for sock in group:
                sock.close()


def test_body_memory_is_taken_as_bytes_arrive_not_as_declared(kb_index):
    # One body may have 2,000 bytes; all bodies being read 3,000 together.
    with running(make_service(kb_index, max_body_bytes=2000), max_body_memory_bytes=3000, read_timeout_s=30) as (
            url, httpd):
        body = search_body(2000)
        holders = [socket.create_connection(address(url), timeout=10, source_address=(f"127.0.{i}.2", 0))
                   for i in (1, 2, 3)]
        try:
            for sock in holders:  # 3 x 2,000 declared, 3 x 10 sent: what counts is what came
                sock.sendall(search_head(2000) + body[:10])
            wait_for_held(httpd, 30, "three bodies declared 2,000 bytes and sent 10 each")
            assert search_from(url, search_body(1500, "highest mountain"), "127.0.0.1")[0] == 200
            holders[0].sendall(body[10:1000])
            holders[1].sendall(body[10:1000])
            wait_for_held(httpd, 2010, "two bodies at 1,000 bytes, one at 10")
            # No range holds more than 1,500, so none gives way: refused before the body is read.
            status, headers, reply = exchange(url, search_head(1500))
            assert status == 503 and "body memory" in reply["error"], ("2,010 + 1,500 > 3,000", status, reply)
            assert headers["retry-after"] == "1" and headers["connection"] == "close", headers
            holders[2].sendall(body[10:1010])  # 2,010 + 1,000 > 3,000: refused as it arrives
            status, _, reply = json_reply(read_reply(holders[2]))
            assert status == 503 and "body memory" in reply["error"], (status, reply)
            holders[0].sendall(body[1000:])
            status, reply = read_response(holders[0])
            assert status == 200 and reply["results"][0]["title"] == "Berlin", reply
            wait_for_held(httpd, 1000, "the bytes of a body are released when its request is done")
            status, reply = search_from(url, search_body(1500, "river in Africa"), "127.0.0.1")
            assert status == 200 and reply["results"][0]["title"] == "Nile", reply
        finally:
            for sock in holders:
                sock.close()


def test_when_body_memory_is_full_the_range_holding_the_most_gives_up_a_body_being_read(kb_index):
    with running(make_service(kb_index, max_body_bytes=2000), max_body_memory_bytes=3000, read_timeout_s=30) as (
            url, httpd):
        body = search_body(2000)
        rich, poor = (socket.create_connection(address(url), timeout=10, source_address=(f"127.0.{i}.2", 0))
                      for i in (1, 2))
        try:
            rich.sendall(search_head(2000) + body[:1990])  # sent and stalled: real bytes, held
            poor.sendall(search_head(1000) + search_body(1000)[:990])
            wait_for_held(httpd, 2980, "bodies of 1,990 and 990 bytes came")
            status, reply = search_from(url, search_body(500, "capital of France"), "127.0.0.1")
            assert status == 200 and reply["results"][0]["title"] == "Paris", (
                "127.0.1.0/24 holds the most and should have given way", status, reply)
            assert read_reply(rich).startswith(b"HTTP/1.1 503 "), "the largest body being read is closed with 503"
            assert still_open(poor), "one body was enough room"
            wait_for_held(httpd, 990, "only the largest body was given up")
        finally:
            rich.close()
            poor.close()


def test_a_body_that_does_not_arrive_gets_408_at_the_deadline_and_releases_its_memory(kb_index):
    with running(make_service(kb_index, max_body_bytes=2000), max_body_memory_bytes=3000, read_timeout_s=0.5) as (
            url, httpd):
        with socket.create_connection(address(url), timeout=10, source_address=("127.0.1.2", 0)) as sock:
            sock.sendall(search_head(2000, b"Expect: 100-continue"))
            assert sock.recv(100).startswith(b"HTTP/1.1 100 "), "the server asks for the body"
            sock.sendall(search_body(2000)[:10])
            wait_for_held(httpd, 10, "a body declared 2,000 bytes and sent 10")
            status, _, reply = json_reply(read_reply(sock))
            assert status == 408 and "no complete request within 0.5 s" in reply["error"], (status, reply)
        wait_for_held(httpd, 0, "a body closed at its deadline is released")


def test_a_trailing_slash_gets_404_never_a_redirect_to_the_host_the_client_named(server):
    status, headers, reply = exchange(server, b"GET /health/ HTTP/1.1\r\nHost: attacker.example\r\n\r\n")
    assert status == 404 and "no such path '/health/'" in reply["error"], (status, reply)
    assert "location" not in headers, headers


def test_the_wrapped_protocol_is_uvicorns_h11_with_the_arguments_and_callbacks_it_is_built_for():
    # What GuardedProtocol relies on beyond uvicorn's documented settings; a release that changes it
    # fails here, before any server test.
    async def app(scope, receive, send):
        pass

    config = uvicorn.Config(app, http="h11")
    config.load()
    assert config.http_protocol_class is http_server.UVICORN_PROTOCOL
    assert list(inspect.signature(http_server.UVICORN_PROTOCOL).parameters) == [
        "config", "server_state", "app_state", "_loop"], "the keywords uvicorn.Server passes to the http class"
    callbacks = {name for cls in asyncio.Protocol.__mro__ for name, value in vars(cls).items()
                 if callable(value) and not name.startswith("_")}
    assert {"connection_made", "data_received", "connection_lost", "pause_writing"} <= callbacks, callbacks
    implemented = {name for name in callbacks if name in vars(http_server.UVICORN_PROTOCOL)}
    forwarded = {name for name in callbacks if name in vars(http_server.GuardedProtocol)}
    assert implemented <= forwarded, f"uvicorn's protocol implements {implemented - forwarded}, not passed on"


@pytest.mark.parametrize("request_bytes, status, fragment", [
    pytest.param(b"NONSENSE\r\n\r\n", 400, "malformed HTTP request", id="bad-request-line"),
    pytest.param(b"GET /health HTTP/1.1\r\n\r\n", 400, "Host", id="no-host"),
    pytest.param(b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Length: 12x\r\n\r\n", 400, "Content-Length",
                 id="bad-content-length"),
    pytest.param(b"POST /search HTTP/1.1\r\nHost: t5r\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", 400,
                 "Content-Length", id="content-length-of-5000-digits"),
    pytest.param(b"DELETE /nowhere HTTP/1.1\r\nHost: t5r\r\n\r\n", 404, "no such path '/nowhere'", id="no-such-path"),
    pytest.param(b"PUT /search HTTP/1.1\r\nHost: t5r\r\nContent-Length: 0\r\n\r\n", 405,
                 "PUT is not allowed on /search; use POST", id="put"),
    pytest.param(b"GET /search HTTP/1.1\r\nHost: t5r\r\n\r\n", 405, "use POST", id="get-search"),
    pytest.param(search_head(10).replace(b"Content-Length: 10", b"Transfer-Encoding: chunked"), 411,
                 "Content-Length", id="chunked"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: t5r\r\nX-Pad: " + b"a" * (100 << 10) + b"\r\n\r\n", 431,
                 "head over 65536", id="complete-head-of-100-KB"),
])
def test_refusals_by_the_http_layer_have_json_bodies_and_close(server, request_bytes, status, fragment):
    got, headers, reply = exchange(server, request_bytes)
    assert got == status and fragment in reply["error"], (got, reply)
    assert headers["connection"] == "close", headers


class FailingHealthService(serve.SearchService):
    """A service with a bug in one path, for what the HTTP layer answers around it."""

    def health(self):
        raise RuntimeError("a bug")


def test_an_unexpected_failure_is_a_json_500_and_the_server_lives_on(kb_index):
    service = FailingHealthService(HashedBagOfWordsEncoder(dim=256), kb_index, PassageTable(KB), ["nq"])
    with serving(service) as url:
        assert get(url) == (500, {"error": "internal error: RuntimeError"})
        assert post(url, {"task": "nq", "query": "capital of France", "k": 1})[1]["results"][0]["title"] == "Paris"


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
    with serving(make_service(kb_index, encoder), workers=1, max_queued=0, warm_up=False) as url:
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
    httpd = http_server.make_server(make_service(kb_index), "127.0.0.1", 0)  # listening, not yet accepting
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


def test_the_auth_scheme_is_case_insensitive_and_credentials_are_stripped(kb_index):
    with serving(make_service(kb_index), auth_token="s3cret-token") as url:
        for value in ("bearer s3cret-token", "BEARER s3cret-token", "Bearer   s3cret-token  "):
            assert get(url, headers={"Authorization": value})[0] == 200, value
        for value in ("Basic s3cret-token", "bearers3cret-token", "Bearer s3cret-token2"):
            assert get(url, headers={"Authorization": value})[0] == 401, value


def test_a_non_loopback_host_without_a_token_is_refused_before_binding(kb_index):
    with pytest.raises(ValueError, match="reachable beyond this machine.*--auth_token_file"):
        http_server.make_server(make_service(kb_index), "0.0.0.0", 0)


class NamedTaskEncoder(HashedBagOfWordsEncoder):
    """A lexical encoder that, like a trained model, lists the tasks it was trained on."""

    task_names = ["fever", "nq"]


def test_tasks_the_model_does_not_know_are_refused_at_start(kb_index):
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['zsre'\]: this model knows \['fever', 'nq'\]"):
        serve.SearchService(NamedTaskEncoder(dim=256), kb_index, PassageTable(KB), ["nq", "zsre"])


def test_cli_refuses_an_open_host_without_a_token_and_an_empty_token_file(cli_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(http_server.TOKEN_ENV, raising=False)
    kb_dir, idx_dir = cli_dirs
    base = ["--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0"]
    assert cli.main(["serve", *base, "--host", "0.0.0.0"]) == 2
    assert "reachable beyond this machine" in capsys.readouterr().err
    empty = tmp_path / "token"
    empty.write_text("\n")
    assert cli.main(["serve", *base, "--auth_token_file", str(empty)]) == 2
    assert "the token is empty" in capsys.readouterr().err


@pytest.mark.parametrize("token, fragment", [(" \n", "the token is empty"), ("two words", "cannot carry")])
def test_cli_checks_an_environment_token_by_the_same_rule_as_a_file(cli_dirs, capsys, monkeypatch, token, fragment):
    monkeypatch.setenv(http_server.TOKEN_ENV, token)
    kb_dir, idx_dir = cli_dirs
    codes = []  # main runs in a thread: were the token accepted, it would serve and never return
    thread = threading.Thread(target=lambda: codes.append(cli.main([
        "serve", "--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq",
        "--port", "0"])), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert codes, f"t5r serve started serving with the token {token!r}"
    err = capsys.readouterr().err
    assert codes[0] == 2 and err.startswith(f"t5r serve: error: {http_server.TOKEN_ENV}: ") and fragment in err, err


def test_debug_serve_shows_the_traceback_of_a_start_up_error(cli_dirs):
    kb_dir, idx_dir = cli_dirs
    env = {k: v for k, v in os.environ.items() if k != http_server.TOKEN_ENV}
    result = subprocess.run([sys.executable, "-m", "t5_retrieval.cli", "--debug", "serve", "--lexical_baseline_dim",
                             "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0",
                             "--host", "0.0.0.0"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and "Traceback (most recent call last)" in result.stderr, result.stderr[-2000:]
    assert "reachable beyond this machine" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("source", ["file", "environment"])
def test_cli_serves_with_a_token_stripped_of_surrounding_whitespace(cli_dirs, tmp_path, source):
    kb_dir, idx_dir = cli_dirs
    env = {k: v for k, v in os.environ.items() if k != http_server.TOKEN_ENV}
    flags = []
    if source == "file":
        token_file = tmp_path / "token"
        token_file.write_text("the-token\n")
        flags = ["--auth_token_file", str(token_file)]
    else:
        env[http_server.TOKEN_ENV] = "the-token \t"
    proc = subprocess.Popen([sys.executable, "-m", "t5_retrieval.cli", "serve", "--lexical_baseline_dim", "64",
                             "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        while line.startswith("INFO:"):  # the log line on file descriptors comes first
            line = proc.stdout.readline()
        assert line.startswith("t5r serve: http://127.0.0.1:") and "bearer token required" in line, line
        url = line.split()[2].rsplit("/", 1)[0]
        assert get(url)[0] == 401
        status, reply = post(url, {"task": "nq", "query": "capital of Germany", "k": 1},
                             headers={"Content-Type": "application/json", "Authorization": "Bearer the-token"})
        assert status == 200 and reply["results"][0]["title"] == "Berlin", reply
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_names_unknown_and_known_tasks_and_does_not_serve(cli_dirs, capsys, monkeypatch):
    monkeypatch.setattr(serve_command, "encoder_from_flags", lambda args: NamedTaskEncoder(dim=64))
    kb_dir, idx_dir = cli_dirs
    codes = []  # main runs in a thread: were the tasks not checked, it would serve and never return
    thread = threading.Thread(target=lambda: codes.append(cli.main([
        "serve", "--lexical_baseline_dim", "64", "--index_dir", idx_dir, "--kb_dir", kb_dir, "--tasks", "nq,wow",
        "--port", "0"])), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert codes, "t5r serve started serving with a task the model does not know"
    code, err = codes[0], capsys.readouterr().err
    assert code == 2 and "unknown task(s) ['wow']: this model knows ['fever', 'nq']" in err, (code, err)
