"""HTTP search API: `POST /search` (task + query -> ranked passages) and `GET /health`.

Standard library only (`selectors` + `http.server`'s request parsing): the service is one model and
one index behind a JSON endpoint, which needs no framework. Every request is validated before it
reaches the model; bad input gets a 4xx with a JSON `{"error": ...}` naming the field, and an
unexpected failure a 500, never a dead server. One selector thread reads requests and hands only
complete ones to a fixed pool of workers, so stalled or slow clients cost a socket, not a thread.

    POST /search  {"task": "fever", "query": "..." | "queries": ["...", ...], "k": 10}
      -> {"task", "k", "results": [hit, ...]}           for "query"
      -> {"task", "k", "results": [[hit, ...], ...]}    for "queries"
      hit = {"rank", "passage_id", "wikipedia_id", "title", "score"}
    GET /health   -> {"status": "ok", "passages", "dim", "fingerprint", "tasks"}

`t5r serve` (t5_retrieval/commands/serve.py) runs it over a model directory and its index.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import io
import ipaddress
import json
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

import gin
import numpy as np

from t5_retrieval.data.tasks import task_names
from t5_retrieval.data.tasks.task_names import UnknownTaskError
from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval.encoder import Encoder, model_task_name, recorded_tasks
from t5_retrieval.retrieval.index import Index
from t5_retrieval.data.stores.passages import PassageLookup

log = logging.getLogger(__name__)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """Request bounds: every request costs at most max_queries encodings and max_k results each."""

    max_k: int = 100
    default_k: int = 10
    max_queries: int = 64
    max_query_chars: int = 4096
    max_body_bytes: int = 1 << 20

    def __post_init__(self):
        if not 1 <= self.default_k <= self.max_k:
            raise ConfigError(f"ServeLimits: default_k={self.default_k} must be in [1, max_k={self.max_k}]")
        if min(self.max_queries, self.max_query_chars, self.max_body_bytes) < 1:
            raise ConfigError(f"ServeLimits: limits must be >= 1, got {self}")


class RequestError(ValueError):
    """A client error: its status (4xx) and a message naming the offending field."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class SearchService:
    """Validates search requests and answers them with one encoder, one index and the passages.

    `tasks` are the tasks requests may name, each by registered name, dataset or seqio Mixture
    (`data.task_names`); a request names one of them in any form."""

    def __init__(self, encoder: Encoder, index: Index, passages: PassageLookup, tasks: Sequence[str],
                 limits: ServeLimits | None = None):
        index.check(encoder)
        if not tasks:
            raise ValueError("SearchService needs at least one task name")
        # Any form (registered name, dataset, seqio Mixture) -> the model's own names.
        tasks = [model_task_name(encoder, t) for t in task_names.expand(recorded_tasks(encoder), tasks)]
        # A model that names its tasks fails every query of another task: refuse them up front.
        known = encoder.task_names
        unknown = [t for t in tasks if known and t not in known]
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}: this model knows {list(known)}")
        self.encoder = encoder
        self.index = index
        self.passages = passages
        self.tasks = tuple(tasks)
        self.limits = limits or ServeLimits()
        # The model object is not promised to be thread-safe; index search is, and runs unlocked.
        self._encode_lock = threading.Lock()

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "passages": len(self.index), "dim": self.index.dim,
                "fingerprint": self.index.fingerprint, "tasks": list(self.tasks)}

    def _query(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"field {field!r} must be a string")
        if not value.strip():
            raise RequestError(HTTPStatus.BAD_REQUEST, f"field {field!r} is empty")
        if len(value) > self.limits.max_query_chars:
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"field {field!r} has {len(value)} characters, more than {self.limits.max_query_chars}")
        return value

    def parse(self, request: Any) -> tuple[str, list[str], int, bool]:
        """(task, queries, k, single) from a decoded JSON request, or RequestError."""
        if not isinstance(request, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "request body must be a JSON object")
        unknown = sorted(set(request) - {"task", "query", "queries", "k"})
        if unknown:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"unknown field(s) {unknown}; expected task, query|queries, k")
        task = request.get("task")
        if not isinstance(task, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "field 'task' is required and must be a string")
        try:
            task = model_task_name(self.encoder, task)  # a dataset (fever) names the model's task for it
        except UnknownTaskError as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, str(e)) from None
        if task not in self.tasks:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"unknown task {task!r}; known tasks: {list(self.tasks)}")
        if ("query" in request) == ("queries" in request):
            raise RequestError(HTTPStatus.BAD_REQUEST, "give exactly one of 'query' and 'queries'")
        if "query" in request:
            queries, single = [self._query(request["query"], "query")], True
        else:
            raw = request["queries"]
            if not isinstance(raw, list) or not raw:
                raise RequestError(HTTPStatus.BAD_REQUEST, "field 'queries' must be a non-empty list of strings")
            if len(raw) > self.limits.max_queries:
                raise RequestError(HTTPStatus.BAD_REQUEST,
                                   f"field 'queries' has {len(raw)} entries, more than {self.limits.max_queries}")
            queries, single = [self._query(q, f"queries[{i}]") for i, q in enumerate(raw)], False
        k = request.get("k", self.limits.default_k)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.limits.max_k:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"field 'k' must be an integer in [1, {self.limits.max_k}]")
        return task, queries, k, single

    def search(self, queries: Sequence[str], k: int, *, task: str) -> list[list[dict[str, Any]]]:
        """The top-k hits of each query, best first, with `task`'s query prefix (the model's task name)."""
        with self._encode_lock:
            vectors = np.asarray(self.encoder.encode_queries(list(queries), task), np.float32)
        rows, scores = self.index.search(vectors, k)
        results = []
        for row, score in zip(rows, scores):
            hits = []
            for rank, (r, s) in enumerate(zip(row, score), start=1):
                passage = self.passages.get(self.index.passage_ids[r])
                hits.append({"rank": rank, "passage_id": passage.id, "wikipedia_id": passage.wikipedia_id,
                             "title": passage.title, "score": float(s)})
            results.append(hits)
        return results

    def handle_search(self, body: bytes) -> dict[str, Any]:
        try:
            request = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "request body is nested too deeply") from None
        task, queries, k, single = self.parse(request)
        results = self.search(queries, k, task=task)
        return {"task": task, "k": k, "results": results[0] if single else results}


LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (capped by net.core.somaxconn)
MAX_HEAD_BYTES = 64 << 10  # request line + headers
TOKEN_ENV = "T5R_SERVE_TOKEN"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Connection bounds: what a slow, stalled or flooding client can hold, and the access token.

    Requests are read by one selector thread and handed to a worker only once complete, so a
    connection that sends nothing or half a request holds a file descriptor, never a thread, and
    is closed `read_timeout_s` after it became idle (408 if it had sent part of a request).
    """

    workers: int = 8  # threads that run complete requests (parse, encode, search, reply)
    max_queued: int = 256  # complete requests waiting for a worker; one more gets 503
    read_timeout_s: float = 10.0  # to deliver a whole request, and for each write of a reply
    max_connections: int = 1024  # open connections; one more gets 503 and is closed
    auth_token: str | None = None  # if set, every request needs `Authorization: Bearer <token>`

    def __post_init__(self):
        if self.workers < 1 or self.max_queued < 0 or self.max_connections < 1 or not self.read_timeout_s > 0:
            raise ConfigError(f"ServerOptions: need workers >= 1, max_queued >= 0, max_connections >= 1 and "
                              f"read_timeout_s > 0, got workers={self.workers}, max_queued={self.max_queued}, "
                              f"max_connections={self.max_connections}, read_timeout_s={self.read_timeout_s}")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("ServerOptions: the auth token is empty")


def _response_bytes(status: HTTPStatus, payload: dict[str, Any], *headers: tuple[str, str]) -> bytes:
    """A whole `Connection: close` response, for replies the selector thread sends itself."""
    data = json.dumps(payload).encode("utf-8")
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", "Content-Type: application/json",
             f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def _head_end(buffer: bytearray) -> int:
    """Length of the request head (line + headers + blank line) in `buffer`, or -1 if incomplete."""
    end = buffer.find(b"\r\n\r\n")
    if end >= 0:
        return end + 4
    end = buffer.find(b"\n\n")
    return end + 2 if end >= 0 else -1


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` (lower case) in a raw request head, enough to know when the body
    is complete; the handler parses the head properly."""
    for line in head.split(b"\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


class _Connection:
    """A client connection and the bytes of its next request received so far."""

    def __init__(self, sock: socket.socket, address: Any, timeout_s: float):
        self.sock = sock
        self.address = address
        self.buffer = bytearray()
        self.continued = False  # "100 Continue" sent for the current request
        self.deadline = time.monotonic() + timeout_s

    def send_and_close(self, response: bytes) -> None:
        """Best effort: the socket is non-blocking, and a client that does not read loses the reply."""
        try:
            self.sock.send(response)
        except OSError:
            pass
        self.sock.close()


class _SocketWriter:
    """`wfile` for BaseHTTPRequestHandler: every write is a sendall (bounded by the socket timeout)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def write(self, data: bytes) -> int:
        self._sock.sendall(data)
        return len(data)

    def flush(self) -> None:
        pass


def _handler(service: SearchService, auth_token: str | None) -> type[BaseHTTPRequestHandler]:
    expected = None if auth_token is None else f"Bearer {auth_token}".encode("utf-8")

    class Handler(BaseHTTPRequestHandler):
        """Answers the one complete request in `connection.buffer` (read by the selector thread)."""

        server_version = "t5r-serve"
        protocol_version = "HTTP/1.1"

        def __init__(self, connection: _Connection, server: Any):
            self._connection = connection
            super().__init__(connection.sock, connection.address, server)

        def setup(self) -> None:
            self.connection = self.request
            self.rfile = io.BytesIO(bytes(self._connection.buffer))
            self.wfile = _SocketWriter(self.request)

        def handle(self) -> None:
            self.close_connection = True
            self.handle_one_request()

        def finish(self) -> None:
            # What follows this request (a pipelining client's next one) stays for the next round.
            self._connection.buffer = bytearray(self.rfile.read())

        def handle_expect_100(self) -> bool:
            return True  # the selector thread already sent "100 Continue" when the body was awaited

        def _reply(self, status: HTTPStatus, payload: dict[str, Any], *headers: tuple[str, str]) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers:
                self.send_header(key, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, status: HTTPStatus, message: str, *headers: tuple[str, str]) -> None:
            """An error reply before the body was consumed: the connection cannot be reused."""
            self.close_connection = True
            self._reply(status, {"error": message}, *headers)

        def _authorized(self) -> bool:
            given = (self.headers.get("Authorization") or "").strip().encode("utf-8", "replace")
            if expected is None or hmac.compare_digest(given, expected):
                return True
            self._refuse(HTTPStatus.UNAUTHORIZED, "this server needs 'Authorization: Bearer <token>'",
                         ("WWW-Authenticate", 'Bearer realm="t5r-serve"'))
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not self._authorized():
                return
            if self.path == "/health":
                self._reply(HTTPStatus.OK, service.health())
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; use POST /search"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                return
            if self.path != "/search":
                self._refuse(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}; use POST /search")
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._refuse(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
                return
            if length < 0 or length > service.limits.max_body_bytes:
                self._refuse(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"body of {length} bytes; the limit is {service.limits.max_body_bytes}")
                return
            body = self.rfile.read(length)
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            if content_type != "application/json":
                self._reply(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                            {"error": f"Content-Type must be application/json, got {content_type or 'none'!r}"})
                return
            try:
                self._reply(HTTPStatus.OK, service.handle_search(body))
            except RequestError as e:
                self._reply(e.status, {"error": str(e)})
            except Exception as e:  # A bug must cost one request, not the server.
                log.exception("search failed")
                self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(e).__name__}"})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            log.debug("%s - %s", self.address_string(), format % args)

    return Handler


def bind_address(host: str, port: int, auth_token: str | None) -> tuple[socket.AddressFamily, Any]:
    """Where to bind `host`; refuses, before binding, a non-loopback address without a token."""
    if not 0 <= port <= 65535:  # getaddrinfo would wrap 70000 to 4464, or blame the host for -1
        raise ConfigError(f"--port {port}: must be in 0..65535 (0 lets the OS pick a free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e}") from None
    loopback = all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
    if not loopback and auth_token is None:
        raise ConfigError(f"--host {host!r} is reachable beyond this machine: give a token with --auth_token_file "
                          f"or the {TOKEN_ENV} environment variable, or bind 127.0.0.1")
    return infos[0][0], infos[0][4]


class SearchServer:
    """An HTTP/1.1 server for one SearchService: a selector thread reads requests, a fixed pool of
    workers answers complete ones.

    Bounds (`ServerOptions`): connections, the time to deliver a request, the requests in progress
    or queued (503 beyond), the request head (431) and, in the handler, the body (413).
    """

    def __init__(self, service: SearchService, host: str = "127.0.0.1", port: int = 0,
                 options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        family, address = bind_address(host, port, self.options.auth_token)
        self.socket = socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self._handler = _handler(service, self.options.auth_token)
        self._max_body_bytes = service.limits.max_body_bytes
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self._reading: dict[socket.socket, _Connection] = {}
        self._open = 0  # connections accepted and not yet closed (reading or at a worker)
        self._in_progress = 0  # requests at a worker or queued for one
        self._lock = threading.Lock()
        self._returned: collections.deque[_Connection] = collections.deque()
        self._jobs: queue.SimpleQueue[_Connection | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        self._stopped.clear()
        self._workers = [threading.Thread(target=self._work, daemon=True, name=f"t5r-serve-{i}")
                         for i in range(self.options.workers)]
        for thread in self._workers:
            thread.start()
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=0.25):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_reader:
                        self._take_returned()
                    else:
                        self._read(key.data)
                self._expire()
        finally:
            for _ in self._workers:
                self._jobs.put(None)
            self._stopped.set()

    def shutdown(self) -> None:
        """Stops `serve_forever` (called from another thread) and waits until it has returned."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        for conn in list(self._reading.values()):
            self._close(conn)
        while self._returned:  # kept alive by a worker after the loop stopped taking them back
            self._returned.popleft().sock.close()
        self._selector.close()
        self.socket.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or closing

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. out of file descriptors: the kernel keeps the rest queued
                log.warning("accept failed: %s", e)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, address, self.options.read_timeout_s)
            with self._lock:
                full = self._open >= self.options.max_connections
                if not full:
                    self._open += 1
            if full:
                conn.send_and_close(_response_bytes(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    {"error": f"too many connections (limit {self.options.max_connections}); retry later"},
                    ("Retry-After", "1")))
                continue
            self._reading[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.buffer += data
        self._advance(conn)

    def _advance(self, conn: _Connection) -> None:
        """Hands `conn` to a worker if its buffer holds a whole request (answers 431/503 itself)."""
        head_end = _head_end(conn.buffer)
        if head_end < 0:
            if len(conn.buffer) > MAX_HEAD_BYTES:
                self._close(conn, _response_bytes(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                                  {"error": f"request head over {MAX_HEAD_BYTES} bytes"}))
            return
        head = bytes(conn.buffer[:head_end])
        raw_length = _header(head, b"content-length")
        try:
            length = int(raw_length) if raw_length is not None else 0
        except ValueError:
            length = 0  # the handler answers 411
        if 0 <= length <= self._max_body_bytes and len(conn.buffer) < head_end + length:
            expect = _header(head, b"expect")
            if expect is not None and expect.lower() == b"100-continue" and not conn.continued:
                conn.continued = True
                try:
                    conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                except OSError:
                    pass
            return
        with self._lock:
            busy = self._in_progress >= self.options.workers + self.options.max_queued
            if not busy:
                self._in_progress += 1
        if busy:
            self._close(conn, _response_bytes(
                HTTPStatus.SERVICE_UNAVAILABLE,
                {"error": f"server busy ({self.options.workers} workers, {self.options.max_queued} queued); "
                          f"retry later"}, ("Retry-After", "1")))
            return
        del self._reading[conn.sock]
        self._selector.unregister(conn.sock)
        self._jobs.put(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._reading.values() if c.deadline <= now]:
            timeout = _response_bytes(HTTPStatus.REQUEST_TIMEOUT, {
                "error": f"no complete request within {self.options.read_timeout_s:g} s"})
            self._close(conn, timeout if conn.buffer.strip() else None)

    def _close(self, conn: _Connection, response: bytes | None = None) -> None:
        if self._reading.pop(conn.sock, None) is not None:
            self._selector.unregister(conn.sock)
        if response is None:
            conn.sock.close()
        else:
            conn.send_and_close(response)
        with self._lock:
            self._open -= 1

    def _take_returned(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._returned:
            conn = self._returned.popleft()
            conn.deadline = time.monotonic() + self.options.read_timeout_s
            conn.continued = False
            conn.sock.setblocking(False)
            self._reading[conn.sock] = conn
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            if conn.buffer:
                self._advance(conn)  # a pipelined request may already be complete

    def _work(self) -> None:
        while (conn := self._jobs.get()) is not None:
            keep = False
            try:
                conn.sock.settimeout(self.options.read_timeout_s)  # bounds each write of the reply
                keep = not self._handler(conn, self).close_connection
            except OSError as e:  # the client went away or stopped reading
                log.debug("%s: %s", conn.address, e)
            except Exception:  # noqa: BLE001 (a bug must cost one connection, not a worker)
                log.exception("request handling failed")
            finally:
                with self._lock:
                    self._in_progress -= 1
            if keep and not self._stop.is_set():
                self._returned.append(conn)
                self._wake()
            else:
                conn.sock.close()
                with self._lock:
                    self._open -= 1


def make_server(service: SearchService, host: str = "127.0.0.1", port: int = 0,
                options: ServerOptions | None = None) -> SearchServer:
    """A server for `service`, bound and listening but not yet serving (port 0: the OS picks one)."""
    return SearchServer(service, host, port, options)
