"""The router's HTTP server: its listening sockets and uvicorn behind the front's limits.

`listen` binds the API's socket (and the admin listener's) before anything starts,
so a busy port is one clear error naming the flag; `uvicorn_server` builds the
server that serves the router's app on them (`dpserve.serve` runs it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Iterator

import uvicorn

from dpserve.config import RouterConfig
from dpserve.router.asgi import ASGIApp
from dpserve.router.http.app import Router, build_app
from dpserve.router.http.front import FrontLimits, protocol_factory

log = logging.getLogger("dpserve.serve")


class PortInUseError(OSError):
    """The router's address cannot be bound; the message starts with the flags at fault
    when `listen` raised it. `reason` is the bind's errno."""

    def __init__(self, message: str, reason: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """Bind the router's listening socket up front, so a busy port is a clear error.
    `reuse_port`: data-plane workers each bind the port (the kernel spreads connections
    among them); only processes of the same user can join."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only
    # when the listening socket names its protocol. Without it, Nagle holds back the
    # body behind the headers until the client's delayed ACK: +40 ms per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}",
                             exc.errno) from None
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    """`http://HOST:PORT` of a bound socket: the port it really got (`--port 0` too)."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (dpserve decides the shutdown order),
    saying where it listens once it does: given sockets, uvicorn says nothing."""

    announce = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets and self.announce:
            log.info("router on %s (OpenAI API at /v1)", url_of(sockets[0], self.config.host))
            if len(sockets) > 1:
                admin = sockets[1]
                log.info("admin API on %s (/admin/*)", url_of(admin, admin.getsockname()[0]))


def uvicorn_server(router: Router, config: RouterConfig, *, app: ASGIApp | None = None,
                   announce: bool = True) -> uvicorn.Server:
    """The router's HTTP server: uvicorn on httptools behind the front's limits
    (`dpserve.router.http.front`), believing proxy headers only from `trusted_proxies`.
    `app`: another entry than the router's own (a data-plane worker's)."""
    rejections = router.metrics.front_rejections
    limits = FrontLimits(
        max_header_bytes=config.max_header_bytes,
        header_timeout_s=config.client_header_timeout_s,
        body_timeout_s=config.client_body_timeout_s,
        max_connections=config.max_connections,
        on_reject=lambda reason: rejections.labels(reason).inc())
    server = _Server(uvicorn.Config(
        build_app(router) if app is None else app,
        host=config.host,
        port=config.port,
        log_level=config.log_level.lower(),
        log_config=None,  # uvicorn's loggers propagate to ours: one format in the output
        access_log=False,
        server_header=False,  # per-request logging costs more than the proxying itself
        timeout_graceful_shutdown=int(config.graceful_shutdown_s) or None,
        timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
        lifespan="on",
        http=protocol_factory(limits),  # type: ignore[arg-type]
        ws="none",
        proxy_headers=bool(config.trusted_proxies),
        forwarded_allow_ips=list(config.trusted_proxies or []),
    ))
    server.announce = announce
    return server


def listen(config: RouterConfig) -> list[socket.socket]:
    """The router's listening sockets: the API's, and the admin listener's if it has one.
    Bound before anything starts, so that a busy port costs no replica start-up; the
    error names the flags at fault."""
    sockets = [_bind(config.host, config.port, "--host", "--port", config.workers > 1)]
    if config.admin_port is not None:
        try:
            sockets.append(_bind(config.admin_host, config.admin_port, "--admin-host",
                                 "--admin-port"))
        except PortInUseError:
            sockets[0].close()
            raise
    return sockets


def _bind(host: str, port: int, host_flag: str, port_flag: str,
          reuse_port: bool = False) -> socket.socket:
    try:
        return bind_socket(host, port, reuse_port=reuse_port)
    except PortInUseError as exc:
        if exc.reason == errno.EADDRINUSE:
            where = f"{port_flag} {port}"
            hint = " (another process listens there; pick another port, or 0 for a free one)"
        elif exc.reason == errno.EADDRNOTAVAIL:
            where, hint = f"{host_flag} {host}", " (not an address of this machine)"
        else:
            where, hint = f"{host_flag} {host} {port_flag} {port}", ""
        raise PortInUseError(f"{where}: {exc}{hint}", exc.reason) from None
