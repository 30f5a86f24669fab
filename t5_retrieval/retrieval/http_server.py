"""`t5r serve`'s HTTP server: uvicorn (with h11) running the search app of `http_app.py`.

uvicorn does the HTTP/1.1 work (parsing, framing, keep-alive, pipelining, `100 Continue`, flow
control) on one asyncio event loop. This module adds the bounds a public search service needs that
uvicorn lacks, in a protocol that wraps uvicorn's own and sees each connection from outside it:

- connections, in all (`max_connections`) and per address range (`max_connections_per_range`; a
  /24 for IPv4, a /64 for IPv6, as one host or one customer of a provider usually holds), so that
  neither one address nor a few of them hold every slot. When all slots are taken, a newcomer
  whose range holds at least two fewer connections than the range holding the most takes the place
  of one of the latter's connections that is not being answered (which is closed): while others
  wait, no range keeps more than they. Otherwise one more connection gets 503 and is closed;
- bodies: their memory is `http_app.BodyBudget`'s; a body its fairness rule gives up has its
  connection closed here, with 503;
- a deadline to deliver each request (`read_timeout_s`, from the connection's start or the last
  reply): 408 and close if part of a request came, a silent close if nothing did. Slow or stalled
  clients, a body that does not arrive included, hold a socket until then, never a thread;
- JSON bodies for the errors uvicorn answers itself (a malformed request, 400; a head that h11
  finds too long before it ends, 431);
- Nagle off on every connection (asyncio sets it only on sockets it made itself);
- descriptors: `max_connections` fitted to RLIMIT_NOFILE (`fit_to_descriptors`), and accept failures
  for want of them waited out quietly (`ListeningSocket`, and `_Uvicorn`, which puts an error
  handler on uvicorn's event loop before it accepts);
- a warm-up before the socket listens (`SearchServer`): nothing imported or compiled on a client's
  first request.

Where each request stands (head in, body in, reply out) comes from a small ASGI middleware around
the app (`RequestPhases`), which finds its connection by the client address and port uvicorn puts
in the scope. The wrapper drives uvicorn's protocol only through asyncio's `Protocol` methods.

The one hook beyond uvicorn's documented settings: `uvicorn.Config(http=...)` takes a protocol
class (its signature says so) and uvicorn makes one per connection with the keyword arguments
`config, server_state, app_state, _loop`; the wrapper passes them on unread to the class uvicorn
runs for `http="h11"`. No public API builds uvicorn's protocol inside another, and an accept-time
cap cannot be an ASGI middleware (a connection that sends nothing never reaches the app).
`tests/test_retrieval_serve.py` checks that class, those arguments and the callbacks it implements,
so a uvicorn release that moves them fails there; pyproject.toml allows the releases checked. (The
JSON 400 also rests on uvicorn writing that reply while it parses, inside `data_received`; the
tests of the HTTP layer's refusals fail if it stops.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import json
import logging
import os
import re
import resource
import socket
import threading
import time
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.retrieval.fair_share import FairQueue
from t5_retrieval.retrieval.http_app import (
    MAX_HEAD_BYTES,
    RETRY_AFTER,
    BodyBudget,
    bearer_token,
    rate_limited,
    search_app,
)
from t5_retrieval.retrieval.serve import WARM_UP_QUERY, SearchService

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (capped by net.core.somaxconn)
TOKEN_ENV = "T5R_SERVE_TOKEN"
UVICORN_PROTOCOL = H11Protocol  # the class uvicorn runs for `http="h11"`, wrapped by GuardedProtocol


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What a slow, stalled or flooding client, or a group of them, can hold, and the access token.

    A connection that sends nothing or half a request holds a socket, never a thread, and is closed
    `read_timeout_s` after it became idle (408 if it had sent part of a request). Connections are
    counted per address range (the IPv4 /`ipv4_range_prefix`, the IPv6 /`ipv6_range_prefix` an
    address is in), since one host or customer usually holds a whole range. Bodies hold at most
    `max_body_memory_bytes` in all, counted as their bytes arrive; one range holds at most its share
    of that memory, the same share as of the connections (but always room for one body of the
    largest size). When either is full, the range holding the most gives way to one holding less
    (`ConnectionTable`, `http_app.BodyBudget`).
    """

    workers: int = 8  # threads that run complete requests (parse, encode, search)
    max_queued: int = 256  # complete requests waiting for a worker; one more gets 503
    read_timeout_s: float = 10.0  # to deliver a whole request after connecting or after a reply
    max_connections: int = 1024  # open connections; one more gets 503 and is closed
    max_connections_per_range: int = 128  # open connections from one address range; beyond, 503
    ipv4_range_prefix: int = 24  # an IPv4 address range: the /24 the address is in
    ipv6_range_prefix: int = 64  # an IPv6 address range: the /64 the address is in
    max_body_memory_bytes: int = 64 << 20  # request bodies being read or answered, all clients together
    auth_token: str | None = None  # if set, every request needs `Authorization: Bearer <token>`

    def __post_init__(self):
        for name, (low, high) in OPTION_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ConfigError(f"ServerOptions.{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        if self.auth_token is not None:
            bearer_token(self.auth_token, "ServerOptions.auth_token")

    def address_range(self, host: str) -> str:
        """The range `host` counts in, e.g. '203.0.113.0/24'; an IPv4-mapped IPv6 address counts as IPv4."""
        try:
            address = ipaddress.ip_address(host.split("%")[0])
        except ValueError:  # not an IP address (a Unix socket): its own range
            return host
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        prefix = self.ipv4_range_prefix if address.version == 4 else self.ipv6_range_prefix
        return str(ipaddress.ip_network((address, prefix), strict=False))



# Each number's bounds: the least that can work, the most that makes sense (NaN is in no range).
OPTION_RANGES: dict[str, tuple[float, float]] = {
    "workers": (1, 1024), "max_queued": (0, 1 << 20), "read_timeout_s": (0.001, 86_400),
    "max_connections": (1, 1 << 24), "max_connections_per_range": (1, 1 << 24),
    "ipv4_range_prefix": (0, 32), "ipv6_range_prefix": (0, 128), "max_body_memory_bytes": (1, 1 << 50),
}
# Descriptors kept for what is not a connection: the listening socket, the event loop's, logs, the
# model's and index's files opened later, the store's shard a search reads (one per worker thread, two
# with a reply being written), and one more connection to refuse with 503.
DESCRIPTOR_HEADROOM = 96
ACCEPT_BATCH = 16  # connections asyncio accepts in one go (the rest wait in the listen backlog)
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # accept failures to wait out
GRACEFUL_SHUTDOWN_S = 5  # on SIGTERM, requests under way get this long to finish, then are cancelled
ACCEPT_QUIET_S = 0.5  # after one, accept is not retried for this long (asyncio retries after 1 s)


def open_descriptors() -> int:
    """File descriptors this process holds now (0 where the OS does not list them)."""
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(listing)) - 1  # less the listing's own
    return 0


