"""The search service behind `t5r serve`: validated search requests in, ranked passages out.

Plain Python, no HTTP: `SearchService` turns the decoded body of `POST /search` into hits (one
`search.dense_searcher` per task, the search path of `t5r eval` and `Searcher`), and refuses bad
input with a `RequestError` (a 4xx status and a message naming the field) before it reaches the
model. The HTTP transport around it is `http_app.py` (routes, token, limits, JSON errors) on
`http_server.py` (uvicorn: connections and timeouts).

    POST /search  {"task": "fever", "query": "..." | "queries": ["...", ...], "k": 10}
      -> {"task", "k", "results": [hit, ...]}           for "query"
      -> {"task", "k", "results": [[hit, ...], ...]}    for "queries"
      hit = {"rank", "passage_id", "wikipedia_id", "title", "score"}
    GET /health   -> {"status": "ok", "passages", "dim", "fingerprint", "tasks"}

`t5r serve` (t5_retrieval/commands/serve.py) runs it over a model directory and its index.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import gin

from t5_retrieval.data.stores.passages import PassageLookup
from t5_retrieval.data.tasks.task_names import UnknownTaskError
from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval.encoder import Encoder, warn_if_trained_on_rewritten_text
from t5_retrieval.retrieval.index import Index
from t5_retrieval.retrieval.search import dense_searcher


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


MAX_INT_DIGITS = 18  # every count and size the API takes fits in 18 digits (and in an int64)


def bounded_int(text: str) -> int:
    """`int(text)` for a decimal integer from a request, refused (400) past MAX_INT_DIGITS digits
    before conversion: Python converts digit strings in quadratic time and raises a ValueError of its
    own beyond 4,300 digits, which would be a 500."""
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise RequestError(HTTPStatus.BAD_REQUEST,
                           f"a number in the request has {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


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
        tasks = [encoder.tasks.resolve(t) for t in encoder.tasks.expand(tasks)]
        # A model that names its tasks fails every query of another task: refuse them up front.
        known = encoder.task_names
        unknown = [t for t in tasks if known and t not in known]
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}: this model knows {list(known)}")
        for task in dict.fromkeys(tasks):
            warn_if_trained_on_rewritten_text(encoder, task, "the search service embeds the text of a request as "
                                              "given: send queries as those preprocessors would leave them")
        self.encoder = encoder
        self.index = index
        self.passages = passages
        self.tasks = tuple(tasks)
        self.limits = limits or ServeLimits()
        # One batch per request; requests run in threads, so encoding is locked and index search is not.
        lock = threading.Lock()
        self._searchers = {task: dense_searcher(encoder, index, task, self.limits.max_queries, lock)
                           for task in self.tasks}

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
            task = self.encoder.tasks.resolve(task)  # a dataset (fever) names the model's task for it
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
        """The top-k hits of each query, best first, with `task`'s query prefix (one of `tasks`, the model's name)."""
        found = self._searchers[task].hits(queries, k, self.passages)
        return [[{"rank": rank, "passage_id": hit.passage_id, "wikipedia_id": hit.wikipedia_id, "title": hit.title,
                  "score": hit.score} for rank, hit in enumerate(hits, start=1)] for hits in found]

    def handle_search(self, body: bytes | bytearray) -> dict[str, Any]:
        try:
            request = json.loads(body, parse_int=bounded_int)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "request body is nested too deeply") from None
        task, queries, k, single = self.parse(request)
        results = self.search(queries, k, task=task)
        return {"task": task, "k": k, "results": results[0] if single else results}
