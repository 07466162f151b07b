"""The header rules of a proxy hop (`dpserve.router.headers`): what goes to the replica, what
comes back, and the request id; the head the router writes is checked by parsing it back
with llhttp, over generated headers (hypothesis)."""

from __future__ import annotations

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.router.errors import RouterError
from dpserve.router.headers import (
    FORWARDED_HEADERS,
    downstream_headers,
    request_id,
    upstream_header_block,
)

HOP = ["connection", "keep-alive", "proxy-authorization", "te", "trailer",
       "transfer-encoding", "upgrade", "host", "content-length", "expect", "authorization"]
ALLOWED = sorted(n.decode() for n in FORWARDED_HEADERS)
# Headers vLLM 0.32 acts on, which a client must not set (and a few others'), besides
# any name at all.
ACTED_ON = ["x-data-parallel-rank", "x-vllm-priority", "endpoint-load-metrics-format",
            "cookie", "x-forwarded-for", "x-api-key", "x-kv-transfer-params"]
NAME = st.sampled_from(ALLOWED) | st.sampled_from(ACTED_ON) | st.text(
    "abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20).filter(
    lambda n: n not in HOP and n != "x-request-id")
VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(
    str.strip)


class _Request:
    """Collects what llhttp parses out of a request head."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_message_complete(self) -> None:
        self.complete = True


def parse(head: bytes, body: bytes = b"") -> tuple[list[tuple[bytes, bytes]], bool]:
    request = _Request()
    httptools.HttpRequestParser(request).feed_data(head + body)
    return request.headers, request.complete


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(NAME, VALUE), max_size=8),
       st.lists(st.sampled_from(HOP), max_size=4), st.integers(0, 5000))
def test_the_replica_gets_the_clients_headers_less_hop_by_hop_and_the_routers_framing(
        kept, hop, length):
    headers = [(n.encode(), v.encode()) for n, v in kept]
    headers += [(n.encode(), {"transfer-encoding": b"chunked", "connection": b"accept"}.get(
        n, b"x")) for n in hop]
    scope = {"headers": headers}
    block = upstream_header_block(scope, "rid-1", length)
    parsed, complete = parse(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\n" + block,
                             b"a" * length)
    assert complete  # exactly one request, framed by the router's own length
    # Only the allow-list passes; `connection: accept` makes `accept` hop-by-hop.
    nominated = {"accept"} if "connection" in hop else set()
    assert parsed[1:-2] == [(n.encode(), v.encode()) for n, v in kept
                            if n in ALLOWED and n not in nominated]
    assert parsed[-2:] == [(b"x-request-id", b"rid-1"), (b"content-length", str(length).encode())]


def test_headers_the_connection_header_names_are_not_forwarded():
    scope = {"headers": [(b"connection", b"close, User-Agent"), (b"user-agent", b"s"),
                         (b"accept", b"k")]}
    parsed, _ = parse(b"GET /v1/models HTTP/1.1\r\n" + upstream_header_block(scope, "r", None))
    assert (b"user-agent", b"s") not in parsed and (b"accept", b"k") in parsed


@pytest.mark.parametrize("value", [b"a\rb", b"a\nb", b"a\x00b", b"\x7f"])
def test_a_header_value_that_could_split_the_head_is_refused(value):
    with pytest.raises(RouterError) as caught:
        upstream_header_block({"headers": [(b"user-agent", value)]}, "r", 0)
    assert caught.value.status == 400


@pytest.mark.parametrize("sent, kept", [
    (b"abc-123", True), (b"x" * 128, True), (b"x" * 129, False), (b"a\x01b", False), (b"", False),
])
def test_the_clients_request_id_is_kept_only_when_sane(sent, kept):
    rid = request_id({"headers": [(b"x-request-id", sent)]})
    assert (rid == sent.decode("latin-1")) is kept
    assert rid.isprintable() and 0 < len(rid) <= 128


def test_the_client_gets_the_replicas_headers_less_hop_by_hop_plus_who_answered():
    raw = [(b"Content-Type", b"application/json"), (b"Connection", b"close"),
           (b"Transfer-Encoding", b"chunked"), (b"Server", b"uvicorn"),
           (b"X-Request-Id", b"theirs"), (b"X-Engine", b"vllm")]
    out = downstream_headers(raw, "ours", "r3", "step-000010@abcd1234")
    assert out == [(b"content-type", b"application/json"), (b"x-engine", b"vllm"),
                   (b"x-request-id", b"ours"), (b"x-dpserve-replica", b"r3"),
                   (b"x-dpserve-weight-version", b"step-000010@abcd1234")]
    on_adapter = downstream_headers(raw, "ours", "r3", "base-v", "adapter-v")
    assert on_adapter[-2:] == [(b"x-dpserve-weight-version", b"adapter-v"),
                               (b"x-dpserve-base-version", b"base-v")]