def fit_to_descriptors(options: ServerOptions) -> ServerOptions:
    """`options` with `max_connections` no more than the file descriptor limit (RLIMIT_NOFILE) leaves
    beside the descriptors open now and DESCRIPTOR_HEADROOM (+ 2 per worker), after raising the soft
    limit to the hard one where allowed; says so in one log line. Past the limit, accept fails
    (EMFILE) and so does every file a search opens: the connections must run out first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    if hard != soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    held = open_descriptors()
    kept = held + DESCRIPTOR_HEADROOM + 2 * options.workers
    room = soft - kept
    limit = f"file descriptor limit {soft}" + (f" (raised from {before})" if soft != before else "")
    if room < 1:
        raise ConfigError(f"the {limit} leaves no room for connections beside the {held} open and the "
                          f"{kept - held} kept for files; start t5r serve from a shell with a higher limit, "
                          f"e.g. after `ulimit -n {kept + options.max_connections}`")
    if options.max_connections > room:
        log.warning("%s: %d open, %d kept for model, index, store and log files: at most %d connections "
                    "(--max_connections %d lowered)", limit, held, kept - held, room, options.max_connections)
        return dataclasses.replace(options, max_connections=room)
    log.info("%s: %d open, %d kept for files, %d for connections (--max_connections %d)", limit, held,
             kept - held, room, options.max_connections)
    return options


class ListeningSocket(socket.socket):
    """The listening socket, quiet when the process is out of descriptors (or memory).

    asyncio retries a failed accept a second later, but first tries the rest of its batch (up to
    the backlog) and logs each failure with a traceback: a flood of log. Here the first failure is
    raised (so asyncio waits its second), the rest of the batch look like an empty queue, and the
    failure is logged at most once every 10 s."""

    quiet_until = 0.0

    def listen(self, backlog: int = LISTEN_BACKLOG) -> None:
        """asyncio passes its `backlog` both to listen() and as the number of connections to accept in
        one go; it is given ACCEPT_BATCH, so that a burst of connections to refuse (each holds a
        descriptor until the loop closes it, an iteration later) cannot take the descriptors kept
        for files, while the kernel still queues LISTEN_BACKLOG."""
        super().listen(LISTEN_BACKLOG)

    def accept(self) -> tuple[socket.socket, Any]:
        if time.monotonic() < self.quiet_until:
            raise BlockingIOError(errno.EAGAIN, "accept paused after running out of resources")
        try:
            return super().accept()
        except OSError as e:
            if e.errno not in RESOURCE_ERRNOS:
                raise
            self.quiet_until = time.monotonic() + ACCEPT_QUIET_S
            rate_limited("accept", logging.WARNING, "cannot accept connections (%s): retrying every second",
                         os.strerror(e.errno or 0))
            raise


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's error handler: accept failures `ListeningSocket` logged are not logged again."""
    error = context.get("exception")
    if isinstance(error, OSError) and error.errno in RESOURCE_ERRNOS and "accept" in context.get("message", ""):
        return
    loop.default_exception_handler(context)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with `_quiet_accept_errors` on its event loop (set before it accepts)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(_quiet_accept_errors)
        await super().startup(sockets)


