"""An HTTP/1.1 pass-through in front of one replica that fails a share of its API
requests on cue: what a canary whose new weights break some requests looks like from
the router. For benchmarks only, bound to 127.0.0.1.

    python -m benchmarks.common.fault_proxy --port P --upstream 127.0.0.1:Q

`POST /__fault/RATE` (RATE in [0, 1]) sets the share of `POST /v1/...` requests answered
`500` with vLLM's error envelope from then on (0 at start). Every other request goes to
the upstream on a connection of its own (`Connection: close`, so the response's end is
the upstream's EOF whatever its framing); its answer is relayed byte for byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

FAULT = b"/__fault/"
ERROR = json.dumps({"error": {"message": "injected fault", "type": "InternalServerError",
                              "param": None, "code": 500}}).encode()


class Proxy:
    def __init__(self, upstream: tuple[str, int], seed: int = 0) -> None:
        self.upstream = upstream
        self.rate = 0.0
        self.rng = random.Random(seed)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()  # not awaited: a connection dropped at exit may be collected

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the connection stays open."""
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        method, target, _ = lines[0].split(b" ", 2)
        length = next((int(v) for k, _, v in (h.partition(b":") for h in lines[1:])
                       if k.strip().lower() == b"content-length"), 0)
        body = await reader.readexactly(length)
        if target.startswith(FAULT):
            self.rate = min(1.0, max(0.0, float(target[len(FAULT):])))
            return self._reply(writer, 200, b"{}")
        if method == b"POST" and target.startswith(b"/v1/") and self.rng.random() < self.rate:
            return self._reply(writer, 500, ERROR)
        kept = [h for h in lines[1:] if h.partition(b":")[0].strip().lower() != b"connection"]
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        try:
            up_writer.write(b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n"
                            + body)
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()
        return False

    @staticmethod
    def _reply(writer: asyncio.StreamWriter, status: int, body: bytes) -> bool:
        reason = b"OK" if status == 200 else b"Internal Server Error"
        writer.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body))
        return True


async def main(port: int, upstream: str) -> None:
    host, _, up_port = upstream.rpartition(":")
    proxy = Proxy((host, int(up_port)))
    server = await asyncio.start_server(proxy.serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="HOST:PORT of the replica")
    args = p.parse_args()
    asyncio.run(main(args.port, args.upstream))
