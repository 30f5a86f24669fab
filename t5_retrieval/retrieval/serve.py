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
                     or {"status": "broken", "reason", ...} (503) once a search failed and the
                     warm-up search (`probe`) fails too, until a search succeeds again

`t5r serve` (t5_retrieval/commands/serve.py) runs it over a model directory and its index.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Generator, Sequence
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


WARM_UP_QUERY = "warm up"  # what `warm_up` and `probe` search
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

        self.broken: str | None = None  # why searches fail, if the warm-up search fails too (`probe`)

    def health(self) -> dict[str, Any]:
        """What `GET /health` answers: status "ok", or "broken" with the reason (see `probe`)."""
        status = {"status": "ok"} if self.broken is None else {"status": "broken", "reason": self.broken}
        return {**status, "passages": len(self.index), "dim": self.index.dim,
                "fingerprint": self.index.fingerprint, "tasks": list(self.tasks)}

    def warm_up(self) -> None:
        """Runs every kind of search a request can cause (each task; the most queries and results at
        once; queries of every length up to `max_query_chars`), so that whatever a search imports,
        compiles or opens on first use does so now, before the server listens: not later, when the
        machine may be out of file descriptors and an import half done stays broken. Raises what a
        search raises."""
        for task in self.tasks:
            self.search([WARM_UP_QUERY], self.limits.max_k, task=task)
        self.search([WARM_UP_QUERY] * self.limits.max_queries, self.limits.max_k, task=self.tasks[0])
        words = 1
        while words * len("warm ") <= self.limits.max_query_chars:  # every length bucket an encoder compiles
            self.search([" ".join(["warm"] * words)], 1, task=self.tasks[0])
            words += 16

    def probe(self) -> bool:
        """Searches the warm-up query: if that fails too, the service is broken (`health` says why,
        until a search succeeds again), not only the request that failed. True if it succeeded."""
        try:
            self.search([WARM_UP_QUERY], 1, task=self.tasks[0])
        except Exception as e:  # whatever a search raises: it is the reason /health reports
            self.broken = f"the warm-up search fails: {type(e).__name__}: {str(e)[:200]}".replace("\n", " ")
            return False
        self.broken = None
        return True

    def _query(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"field {field!r} must be a string")
        if not value.strip():
            raise RequestError(HTTPStatus.BAD_REQUEST, f"field {field!r} is empty")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": a half of a UTF-16 pair, not a character
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"field {field!r} is not valid text: a lone surrogate {value[e.start]!r} at character "
                               f"{e.start}") from None
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
        """The reply to one `POST /search` body, or RequestError."""
        steps = self.search_steps(body, self.limits.max_queries)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def search_steps(self, body: bytes | bytearray, per_step: int) -> Generator[None, None, dict[str, Any]]:
        """`handle_search` in steps: parsing and the first `per_step` queries, then `per_step` more
        each, yielding between them (so that a server can give its workers to other clients between
        steps); the reply is the generator's return value."""
        try:
            request = json.loads(body, parse_int=bounded_int)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"request body is not valid JSON ({e})") from None
        except RecursionError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "request body is nested too deeply") from None
        task, queries, k, single = self.parse(request)
        results: list[list[dict[str, Any]]] = []
        for start in range(0, len(queries), per_step):
            if start:
                yield
            results += self.search(queries[start:start + per_step], k, task=task)
        self.broken = None  # a search that works: whatever broke it has passed
        return {"task": task, "k": k, "results": results[0] if single else results}