def json_error_bytes(status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole `Connection: close` error response, for replies written outside a request's cycle (on
    connect, at a deadline, after h11 gave up on the request), where h11 has no response to frame."""
    body = json.dumps({"error": message}).encode("utf-8")
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ConnectionTable:
    """Open connections by address range and by peer (touched only from the event loop), and the
    rule that admits a new one."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.total = 0
        self.by_range: dict[str, dict[GuardedProtocol, None]] = {}  # insertion-ordered: oldest first
        self.by_peer: dict[tuple[str, int], GuardedProtocol] = {}

    def admit(self, connection: GuardedProtocol) -> str | None:
        """Counts `connection`, or returns why it is refused."""
        held = len(self.by_range.get(connection.range, ()))
        if held >= self.options.max_connections_per_range:
            return (f"too many connections from {connection.range} (limit {self.options.max_connections_per_range} "
                    f"per address range); retry later")
        if self.total >= self.options.max_connections and not self._make_room(held):
            return f"too many connections (limit {self.options.max_connections}); retry later"
        self.total += 1
        self.by_range.setdefault(connection.range, {})[connection] = None
        self.by_peer[connection.peer] = connection
        return None

    def _make_room(self, held: int) -> bool:
        """Closes one connection not being answered of the largest range holding at least `held` + 2
        (ranges that hold one more than the newcomer's would only trade places with it)."""
        for connections in sorted(self.by_range.values(), key=len, reverse=True):
            if len(connections) < held + 2:
                return False
            victim = next((c for c in connections if not c.answering), None)
            if victim is not None:
                self.leave(victim)
                victim.yield_slot()
                return True
        return False

    def close_for_memory(self, peer: tuple[str, int]) -> None:
        """Closes the connection of a body the body memory's fairness rule gave up (if still open)."""
        connection = self.by_peer.get(peer)
        if connection is not None:
            connection.give_up_body()

    def leave(self, connection: GuardedProtocol) -> None:
        connections = self.by_range[connection.range]
        del connections[connection]
        if not connections:
            del self.by_range[connection.range]
        del self.by_peer[connection.peer]
        self.total -= 1


