"""Fixed-response apps for `front_servers.py`: the same reply through each server interface.

Each app reads the request body whole and answers the benchmark's completion JSON
with a content-type and a content-length, as the router answers a non-streaming
request: what is left to measure is the server's own cost per request (parse,
dispatch to Python, write).

- ``asgi_app``: plain ASGI (``http.response.start`` + one ``http.response.body``),
  served by uvicorn (with dpserve's guarded protocol or uvicorn's own) and by
  granian's ASGI interface;
- ``rsgi_app``: granian's RSGI interface (``await protocol()`` for the body,
  ``protocol.response_bytes`` for the reply: one call);
- ``serve_uvicorn``: uvicorn as dpserve's router runs it (uvloop, httptools, no
  access log, the guarded protocol unless ``--plain``; ``--two-writes``: without
  the one-write cycle, head and body written apart as uvicorn does).
"""

from __future__ import annotations

import argparse

from benchmarks.router.fixed_upstream import build_bodies

BODY = build_bodies("fixed-model", 16).completion
_START = {"type": "http.response.start", "status": 200,
          "headers": [(b"content-type", b"application/json"),
                      (b"content-length", str(len(BODY)).encode())]}
_BODY = {"type": "http.response.body", "body": BODY, "more_body": False}
_RSGI_HEADERS = [("content-type", "application/json"), ("content-length", str(len(BODY)))]


async def asgi_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(_START)
    await send(_BODY)


async def rsgi_app(scope, protocol) -> None:
    await protocol()
    protocol.response_bytes(200, _RSGI_HEADERS, BODY)


def serve_uvicorn(port: int, plain: bool, two_writes: bool = False) -> None:
    import functools

    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from dpserve.router.http.front import FrontLimits, GuardedProtocol

    class TwoWrites(GuardedProtocol):
        """The guarded protocol with uvicorn's own cycle: head and body written apart."""

        def _start_asgi_task(self, cycle, app) -> None:
            HttpToolsProtocol._start_asgi_task(self, cycle, app)

    limits = FrontLimits(max_header_bytes=64 * 1024, header_timeout_s=30.0,
                         body_timeout_s=30.0, max_connections=10_000)
    http = "httptools" if plain else functools.partial(
        TwoWrites if two_writes else GuardedProtocol, limits=limits)
    config = uvicorn.Config(asgi_app, host="127.0.0.1", port=port, loop="uvloop", http=http,
                            access_log=False, log_level="warning", lifespan="off")
    uvicorn.Server(config).run()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--plain", action="store_true", help="uvicorn's own httptools protocol")
    p.add_argument("--two-writes", action="store_true",
                   help="the guarded protocol without the one-write cycle")
    args = p.parse_args()
    serve_uvicorn(args.port, args.plain, args.two_writes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
