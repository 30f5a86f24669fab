"""The HTTP face of the search service: a Starlette app for `POST /search` and `GET /health`.

What is HTTP here and not search: the bearer token, the request head and body limits, the memory
that bodies being read may hold, the worker threads the model runs on, and an `{"error": ...}` JSON
body for every error, the framework's own (404, 405, 500) included. Connections (how many, how
long) are the server's, `http_server.py`.

A request is refused as early as it can be: a head over MAX_HEAD_BYTES (431) and a missing or
wrong token (401) before routing; a missing Content-Length (411), a body over
`ServeLimits.max_body_bytes` (413), a Content-Type that is not JSON (415) and a body that would
not fit beside the bytes bodies hold now (503) before the body is read; a body whose bytes, as they
arrive, no longer fit the memory budget (503) while it is read. Those replies close the connection,
since the unread body would otherwise be read and thrown away. Only a complete body takes a worker
thread, in steps that wait in its address range's queue (`fair_share.FairQueue`: 503 when all
workers are busy and `max_queued` requests wait). `GET /health` is 503 with the reason while the
service is broken (`SearchService.probe`); errors a broken service repeats are logged at most once
every 10 s (`RateLimitedLog`). Paths are matched as written: no
redirect (Starlette's for a trailing slash would point at the request's Host, which the client
chooses).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Generator, Iterator
from http import HTTPStatus
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval.fair_share import QUERIES_PER_STEP, FairQueue, Refused
from t5_retrieval.retrieval.serve import RequestError, SearchService, bounded_int

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 << 10  # request line + headers
RETRY_AFTER = {"Retry-After": "1"}
CLOSE = {"Connection": "close"}
# RFC 6750's b64token: what can follow "Bearer " in an Authorization header, so a token a client
# can send at all.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def bearer_token(text: str, source: str) -> str:
    """The token in `text` (from a file, the environment or a client) with surrounding whitespace
    stripped, or ValueError naming `source`: one rule for every place a token comes from."""
    token = text.strip()
    if not token:
        raise ConfigError(f"{source}: the token is empty")
    if not _TOKEN.fullmatch(token):
        raise ConfigError(f"{source}: the token has characters a bearer token cannot carry; use letters, digits "
                         "and - . _ ~ + / (then = at the end), e.g. `head -c 24 /dev/urandom | base64`")
    return token


def authorized(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token`: the scheme is case-insensitive (RFC 7235),
    the credentials are stripped as every token is, and compared in constant time."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode())


def error_reply(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers)


def head_bytes(scope: Scope) -> int:
    """Bytes of the request line and headers as parsed (h11 has dropped only optional whitespace)."""
    target = len(scope["raw_path"]) + (1 + len(scope["query_string"]) if scope["query_string"] else 0)
    line = len(scope["method"]) + 1 + target + len(" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


class RequestGate:
    """ASGI middleware that refuses, before any routing, a head over MAX_HEAD_BYTES (431) and a
    request without the token (401, on every path: /health names the model). h11 itself bounds only
    an incomplete head; a complete one of any size reaches this gate."""

    def __init__(self, app: ASGIApp, token: str | None):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if head_bytes(scope) > MAX_HEAD_BYTES:
                reply = error_reply(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                    f"request head over {MAX_HEAD_BYTES} bytes", CLOSE)
                return await reply(scope, receive, send)
            if self.token is not None and not authorized(Headers(scope=scope).get("authorization"), self.token):
                reply = error_reply(HTTPStatus.UNAUTHORIZED, "this server needs 'Authorization: Bearer <token>'",
                                    {"WWW-Authenticate": 'Bearer realm="t5r-serve"', **CLOSE})
                return await reply(scope, receive, send)
        await self.app(scope, receive, send)


class BodyRead:
    """One body being read or answered: its client, address range and the bytes it has delivered."""

    def __init__(self, peer: tuple[str, int], where: str):
        self.peer, self.where = peer, where
        self.taken = 0
        self.reading = True  # False once whole: it is being answered and soon gone
        self.evicted = False


class BodyBudget:
    """Bytes of request bodies being read or answered, bounded in all (`total`) and per address
    range (`per_range`, `range_of` a client's host), so that neither many bodies nor one range's
    bodies can take the memory. Bytes are counted as they arrive, not as a Content-Length
    declares them: a client that declares a large body and sends little holds little, and the
    request deadline closes it (releasing what it holds) if the rest does not come.

    The fairness rule, as for connections: when a range's next bytes do not fit in all, the range
    holding the most, if it holds more than the newcomer's will, gives up its largest body still
    being read (`close` ends that client's connection with 503), until they fit. A group that sends
    real bytes and stalls cannot keep others out either."""

    def __init__(self, total: int, per_range: int, range_of: Callable[[str], str],
                 close: Callable[[tuple[str, int]], None]):
        self.total, self.per_range, self.range_of, self.close = total, per_range, range_of, close
        self.held = 0
        self.by_range: collections.Counter[str] = collections.Counter()
        self._reads: dict[BodyRead, None] = {}

    def check_room(self, client: tuple[str, int], size: int) -> None:
        """Refuses (HTTPException 503), before it is read, a body of `size` bytes that would not fit
        beside the bytes held now, even by the fairness rule; it reserves nothing, so a declared size
        alone holds no memory."""
        self._victims(self.range_of(client[0]), size)

    @contextlib.contextmanager
    def account(self, client: tuple[str, int]) -> Iterator[BodyRead]:
        """The body of `client`'s request, to `take` its bytes into (all in one event loop: no
        lock); what it took is released when the block ends."""
        body = BodyRead(client, self.range_of(client[0]))
        self._reads[body] = None
        try:
            yield body
        finally:
            self._release(body)

    def take(self, body: BodyRead, n: int) -> None:
        """Counts `n` more bytes of `body`, after closing the bodies the fairness rule gives up, or
        raises HTTPException 503 (also for a body given up, whose connection is closing)."""
        if body.evicted:
            raise self._full()
        for victim in self._victims(body.where, n):
            self._release(victim)
            victim.evicted = True
            self.close(victim.peer)
        self.held += n
        self.by_range[body.where] += n
        body.taken += n

    def done_reading(self, body: BodyRead) -> None:
        body.reading = False

    def _victims(self, where: str, n: int) -> list[BodyRead]:
        """The bodies to give up so that `n` more bytes of `where` fit, or HTTPException 503."""
        if self.by_range[where] + n > self.per_range:
            raise self._full()
        excess = self.held + n - self.total
        held = dict(self.by_range)
        mine = held.get(where, 0) + n
        victims: list[BodyRead] = []
        while excess > 0:
            richest = max((b for b in self._reads if b.reading and b.taken and held[b.where] > mine
                           and b not in victims), key=lambda b: (held[b.where], b.taken), default=None)
            if richest is None:
                raise self._full()
            victims.append(richest)
            held[richest.where] -= richest.taken
            excess -= richest.taken
        return victims

    def _release(self, body: BodyRead) -> None:
        self._reads.pop(body, None)
        self.held -= body.taken
        self.by_range[body.where] -= body.taken
        body.taken = 0
        if not self.by_range[body.where]:
            del self.by_range[body.where]

    def _full(self) -> HTTPException:
        return HTTPException(HTTPStatus.SERVICE_UNAVAILABLE,
                             f"request bodies in progress fill the server's body memory ({self.total} bytes, "
                             f"{self.per_range} per address range); retry later", {**RETRY_AFTER, **CLOSE})


async def read_body(request: Request, bodies: BodyBudget, body: BodyRead) -> bytearray:
    """The whole body, each chunk counted in `bodies` as it arrives (uvicorn stops reading a body
    past 64 KiB the app has not taken, so at most one read of 256 KiB more waits uncounted).
    ClientDisconnect if the client leaves or its deadline passes first."""
    data = bytearray()
    async for chunk in request.stream():
        bodies.take(body, len(chunk))
        data += chunk
    bodies.done_reading(body)
    return data


def _content_length(request: Request, limit: int) -> int:
    """The declared size of the body, before it is read; refuses one over `limit`, a missing length
    and a chunked body (whose framing h11 would follow even beside a Content-Length)."""
    raw = request.headers.get("content-length")
    if raw is None or "transfer-encoding" in request.headers:
        raise HTTPException(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required (and no "
                            "Transfer-Encoding)", CLOSE)
    length = bounded_int(raw)  # h11 has checked the digits
    if length > limit:
        raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {length} bytes; the limit is {limit}",
                            CLOSE)
    return length


def _client(request: Request) -> tuple[str, int]:
    return (request.client.host, request.client.port) if request.client else ("", 0)


def _require_json(request: Request) -> None:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise HTTPException(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                            f"Content-Type must be application/json, got {content_type or 'none'!r}", CLOSE)


class RateLimitedLog:
    """Logs a kind of event at most once per `every_s` seconds, with how many were not logged since:
    a server out of file descriptors, or with a broken model, meets the same error on every accept
    or request, and must not fill the disk with it."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, float] = {}
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # worker threads and the event loop both log

    def __call__(self, kind: str, level: int, message: str, *args: Any, exc_info: bool = False) -> bool:
        """Logs `message % args` unless `kind` was logged less than `every_s` ago; True if logged."""
        with self._lock:
            now = self.clock()
            if now - self._last.get(kind, -math.inf) < self.every_s:
                self._unlogged[kind] += 1
                return False
            self._last[kind] = now
            unlogged = self._unlogged.pop(kind, 0)
        suffix = f" ({unlogged} more like it in the last {self.every_s:g} s not logged)" if unlogged else ""
        self.logger.log(level, message + suffix, *args, exc_info=exc_info)
        return True


rate_limited = RateLimitedLog(log)


def json_bytes(reply: Any) -> bytes:
    """A reply as Starlette's JSONResponse renders it, made on a worker thread (a reply of 64 x 100
    hits takes milliseconds to render: not on the event loop, which every connection shares)."""
    return json.dumps(reply, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def answer_step(service: SearchService, steps: Generator[None, None, dict[str, Any]]) -> tuple[int, bytes] | None:
    """Runs one step of a search on a worker thread: None if more remain, else (status, JSON reply)."""
    try:
        try:
            next(steps)
            return None
        except StopIteration as done:
            return HTTPStatus.OK, json_bytes(done.value)  # inside the outer try: a reply that cannot render is a 500
    except RequestError as e:
        return e.status, json_bytes({"error": str(e)})
    except Exception as e:  # A bug must cost one request, not the server.
        rate_limited("search failed", logging.ERROR, "search failed", exc_info=True)
        if not service.probe():  # the warm-up search fails too: /health says so
            rate_limited("broken", logging.ERROR, "the search service is broken: %s", service.broken)
        return HTTPStatus.INTERNAL_SERVER_ERROR, json_bytes({"error": f"internal error: {type(e).__name__}"})


PROBE_EVERY_S = 2.0  # a broken service's /health searches again at most this often, to see it recover


def search_app(service: SearchService, pool: FairQueue, bodies: BodyBudget, token: str | None,
               range_of: Callable[[str], str] = str) -> Starlette:
    """The ASGI app serving `service`: routes, the token, the limits and JSON errors. Worker time
    goes to address ranges (`range_of` a client's host) by `pool`'s fairness rule."""
    last_probe = [-math.inf]

    @contextlib.contextmanager
    def admitted(request: Request) -> Iterator[Any]:
        """A request's place in `pool` (503 if there is none, or if it is given up for another range's)."""
        try:
            job = pool.begin(range_of(_client(request)[0]))
        except Refused as e:
            raise HTTPException(HTTPStatus.SERVICE_UNAVAILABLE, str(e), RETRY_AFTER) from None
        try:
            yield job
        except Refused as e:
            raise HTTPException(HTTPStatus.SERVICE_UNAVAILABLE, str(e), RETRY_AFTER) from None
        finally:
            pool.end(job)

    async def health(request: Request) -> Response:
        if service.broken is not None and time.monotonic() - last_probe[0] >= PROBE_EVERY_S:
            last_probe[0] = time.monotonic()  # broken: search again (on a worker) to see whether it recovered
            with admitted(request) as job:
                await pool.run(job, service.probe)
        return JSONResponse(service.health(),
                            HTTPStatus.OK if service.broken is None else HTTPStatus.SERVICE_UNAVAILABLE)

    async def search(request: Request) -> Response:
        try:
            length = _content_length(request, service.limits.max_body_bytes)
        except RequestError as e:
            return error_reply(e.status, str(e), CLOSE)
        _require_json(request)
        client = _client(request)
        bodies.check_room(client, length)
        with bodies.account(client) as body_read:
            try:
                body = await read_body(request, bodies, body_read)
            except ClientDisconnect:  # The client left, or the server timed it out: this reply is never sent.
                return Response(status_code=HTTPStatus.REQUEST_TIMEOUT)
            with admitted(request) as job:
                steps = service.search_steps(body, QUERIES_PER_STEP)
                while (done := await pool.run(job, answer_step, service, steps)) is None:
                    if await request.is_disconnected():  # nobody waits for the rest: give the workers to others
                        return Response(status_code=HTTPStatus.REQUEST_TIMEOUT)
        status, reply = done
        return Response(reply, status, media_type="application/json")

    async def http_error(request: Request, error: Exception) -> Response:
        """Starlette's own refusals (404, 405) and ours, as JSON; the unread body closes the connection."""
        assert isinstance(error, HTTPException)
        message = error.detail
        if error.status_code == HTTPStatus.NOT_FOUND:
            message = f"no such path {request.url.path!r}; use POST /search or GET /health"
        elif error.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            allowed = (error.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allowed}"
        return error_reply(error.status_code, message, {**CLOSE, **(error.headers or {})})

    async def internal_error(request: Request, error: Exception) -> Response:
        # Starlette re-raises the error after this reply, and uvicorn logs its traceback.
        return error_reply(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(error).__name__}", CLOSE)

    app = Starlette(routes=[Route("/search", search, methods=["POST"]), Route("/health", health, methods=["GET"])],
                    middleware=[Middleware(RequestGate, token=token)],
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    # Starlette answers `/health/` with a redirect to a URL built from the request's Host header,
    # which a client chooses: a path is served as written or not at all (404).
    app.router.redirect_slashes = False
    return app