class UvicornTransport:
    """The transport as uvicorn's protocol sees it. What it writes while it parses (inside
    `data_received`) is its own plain-text reply to a request h11 refused; that is held back, and
    the guard answers in JSON instead. Everything else goes to the socket's transport."""

    def __init__(self, transport: asyncio.Transport, guard: GuardedProtocol):
        self._transport = transport
        self._guard = guard

    def write(self, data: bytes) -> None:
        if self._guard.parsing:
            self._guard.refused_by_parser = True
        else:
            self._transport.write(data)

    def close(self) -> None:
        if self._guard.parsing:
            self._guard.refused_by_parser = True
        else:
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedProtocol(asyncio.Protocol):
    """One connection: admitted by its range (`ConnectionTable`), held to its request deadline, and
    otherwise served by uvicorn's h11 protocol, which gets every asyncio callback passed on."""

    def __init__(self, table: ConnectionTable, **uvicorn_arguments: Any):
        self._inner = UVICORN_PROTOCOL(**uvicorn_arguments)
        self._table = table
        self._timeout_s = table.options.read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.peer: tuple[str, int] = ("", 0)
        self.range = ""
        self.admitted = False
        self.answering = False  # a whole request is in, its reply not yet written: the server's time
        self.request_started = False  # the current request's head is in
        self.received = 0  # bytes since the connection started or the last reply
        self.parsing = False  # inside uvicorn's data_received
        self.refused_by_parser = False
        self._write_paused = False
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        # asyncio turns Nagle off only on sockets it made itself; with it on, a reply's head and body
        # (two writes) meet the client's delayed ACK: +40 ms on every keep-alive request.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername") or ("", 0)
        self.peer = (str(peer[0]), int(peer[1]))  # as uvicorn puts it in scope["client"]
        self.range = self._table.options.address_range(self.peer[0])
        refusal = self._table.admit(self)
        if refusal is not None:
            self._end(json_error_bytes(HTTPStatus.SERVICE_UNAVAILABLE, refusal, RETRY_AFTER))
            return
        self.admitted = True
        self._inner.connection_made(UvicornTransport(transport, self))  # type: ignore[arg-type]
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        self.received += len(data)
        self.parsing = True
        try:
            self._inner.data_received(data)
        finally:
            self.parsing = False
        if self.refused_by_parser:
            self._refuse_malformed()

    def eof_received(self) -> bool | None:
        if self.admitted:
            self._inner.eof_received()
        return None  # close the transport, as uvicorn's protocol does

    def pause_writing(self) -> None:
        self._write_paused = True
        if self.admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.admitted:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self.admitted:
            if self._table.by_peer.get(self.peer) is self:
                self._table.leave(self)
            self._inner.connection_lost(exc)

    def request_complete(self) -> None:
        """The whole request is in: until its reply is written, the time is the server's."""
        self.answering = True

    def response_complete(self) -> None:
        """The reply is written: the next request has `read_timeout_s` from now."""
        self.answering = self.request_started = False
        self.received = 0
        if self.transport is not None and not self.transport.is_closing():
            self._arm_deadline()

    def yield_slot(self) -> None:
        """Closed to make room for a connection of a range that holds fewer (see ConnectionTable)."""
        self._end(json_error_bytes(HTTPStatus.SERVICE_UNAVAILABLE, "the server is full and your address range "
                                   "holds the most connections; retry later", RETRY_AFTER) if self.received else b"")

    def give_up_body(self) -> None:
        """Closed to make room in the body memory for a range that holds less (see BodyBudget)."""
        self._end(json_error_bytes(HTTPStatus.SERVICE_UNAVAILABLE, "the server's body memory is full and your "
                                   "address range holds the most of it; retry later", RETRY_AFTER))

    def _refuse_malformed(self) -> None:
        # h11 refuses a head still incomplete after MAX_HEAD_BYTES (431) or a malformed request (400).
        if not self.request_started and self.received > MAX_HEAD_BYTES:
            self._end(json_error_bytes(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                       f"request head over {MAX_HEAD_BYTES} bytes"))
        else:
            self._end(json_error_bytes(HTTPStatus.BAD_REQUEST, "malformed HTTP request: it needs a request line, "
                                       "a Host header and at most one valid Content-Length"))

    def _arm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = asyncio.get_running_loop().call_later(self._timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        assert self.transport is not None
        if self.transport.is_closing():
            return
        if self.answering:
            # The server's time, unless the reply waits for a client that does not read it.
            if self._write_paused:
                self.transport.abort()
            else:
                self._arm_deadline()
        elif not self.received:
            self._end()  # nothing of a request came: close without a word
        else:
            self._end(json_error_bytes(HTTPStatus.REQUEST_TIMEOUT, f"no complete request within {self._timeout_s:g} s"))

    def _end(self, reply: bytes = b"") -> None:
        """Closes the connection after `reply`; drops it at once if earlier replies are still queued
        (a client that does not read would keep it open)."""
        assert self.transport is not None
        if self.transport.get_write_buffer_size():
            self.transport.abort()
            return
        if reply:
            self.transport.write(reply)
        self.transport.close()


def body_budget(options: ServerOptions, max_body_bytes: int, table: ConnectionTable) -> BodyBudget:
    """The body memory, and one range's share of it: as its share of the connections. A body the
    fairness rule gives up has its connection closed with 503."""
    share = options.max_body_memory_bytes * min(1.0, options.max_connections_per_range / options.max_connections)
    return BodyBudget(options.max_body_memory_bytes, max(int(share), max_body_bytes), options.address_range,
                      table.close_for_memory)


def _expects_body(scope: Scope) -> bool:
    headers = dict(scope["headers"])
    return b"transfer-encoding" in headers or headers.get(b"content-length", b"0").strip() not in (b"0", b"")


class RequestPhases:
    """ASGI middleware telling each request's connection when the request is wholly in and when
    its reply is written: the deadline measures the client's time, not the server's."""

    def __init__(self, app: ASGIApp, table: ConnectionTable):
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        connection = self.table.by_peer.get(tuple(client)) if scope["type"] == "http" and client else None
        if connection is None:
            return await self.app(scope, receive, send)
        connection.request_started = True
        if not _expects_body(scope):
            connection.request_complete()

        async def receive_tracked() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                connection.request_complete()
            return message

        async def send_tracked(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                connection.response_complete()

        await self.app(scope, receive_tracked, send_tracked)


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_host(host: str) -> None:
    """Refuses (one line) a --host that is neither an IP address nor a DNS name (RFC 1123 labels)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host.split("%")[0])
        return
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(f"--host {host!r} is neither an IP address nor a host name (letters, digits and "
                          "inner hyphens, in labels of 1-63 separated by single dots)")


def check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"--port {port!r} is not a TCP port: give one in [1, 65535], or 0 for any free port")


def bind_address(host: str, port: int, auth_token: str | None) -> tuple[socket.AddressFamily, Any]:
    """Where to bind `host`; refuses, before binding, a malformed host or port, and a non-loopback
    address without a token."""
    check_host(host)
    check_port(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e}") from None
    loopback = all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)
    if not loopback and auth_token is None:
        raise ConfigError(f"--host {host!r} is reachable beyond this machine: give a token with --auth_token_file "
                         f"or the {TOKEN_ENV} environment variable, or bind 127.0.0.1")
    return infos[0][0], infos[0][4]


class SearchServer:
    """uvicorn serving one SearchService on a socket bound when the server is made, so that the port
    is known and connections queue in the listen backlog before `serve_forever` runs.

    Before it binds, it searches once of every kind (`SearchService.warm_up`) and answers one
    request of each route in process (`warm_up`): what a request imports, compiles or opens on first
    use is done then, not when the machine may be out of descriptors; then it sizes
    `max_connections` to the descriptors left (`fit_to_descriptors`). A warm-up that fails stops it."""

    def __init__(self, service: SearchService, host: str = "127.0.0.1", port: int = 0,
                 options: ServerOptions | None = None, warm_up: bool = True):
        options = options or ServerOptions()
        family, address = bind_address(host, port, options.auth_token)
        self._pool = FairQueue(options.workers, options.max_queued)
        table = ConnectionTable(options)
        self.bodies = body_budget(options, service.limits.max_body_bytes, table)  # event loop only
        app = RequestPhases(search_app(service, self._pool, self.bodies, options.auth_token, options.address_range),
                            table)
        if warm_up:
            try:
                service.warm_up()
            except Exception as e:  # whatever a search raises: nothing can be served
                raise UserError(f"the warm-up search fails ({type(e).__name__}: {str(e)[:300]}); this model, index "
                                "and store cannot answer searches, so nothing is served") from e
            warm_up_app(app, service, options.auth_token)
        self.options = table.options = fit_to_descriptors(options)
        listening = socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)
        self.socket = ListeningSocket(listening.family, listening.type, listening.proto, fileno=listening.detach())
        self.server_address = self.socket.getsockname()
        self._server = _Uvicorn(uvicorn.Config(
            app, http=functools.partial(GuardedProtocol, table),  # type: ignore[arg-type]
            ws="none", lifespan="off", loop="asyncio", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            headers=[("Server", "t5r-serve")], backlog=ACCEPT_BATCH,  # see ListeningSocket.listen
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            # An idle connection's deadline too; uvicorn hands it to call_later, which takes a float.
            timeout_keep_alive=self.options.read_timeout_s))  # type: ignore[arg-type]
        self._stopped = threading.Event()

    def serve_forever(self) -> None:
        """Serves until `shutdown` (from another thread) or, in the main thread, SIGINT/SIGTERM,
        which uvicorn turns into a graceful stop and then raises again."""
        self._stopped.clear()
        try:
            self._server.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stops `serve_forever` (called from another thread) and waits until it has returned."""
        self._server.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self._pool.close()
        self.socket.close()


def warm_up_app(app: ASGIApp, service: SearchService, token: str | None) -> None:
    """Answers, in process, one request of each kind the routes handle (a search, a refused one,
    /health, an unknown path), so that every module and code path they use has run once."""
    auth = [(b"authorization", f"Bearer {token}".encode())] if token else []
    body = json.dumps({"task": service.tasks[0], "query": WARM_UP_QUERY}).encode()
    json_head = [(b"content-type", b"application/json"), *auth]
    requests = [("POST", "/search", [*json_head, (b"content-length", str(len(body)).encode())], body),
                ("POST", "/search", [*json_head, (b"content-length", b"1")], b"{"),
                ("GET", "/health", auth, b""), ("GET", "/nowhere", auth, b"")]

    async def run(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"t5r"), *headers], "client": ("127.0.0.1", 0),
                 "server": ("127.0.0.1", 0)}
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> Message:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            pass

        await app(scope, receive, send)

    async def run_all() -> None:
        for request in requests:
            with contextlib.suppress(Exception):  # the statuses do not matter here, the code paths do
                await run(*request)

    asyncio.run(run_all())


def make_server(service: SearchService, host: str = "127.0.0.1", port: int = 0,
                options: ServerOptions | None = None, warm_up: bool = True) -> SearchServer:
    """A server for `service`, warmed up (see SearchServer), bound and listening but not yet serving
    (port 0: the OS picks one)."""
    return SearchServer(service, host, port, options, warm_up)
