"""`t5r serve`: HTTP search (`retrieval/serve.py`) over a model directory and its index.

`t5r serve --index_dir=... --kb_dir=... --tasks=fever,wow (--checkpoint_dir=... | --lexical_baseline_dim=N)`
binds 127.0.0.1 unless --host says otherwise; any other address needs a bearer token.
"""

from __future__ import annotations

import argparse
import os
import socket

from t5_retrieval import checksums, logs
from t5_retrieval.commands.checksum import add_verify_flag
from t5_retrieval.commands.gin_flags import TASK_MODULE, parse_args
from t5_retrieval.commands.inputs import (
    add_encoder_flags,
    add_task_module_flag,
    encoder_from_flags,
    import_task_modules,
)
from t5_retrieval.errors import ConfigError, UserError
from t5_retrieval.retrieval.http_app import bearer_token
from t5_retrieval.retrieval.http_server import (
    OPTION_RANGES,
    TOKEN_ENV,
    ServerOptions,
    bind_address,
    make_server,
)
from t5_retrieval.retrieval.index import load_index
from t5_retrieval.retrieval.serve import SearchService, ServeLimits


def _auth_token(path: str | None) -> str | None:
    """The token from --auth_token_file, else from $T5R_SERVE_TOKEN, else None (a file or the
    environment, not a flag value: command lines are visible to every user of the machine). Both
    are stripped and checked by the one rule for tokens, `bearer_token`."""
    from_env = os.environ.get(TOKEN_ENV)
    if path is not None and from_env is not None:
        raise ConfigError(f"give the token either with --auth_token_file or with {TOKEN_ENV}, not both")
    if path is None:
        return None if from_env is None else bearer_token(from_env, TOKEN_ENV)
    try:
        with open(path, encoding="utf-8") as f:
            return bearer_token(f.read(), f"--auth_token_file {path}")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--auth_token_file: {e}") from None


def _check_listenable(host: str, port: int, auth_token: str | None) -> None:
    """Refuses an open address without a token, and a port another program listens on."""
    family, address = bind_address(host, port, auth_token)
    if port == 0:
        return
    try:
        with socket.create_server(address[:2], family=family):
            pass
    except OSError as e:
        raise UserError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); another server "
                        "probably uses it: stop it or choose another --port") from None


MAX_BODY_MEMORY_MB = (1 / 1024, float(1 << 30))  # 1 KiB .. 1 PiB


def _checked(flag: str, value: float, low: float, high: float) -> float:
    """`value` of `--flag`, or a one-line UserError if it is outside [low, high] (NaN is outside every range)."""
    if not low <= value <= high:
        raise UserError(f"--{flag} {value}: must be a number in [{low:g}, {high:g}]")
    return value


def _server_options(args: argparse.Namespace) -> ServerOptions:
    """The server's bounds from the flags, each checked (one line naming the flag, exit 2)."""
    numbers = {name: _checked(name, getattr(args, name), *OPTION_RANGES[name])
               for name in ("workers", "max_queued", "read_timeout_s", "max_connections", "max_connections_per_range",
                            "ipv4_range_prefix", "ipv6_range_prefix")}
    memory_mb = _checked("max_body_memory_mb", args.max_body_memory_mb, *MAX_BODY_MEMORY_MB)
    return ServerOptions(**numbers, max_body_memory_bytes=int(memory_mb * 2**20),  # type: ignore[arg-type]
                         auth_token=_auth_token(args.auth_token_file))


def main(argv: list[str]) -> int:
    """`t5r serve`: HTTP search over an index with a query encoder."""
    from t5_retrieval.data.stores.kb import PassageStore

    parser = argparse.ArgumentParser(prog="t5r serve", description=__doc__.splitlines()[0])
    add_encoder_flags(parser)
    add_task_module_flag(parser)
    parser.add_argument("--index_dir", required=True, help="output of `t5r index` for this model")
    parser.add_argument("--kb_dir", required=True, help="passage store the index was built from")
    parser.add_argument("--tasks", default="",
                        help="comma-separated task names queries may use (default: the model's `task_names`)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080, help="0 lets the OS pick a free port")
    defaults = ServerOptions()
    parser.add_argument("--workers", type=int, default=defaults.workers, help="threads answering requests")
    parser.add_argument("--max_queued", type=int, default=defaults.max_queued,
                        help="complete requests that may wait for a worker; beyond, 503")
    parser.add_argument("--read_timeout_s", type=float, default=defaults.read_timeout_s,
                        help="seconds a connection has to deliver a whole request (408 and close after)")
    parser.add_argument("--max_connections", type=int, default=defaults.max_connections,
                        help="open connections; beyond, 503")
    parser.add_argument("--max_connections_per_range", type=int, default=defaults.max_connections_per_range,
                        help="open connections from one address range (see --ipv4_range_prefix); beyond, 503 "
                             "(behind a proxy every client has the proxy's address: raise it to --max_connections)")
    parser.add_argument("--ipv4_range_prefix", type=int, default=defaults.ipv4_range_prefix,
                        help="an IPv4 client's address range for the caps: the /N it is in")
    parser.add_argument("--ipv6_range_prefix", type=int, default=defaults.ipv6_range_prefix,
                        help="an IPv6 client's address range for the caps: the /N it is in")
    parser.add_argument("--max_body_memory_mb", type=float, default=defaults.max_body_memory_bytes / 2**20,
                        help="MiB that request bodies being read may hold, all clients together, counted as "
                             "they arrive (one address range: the same share of it as of --max_connections); "
                             "beyond, 503. One body's limit is ServeLimits.max_body_bytes (gin), 413 beyond")
    parser.add_argument("--auth_token_file", default=None,
                        help=f"file holding a bearer token every request must send (or set {TOKEN_ENV}); "
                             f"required unless --host is a loopback address")
    add_verify_flag(parser)
    args = parse_args(parser, argv, reads=TASK_MODULE)
    logs.setup()
    options = _server_options(args)
    _check_listenable(args.host, args.port, options.auth_token)  # before minutes of loading, not after
    with checksums.verification(args.verify):  # the store, index and model are verified as they open
        store = PassageStore.open(args.kb_dir)
        index = load_index(args.index_dir)
        encoder = encoder_from_flags(args)
    index.check(encoder, store.ids())
    import_task_modules(args)
    tasks = [t for t in args.tasks.split(",") if t] or list(encoder.task_names)
    if not tasks:
        raise UserError("--tasks is required: this encoder does not list its task names")
    service = SearchService(encoder, index, store, tasks, ServeLimits())
    try:
        server = make_server(service, args.host, args.port, options)
    except OSError as e:  # e.g. an address of another machine
        raise UserError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})") from None
    host, port = server.server_address[:2]
    print(f"t5r serve: http://{host}:{port}/search ({len(index)} passages, tasks {list(service.tasks)}"
          f"{', bearer token required' if options.auth_token else ''})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
