"""`t5r serve`'s HTTP server: uvicorn (with h11) running the search app of `http_app.py`.

uvicorn does the HTTP/1.1 work (parsing, framing, keep-alive, pipelining, `100 Continue`, flow
control) on one asyncio event loop. This module adds the bounds a public search service needs
that uvicorn lacks, in a subclass of its h11 protocol:

- connections, in all (`max_connections`) and per client address (`max_connections_per_client`,
  so one address cannot hold every slot): one more gets 503 and is closed;
- a deadline to deliver each request (`read_timeout_s`, from the connection's start or the last
  reply): 408 and close if part of a request came, a silent close if nothing did. Slow or stalled
  clients hold a socket until then, never a thread;
- JSON bodies for the errors uvicorn answers itself (a malformed request, 400; a head that h11
  finds too long before it ends, 431);
- Nagle off on every connection (asyncio sets it only on sockets it made itself).

The subclass reads H11Protocol's per-request state (`cycle`, `conn`, `flow`), which is why
pyproject.toml allows only uvicorn's 0.54 series.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import ipaddress
import json
import socket
import sys
import threading
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from t5_retrieval.errors import ConfigError
from t5_retrieval.retrieval.http_app import (
    MAX_HEAD_BYTES,
    RETRY_AFTER,
    BodyBudget,
    WorkerPool,
    bearer_token,
    search_app,
)
from t5_retrieval.retrieval.serve import SearchService

LISTEN_BACKLOG = 1024  # connections the kernel queues before accept (capped by net.core.somaxconn)
TOKEN_ENV = "T5R_SERVE_TOKEN"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What a slow, stalled or flooding client can hold, and the access token.

    A connection that sends nothing or half a request holds a socket, never a thread, and is closed
    `read_timeout_s` after it became idle (408 if it had sent part of a request). Bodies being read
    hold at most `max_body_memory_bytes` in all; one client address holds at most its share of
    connections, `max_connections_per_client`, and of body memory, in the same proportion (but
    always room for one body of the largest size).
    """

    workers: int = 8  # threads that run complete requests (parse, encode, search)
    max_queued: int = 256  # complete requests waiting for a worker; one more gets 503
    read_timeout_s: float = 10.0  # to deliver a whole request after connecting or after a reply
    max_connections: int = 1024  # open connections; one more gets 503 and is closed
    max_connections_per_client: int = 128  # open connections from one client address; beyond, 503
    max_body_memory_bytes: int = 64 << 20  # request bodies being read or answered, all clients together
    auth_token: str | None = None  # if set, every request needs `Authorization: Bearer <token>`

    def __post_init__(self):
        if (self.workers < 1 or self.max_queued < 0 or self.max_connections < 1 or self.max_connections_per_client < 1
                or self.max_body_memory_bytes < 1 or not self.read_timeout_s > 0):
            raise ConfigError(f"ServerOptions: need workers, max_connections, max_connections_per_client and "
                             f"max_body_memory_bytes >= 1, max_queued >= 0 and read_timeout_s > 0, got {self}")
        if self.auth_token is not None:
            bearer_token(self.auth_token, "ServerOptions.auth_token")

    def body_budget(self, max_body_bytes: int) -> BodyBudget:
        """The body memory, and one address's share of it: as its share of the connections."""
        share = self.max_body_memory_bytes * min(1.0, self.max_connections_per_client / self.max_connections)
        return BodyBudget(self.max_body_memory_bytes, max(int(share), max_body_bytes))


