"""HTTP search API: `POST /search` (task + query -> ranked passages) and `GET /health`.

Standard library only (`http.server.ThreadingHTTPServer`): the service is one model and one
index behind a JSON endpoint, which needs no framework. Every request is validated before it
reaches the model; bad input gets a 4xx with a JSON `{"error": ...}` naming the field, and an
unexpected failure a 500, never a dead server.

    POST /search  {"task": "fever", "query": "..." | "queries": ["...", ...], "k": 10}
      -> {"task", "k", "results": [hit, ...]}           for "query"
      -> {"task", "k", "results": [[hit, ...], ...]}    for "queries"
      hit = {"rank", "passage_id", "wikipedia_id", "title", "score"}
    GET /health   -> {"status": "ok", "passages", "dim", "fingerprint", "tasks"}

`t5r serve --index_dir=... --kb_dir=... --tasks=fever,wow (--checkpoint_dir=... | --lexical_baseline_dim=N)`
binds 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import gin
import numpy as np

from t5_retrieval import logs
from t5_retrieval.data.task_names import UnknownTaskError
from t5_retrieval.retrieval.encoder import Encoder, model_task_name
from t5_retrieval.retrieval.index import Index
from t5_retrieval.data.passages import PassageLookup

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
            raise ValueError(f"ServeLimits: default_k={self.default_k} must be in [1, max_k={self.max_k}]")
        if min(self.max_queries, self.max_query_chars, self.max_body_bytes) < 1:
            raise ValueError(f"ServeLimits: limits must be >= 1, got {self}")


class RequestError(ValueError):
    """A client error: its status (4xx) and a message naming the offending field."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


class SearchService:
    """Validates search requests and answers them with one encoder, one index and the passages."""

    def __init__(self, encoder: Encoder, index: Index, passages: PassageLookup, tasks: Sequence[str],
                 limits: ServeLimits | None = None):
        index.check(encoder)
        if not tasks:
            raise ValueError("SearchService needs at least one task name")
        self.encoder = encoder
        self.index = index
        self.passages = passages
        self.tasks = tuple(tasks)
        self.limits = limits or ServeLimits()
        # The model object is not promised to be thread-safe; ScaNN search is, and runs unlocked.
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

    def search(self, task: str, queries: Sequence[str], k: int) -> list[list[dict[str, Any]]]:
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
        task, queries, k, single = self.parse(request)
        results = self.search(task, queries, k)
        return {"task": task, "k": k, "results": results[0] if single else results}


def _handler(service: SearchService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "t5r-serve"
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, keep-alive clients would wait
        # for a delayed ACK (~40 ms) on every response.
        disable_nagle_algorithm = True

        def _reply(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._reply(HTTPStatus.OK, service.health())
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; use POST /search"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/search":
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such path {self.path!r}; use POST /search"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self.close_connection = True
                self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "a Content-Length header is required"})
                return
            if length < 0 or length > service.limits.max_body_bytes:
                self.close_connection = True
                self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            {"error": f"body of {length} bytes; the limit is {service.limits.max_body_bytes}"})
                return
            body = self.rfile.read(length)
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


def make_server(service: SearchService, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A threaded HTTP server for `service`, bound but not yet serving (port 0: the OS picks one)."""
    server = ThreadingHTTPServer((host, port), _handler(service))
    server.daemon_threads = True
    return server


def main(argv: list[str]) -> int:
    """`t5r serve`: HTTP search over an index with a query encoder."""
    from t5_retrieval import gin_utils
    from t5_retrieval.data.kb import PassageStore
    from t5_retrieval.data.records import DataError
    from t5_retrieval.commands.inputs import add_encoder_flags, encoder_from_flags
    from t5_retrieval.retrieval.index import IndexMismatchError

    parser = argparse.ArgumentParser(prog="t5r serve", description=__doc__.splitlines()[0])
    add_encoder_flags(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--kb_dir", required=True, help="passage store the index was built from")
    parser.add_argument("--tasks", default="",
                        help="comma-separated task names queries may use (default: the model's `task_names`)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="0 lets the OS pick a free port")
    args = gin_utils.parse_args(parser, argv)
    logs.setup()
    try:
        store = PassageStore.open(args.kb_dir)
        index = Index.load(args.index_dir)
        encoder = encoder_from_flags(args)
        index.check(encoder, store.ids())
        tasks = ([model_task_name(encoder, t) for t in args.tasks.split(",") if t]
                 or list(getattr(encoder, "task_names", [])))
        if not tasks:
            raise ValueError("--tasks is required: this encoder does not list its task names")
        service = SearchService(encoder, index, store, tasks, ServeLimits())
    except (DataError, IndexMismatchError, ValueError) as e:
        print(f"t5r serve: error: {e}", file=sys.stderr)
        return 2
    server = make_server(service, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"t5r serve: http://{host}:{port}/search ({len(index)} passages, tasks {list(service.tasks)})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
