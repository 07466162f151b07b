"""One refresh reads a real router (in this test's loop, over a real socket, in front of the
shared fake replicas); when the router cannot be read, the message says why."""

from __future__ import annotations

import httpx

from dpserve.replicas.launcher import free_port
from dpserve.top.fetch import RouterReader
from dpserve.top.view import cells, columns, summary
from dpserve.top.window import History
from tests.conftest import running_router
from tests.fakes import MODEL
from tests.waiting import wait_for

ADMIN_KEY = "top-admin-key-0123456789"


async def test_a_refresh_has_every_replica_with_its_engine_figures(fake_replicas):
    a = await fake_replicas("a")
    b = await fake_replicas("b")
    async with running_router([a.url, b.url]) as (base, _):
        async with RouterReader(base, None) as reader:
            refresh = await wait_for(
                lambda: _ready(reader, 2), "both replicas ready in /admin/replicas")
    assert refresh.problems == ()
    assert [r["id"] for r in refresh.snapshot.replicas] == ["r0", "r1"]
    assert {r["weight_version"] for r in refresh.snapshot.replicas} <= {None, "default"}
    assert refresh.snapshot.samples["r0"].running == 0
    assert refresh.snapshot.samples["r1"].ttft_buckets[-1][1] == 0
    assert refresh.snapshot.routing is None  # not kv-aware: no KV index column


async def _ready(reader: RouterReader, n: int) -> object:
    refresh = await reader.read()
    snap = refresh.snapshot
    return refresh if snap is not None and sum(
        r["state"] == "ready" for r in snap.replicas) == n else None


async def test_a_kv_aware_router_shows_its_index_column_and_decisions(fake_replicas):
    a = await fake_replicas("a")  # offers no KV events: routed by the fallback
    async with running_router([a.url], policy="kv-aware") as (base, _):
        async with RouterReader(base, None) as reader:
            first = await wait_for(lambda: _off(reader), "r0's events not followed")
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(base + "/v1/completions",
                                         json={"model": MODEL, "prompt": "hi"})
                assert resp.status_code == 200
            second = await reader.read()
    assert first.snapshot is not None and second.snapshot is not None
    assert first.snapshot.routing is not None and second.snapshot.routing is not None
    # No tokenizer given: the request was placed by the fallback, for want of token ids.
    assert second.snapshot.routing.decisions["no_tokens"] == (
        first.snapshot.routing.decisions["no_tokens"] + 1)
    history = History()
    history.add(first.snapshot)
    history.add(second.snapshot)
    [row] = history.rows()
    kv = history.kv_summary()
    assert dict(zip(columns(kv_aware=True), cells(row, kv_aware=True), strict=True))[
        "KV index"] == "off"
    assert "kv-aware: 0% on events, hit - expected" in summary([row], history.span_s, kv)


async def _off(reader: RouterReader) -> object:
    refresh = await reader.read()
    sample = refresh.snapshot.samples.get("r0") if refresh.snapshot is not None else None
    return refresh if sample is not None and sample.kv_events_following == 0 else None


async def test_a_router_that_wants_an_admin_key_says_so_and_how_to_give_it(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], admin_key=ADMIN_KEY) as (base, _):
        async with RouterReader(base, None) as reader:
            refused = await reader.read()
        async with RouterReader(base, "wrong") as reader:
            wrong = await reader.read()
        async with RouterReader(base, ADMIN_KEY) as reader:
            allowed = await reader.read()
    assert refused.snapshot is None
    [message] = refused.problems
    assert message.startswith("the router refused the admin key (HTTP 401")
    assert "--admin-key-file FILE or DPSERVE_ADMIN_KEY" in message
    assert wrong.snapshot is None and "check the key given" in wrong.problems[0]
    assert allowed.snapshot is not None and allowed.problems == ()


async def test_a_router_that_is_down_is_named_with_its_address():
    url = f"http://127.0.0.1:{free_port()}"
    async with RouterReader(url, None) as reader:
        refresh = await reader.read()
    assert refresh.snapshot is None
    assert refresh.problems[0].startswith(f"cannot reach the router at {url}: ConnectError")


async def test_a_server_that_is_not_a_dpserve_router_is_told_apart(fake_replicas):
    a = await fake_replicas("a")  # a (fake) vLLM server: no /admin
    async with RouterReader(a.url, None) as reader:
        refresh = await reader.read()
    assert refresh.snapshot is None
    assert refresh.problems[0].startswith(f"no /admin/replicas at {a.url} (HTTP 404)")


async def test_without_engine_metrics_the_rows_stay_and_the_gap_is_named():
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/replicas":
            return httpx.Response(200, json={"replicas": [{"id": "r0", "state": "ready"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text="# TYPE x gauge\nx 1\n")
        return httpx.Response(502)

    async with RouterReader("http://router", None,
                            transport=httpx.MockTransport(answer)) as reader:
        refresh = await reader.read()
    assert refresh.snapshot is not None and refresh.snapshot.samples == {}
    assert refresh.problems == ("/metrics/engines: HTTP 502; its figures are not shown",)