def json_error_bytes(status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> bytes:
    """A whole `Connection: close` error response, for replies written outside a request's cycle (on
    connect, at a deadline, after h11 gave up on the request), where h11 has no response to frame."""
    body = json.dumps({"error": message}).encode("utf-8")
    lines = [f"HTTP/1.1 {status.value} {status.phrase}", "Content-Type: application/json",
             f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ConnectionCount:
    """Open connections, in all and per client address (touched only from the event loop)."""

    def __init__(self, options: ServerOptions):
        self.options = options
        self.total = 0
        self.by_client: collections.Counter[str] = collections.Counter()

    def admit(self, client: str) -> str | None:
        """Counts a new connection from `client`, or returns why it is refused."""
        if self.total >= self.options.max_connections:
            return f"too many connections (limit {self.options.max_connections}); retry later"
        if self.by_client[client] >= self.options.max_connections_per_client:
            return (f"too many connections from {client} (limit {self.options.max_connections_per_client} per "
                    f"client address); retry later")
        self.total += 1
        self.by_client[client] += 1
        return None

    def leave(self, client: str) -> None:
        self.total -= 1
        self.by_client[client] -= 1
        if not self.by_client[client]:
            del self.by_client[client]


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with connection caps, a request deadline and JSON protocol errors."""

    def __init__(self, *args: Any, connections: ConnectionCount, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._connections = connections
        self._timeout_s = connections.options.read_timeout_s
        self._counted_as: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # asyncio turns Nagle off only on sockets it made itself; with it on, a reply's head and body
        # (two writes) meet the client's delayed ACK: +40 ms on every keep-alive request.
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = self.client[0] if self.client else ""
        refusal = self._connections.admit(client)
        if refusal is not None:
            self._end(json_error_bytes(HTTPStatus.SERVICE_UNAVAILABLE, refusal, RETRY_AFTER))
            return
        self._counted_as = client
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self._counted_as is not None:
            self._connections.leave(self._counted_as)
            self._counted_as = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # the next request has `read_timeout_s` from now

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this while it handles h11's RemoteProtocolError, whose status hint tells a
        # head that grew past MAX_HEAD_BYTES without ending (431) from a malformed request (400).
        error = sys.exc_info()[1]
        if getattr(error, "error_status_hint", 400) == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            self._end(json_error_bytes(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                       f"request head over {MAX_HEAD_BYTES} bytes"))
        else:
            self._end(json_error_bytes(HTTPStatus.BAD_REQUEST, f"malformed HTTP request ({error or msg})"))

    def _arm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self._timeout_s, self._deadline_passed)

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            # The whole request is here and being answered: the server's time, not the client's,
            # unless the reply waits for a client that does not read it.
            if self.flow.write_paused:
                self.transport.abort()
            else:
                self._arm_deadline()
        elif self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            self._end()  # nothing of a request came: close without a word
        else:
            self._end(json_error_bytes(HTTPStatus.REQUEST_TIMEOUT,
                                       f"no complete request within {self._timeout_s:g} s"))

    def _end(self, reply: bytes = b"") -> None:
        """Closes the connection after `reply`; drops it at once if earlier replies are still queued
        (a client that does not read would keep it open)."""
        if self.transport.get_write_buffer_size():
            self.transport.abort()
            return
        if reply:
            self.transport.write(reply)
        self.transport.close()


def bind_address(host: str, port: int, auth_token: str | None) -> tuple[socket.AddressFamily, Any]:
    """Where to bind `host`; refuses, before binding, a non-loopback address without a token."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r} does not resolve: {e}") from None
    loopback = all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)
    if not loopback and auth_token is None:
        raise ConfigError(f"--host {host!r} is reachable beyond this machine: give a token with --auth_token_file "
                         f"or the {TOKEN_ENV} environment variable, or bind 127.0.0.1")
    return infos[0][0], infos[0][4]


class SearchServer:
    """uvicorn serving one SearchService on a socket bound when the server is made, so that the port
    is known and connections queue in the listen backlog before `serve_forever` runs."""

    def __init__(self, service: SearchService, host: str = "127.0.0.1", port: int = 0,
                 options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        family, address = bind_address(host, port, self.options.auth_token)
        self.socket = socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)
        self.server_address = self.socket.getsockname()
        self._pool = WorkerPool(self.options.workers, self.options.max_queued)
        app = search_app(service, self._pool, self.options.body_budget(service.limits.max_body_bytes),
                         self.options.auth_token)
        protocol = functools.partial(BoundedH11Protocol, connections=ConnectionCount(self.options))
        self._server = uvicorn.Server(uvicorn.Config(
            app, http=protocol, ws="none",  # type: ignore[arg-type]  # a protocol factory works as its class lifespan="off", loop="asyncio", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            headers=[("Server", "t5r-serve")], backlog=LISTEN_BACKLOG,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
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


def make_server(service: SearchService, host: str = "127.0.0.1", port: int = 0,
                options: ServerOptions | None = None) -> SearchServer:
    """A server for `service`, bound and listening but not yet serving (port 0: the OS picks one)."""
    return SearchServer(service, host, port, options)
