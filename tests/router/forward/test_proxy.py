"""The router's forwarding behaviour, against FakeReplicas (see tests/fakes.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dpserve.router.fleet.pool import ReplicaState
from tests.conftest import running_router
from tests.fakes import FINGERPRINT, MODEL, as_sent
from tests.replicas.test_launcher import closed_port_url
from tests.waiting import wait_for

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


async def test_completion_is_forwarded_and_request_id_echoed(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY, headers={"x-request-id": "req-42"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-42"
    assert r.headers["x-dpserve-replica"] == "r0"
    assert a.headers_seen[0]["X-Request-Id"] == "req-42"
    assert [as_sent(r) for r in a.requests] == [BODY]


async def test_request_id_is_generated_when_absent(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r1 = await c.post(base + "/v1/completions", json=BODY)
        r2 = await c.post(base + "/v1/completions", json=BODY)
    assert len(r1.headers["x-request-id"]) >= 16
    assert r1.headers["x-request-id"] != r2.headers["x-request-id"]
    assert a.headers_seen[0]["X-Request-Id"] == r1.headers["x-request-id"]


async def test_round_robin_alternates_between_replicas(fake_replicas):
    a, b = await fake_replicas("a"), await fake_replicas("b")
    async with running_router([a.url, b.url], policy="round-robin") as (base, _):
        async with httpx.AsyncClient() as c:
            served = [(await c.post(base + "/v1/completions", json=BODY)).headers[
                "x-dpserve-replica"] for _ in range(4)]
    assert served == ["r0", "r1", "r0", "r1"]


async def test_least_outstanding_avoids_the_busy_replica(fake_replicas):
    a = await fake_replicas("a", chunks=20, chunk_delay_s=0.05)
    b = await fake_replicas("b", chunks=20, chunk_delay_s=0.05)
    async with running_router([a.url, b.url], policy="least-outstanding") as (base, _):
        async with httpx.AsyncClient(timeout=10) as c:
            # While a stream holds one replica, the next request must go to the other.
            async with c.stream("POST", base + "/v1/completions",
                                json={**BODY, "stream": True}) as s1:
                first = s1.headers["x-dpserve-replica"]
                r = await c.post(base + "/v1/completions", json=BODY)
                assert r.headers["x-dpserve-replica"] != first
                await s1.aread()


@pytest.mark.parametrize("path", ["/collective_rpc", "/pause", "/sleep", "/reset_prefix_cache",
                                  "/v1/load_lora_adapter", "/admin", "/"])
async def test_dev_endpoints_are_never_forwarded(fake_replicas, path):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + path, json={"method": "reload_weights"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404
    assert a.requests == []


async def test_wrong_method_is_405_in_the_error_envelope(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.get(base + "/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "MethodNotAllowedError"


@pytest.mark.parametrize(("body", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": 7}', 400, "'model' must be a string"),
    (b'{"model": "fake-model", "prompt": "x", "stream": "yes"}', 400, "'stream' must be a boolean"),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "`nope` does not exist"),
])
async def test_bad_requests_get_the_openai_error_envelope(fake_replicas, body, status, fragment):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", content=body,
                         headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert a.requests == []


async def test_body_over_the_limit_is_413(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], max_body_bytes=4096) as (base, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/v1/completions", json={**BODY, "prompt": "x" * 5000})

            async def chunked():  # no content-length: counted while reading
                for _ in range(10):
                    yield b"x" * 1000

            r2 = await c.post(base + "/v1/completions", content=chunked())
    assert r.status_code == 413
    assert r2.status_code == 413
    assert a.requests == []


async def test_no_ready_replica_is_503(fake_replicas):
    a = await fake_replicas("a")
    a.healthy = False
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY)
        ready = await c.get(base + "/ready")
        health = await c.get(base + "/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert ready.status_code == 503
    assert health.status_code == 200


async def test_replica_errors_pass_through_unchanged(fake_replicas):
    a = await fake_replicas("a", mode="error400")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json=BODY)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "a says no"
    assert len(a.requests) == 1  # a client error is not retried elsewhere


async def test_refused_connection_is_retried_on_another_replica_and_marked_down(fake_replicas):
    b = await fake_replicas("b")
    # Round-robin, so the dead replica's turn surely comes (a random pick could miss it).
    async with running_router([b.url], policy="round-robin") as (base, router):
        # A second replica that was ready a moment ago and has just died.
        from dpserve.router.fleet.pool import Replica

        dead = Replica(id="dead", url=closed_port_url(), state=ReplicaState.READY,
                       models=frozenset({MODEL}))
        router.pool._replicas.append(dead)
        async with httpx.AsyncClient() as c:
            results = [await c.post(base + "/v1/completions", json=BODY) for _ in range(4)]
    assert [r.status_code for r in results] == [200] * 4
    assert {r.headers["x-dpserve-replica"] for r in results} == {"r0"}
    assert dead.state is ReplicaState.DOWN


async def test_non_stream_request_is_retried_when_the_replica_drops_it(fake_replicas):
    dropper = await fake_replicas("dropper", mode="drop")
    good = await fake_replicas("good")
    async with running_router([dropper.url, good.url], policy="round-robin") as (base, _):
        async with httpx.AsyncClient() as c:
            r = await c.post(base + "/v1/completions", json=BODY)
    assert r.status_code == 200
    assert r.headers["x-dpserve-replica"] == "r1" and r.json()["choices"]
    assert len(dropper.requests) == 1


async def test_stream_is_passed_through_chunk_by_chunk(fake_replicas):
    a = await fake_replicas("a", chunks=5, chunk_delay_s=0.1)
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        arrivals = []
        loop = asyncio.get_running_loop()
        async with c.stream("POST", base + "/v1/completions",
                            json={**BODY, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append((loop.time(), line))
    assert arrivals[-1][1] == "data: [DONE]"
    assert len(arrivals) == 6
    # Not buffered: the first chunk arrived well before the last one was produced.
    assert arrivals[-1][0] - arrivals[0][0] >= 0.3


async def test_stream_cut_by_the_replica_ends_with_an_error_event(fake_replicas):
    a = await fake_replicas("a", mode="cut", chunks=6)
    async with running_router([a.url]) as (base, _), httpx.AsyncClient(timeout=10) as c:
        async with c.stream("POST", base + "/v1/completions",
                            json={**BODY, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert r.status_code == 200
    # t0, t1, the error event, [DONE]: the half-written third event is dropped, so every
    # event is whole JSON, as an OpenAI client parses it
    assert len(lines) == 4
    assert [json.loads(line.removeprefix("data: "))["choices"][0]["text"]
            for line in lines[:2]] == ["t0", "t1"]
    error = json.loads(lines[2].removeprefix("data: "))["error"]
    assert "stream interrupted" in error["message"]
    assert lines[-1] == "data: [DONE]"


async def test_client_disconnect_closes_the_upstream_stream(fake_replicas):
    a = await fake_replicas("a", chunks=200, chunk_delay_s=0.05)
    async with running_router([a.url]) as (base, router):
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", base + "/v1/completions",
                                json={**BODY, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    break  # leave after the first line
        await wait_for(lambda: not (a.open_streams or router.pool.get("r0").in_flight),
                       "the upstream stream to close and the slot to be released")
        assert a.closed_streams == 1
        assert router.pool.get("r0").in_flight == 0
        metrics = (await httpx.AsyncClient().get(base + "/metrics")).text
    assert 'dpserve_client_disconnects_total{route="/v1/completions"} 1.0' in metrics


async def test_models_come_from_the_replicas(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.get(base + "/v1/models")
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


async def test_metrics_count_requests_by_replica_and_status_class(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        await c.post(base + "/v1/completions", json=BODY)
        await c.post(base + "/v1/completions", content=b"{bad")
        text = (await c.get(base + "/metrics")).text
    assert ('dpserve_requests_total{replica="r0",route="/v1/completions",status_class="2xx"} 1.0'
            in text)
    assert ('dpserve_requests_total{replica="none",route="/v1/completions",status_class="4xx"} 1.0'
            in text)
    assert 'dpserve_replica_in_flight_requests{replica="r0"} 0.0' in text
    assert 'dpserve_replica_state{replica="r0",state="ready"} 1.0' in text
    assert "dpserve_request_duration_seconds_bucket" in text


def test_the_listening_socket_disables_nagle():
    """Without TCP_NODELAY on accepted connections, a keep-alive client waits for
    its own delayed ACK (~40 ms) between a response's headers and its body."""
    import socket

    from dpserve.router.http.server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio keys TCP_NODELAY on this
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_a_busy_port_is_a_clear_error():
    from dpserve.router.http.server import PortInUseError, bind_socket

    taken = bind_socket("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(PortInUseError, match=r"cannot listen on 127\.0\.0\.1:\d+"):
            bind_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


async def test_a_replica_silent_past_the_first_byte_timeout_is_a_504(fake_replicas):
    a = await fake_replicas("a", mode="mute")
    async with running_router([a.url], first_byte_timeout_s=0.5) as (base, router):
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(base + "/v1/completions", json=BODY)
        assert router.pool.get("r0").in_flight == 0
    assert r.status_code == 504
    assert "no response within 0.5 s" in r.json()["error"]["message"]
    assert len(a.requests) == 1  # not retried: the replica may still be working on it


async def test_a_stream_idle_past_the_limit_ends_with_an_error_event(fake_replicas):
    a = await fake_replicas("a", mode="hang")
    async with running_router([a.url], stream_idle_timeout_s=0.5) as (base, _):
        async with httpx.AsyncClient(timeout=10) as c, c.stream(
            "POST", base + "/v1/completions", json={**BODY, "stream": True}
        ) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert len(lines) == 3  # t0, then the error event and [DONE]
    assert "no data for 0.5 s" in json.loads(lines[1].removeprefix("data: "))["error"]["message"]
    assert lines[-1] == "data: [DONE]"


async def test_the_weight_version_of_the_serving_replica_is_named_in_every_answer(
        fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url]) as (base, router), httpx.AsyncClient() as c:
        before = await c.post(base + "/v1/completions", json=BODY)
        router.pool.get("r0").weight_version = "step-000120@ab12"
        after = await c.post(base + "/v1/completions", json=BODY)
        streamed = await c.post(base + "/v1/completions", json={**BODY, "stream": True})
    assert "x-dpserve-weight-version" not in before.headers
    assert before.json()["system_fingerprint"] == FINGERPRINT  # the engine's, untouched
    assert after.headers["x-dpserve-weight-version"] == "step-000120@ab12"
    assert after.json()["system_fingerprint"] == "step-000120@ab12"
    assert streamed.headers["x-dpserve-weight-version"] == "step-000120@ab12"
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert chunks and {c["system_fingerprint"] for c in chunks} == {"step-000120@ab12"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "t0t1t2t3"


async def test_the_router_keeps_serving_after_a_barrage_of_bad_requests(fake_replicas):
    a = await fake_replicas("a")
    key, admin_key = "client-key-123", "admin-key-0123456789"
    good = {"authorization": f"Bearer {key}"}
    bad_calls = [
        ("POST", "/v1/completions", b"{not json", good, 400),
        ("POST", "/v1/chat/completions", b"[]", good, 400),
        ("POST", "/v1/completions", b'{"model": ["x"]}', good, 400),
        ("POST", "/v1/completions", b'{"model": "fake-model", "stream": 1}', good, 400),
        ("POST", "/v1/completions", b'{"model": "other", "prompt": "x"}', good, 404),
        ("POST", "/v1/completions", b"x" * 5000, good, 413),
        ("POST", "/v1/completions", json.dumps(BODY).encode(), {}, 401),
        ("POST", "/v1/completions", json.dumps(BODY).encode(),
         {"authorization": "Bearer wrong"}, 401),
        ("GET", "/admin/replicas", b"", good, 401),
        ("POST", "/collective_rpc", b"{}", good, 404),
        ("GET", "/v1/completions", b"", good, 405),
    ]
    async with (running_router([a.url], api_keys=[key], admin_key=admin_key,
                               max_body_bytes=4096) as (base, _), httpx.AsyncClient() as c):
        for method, path, body, headers, status in bad_calls:
            r = await c.request(method, base + path, content=body,
                                headers={"content-type": "application/json", **headers})
            assert r.status_code == status, (path, body[:40], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        after = await c.post(base + "/v1/completions", json=BODY, headers=good)
    assert after.status_code == 200
    assert len(a.requests) == 1  # only the good request ever reached the replica
