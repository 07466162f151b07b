"""The router app's surface: an allow-list. The OpenAI routes reach a replica; the
router's own routes answer; anything else, vLLM's dev endpoints above all, is a 404 in
the OpenAI envelope however the path is spelled, and never reaches a replica."""

from __future__ import annotations

import gc
import threading

import httpx
import pytest

from dpserve.config import RouterConfig
from dpserve.prompt_tokens import open_named
from dpserve.router.fleet.pool import Replica, ReplicaPool
from dpserve.router.http.app import FORWARDED_ROUTES, Router
from dpserve.router.kv.tokens import PromptTokenizer
from dpserve.router.routing.policies import AdapterAffinity
from tests.conftest import running_router, serving
from tests.router.rawhttp import exchange, parse_responses, request
from tests.waiting import wait_for

DEV_PATHS = ["/collective_rpc", "/pause", "/resume", "/sleep?level=1", "/wake_up",
             "/reset_prefix_cache", "/update_weight_version", "/is_paused", "/weight_info",
             "/v1/load_lora_adapter", "/start_profile", "/invocations", "/scale_elastic_ep"]
SPELLINGS = ["/{p}", "//{p}", "/v1/../{p}", "/v1/%2e%2e/{p}", "/v1/completions/../../{p}",
             "/{p}/", "/{p}%00", "/./{p}", "/{p}#/v1/completions"]


@pytest.mark.parametrize("path", DEV_PATHS)
async def test_a_dev_endpoint_is_never_reachable_however_it_is_spelled(fake_replicas, path):
    replica = await fake_replicas("r0")
    targets = [s.format(p=path.lstrip("/")) for s in SPELLINGS]
    pipelined = b"".join(request(method, target, body=b"{}")
                         for target in targets for method in ("GET", "POST"))
    async with running_router([replica.url]) as (url, _):
        raw, _ = await exchange(int(url.rsplit(":", 1)[1]), pipelined, quiet_s=0.5)
    answers = parse_responses(raw)
    assert answers, "no answer at all"
    for answer in answers:  # a malformed one ends the connection with a 400
        assert answer.status in (400, 404), answer
        assert answer.json()["error"]["code"] == answer.status
    assert replica.dev_calls == [] and replica.reached() == []


async def test_each_forwarded_route_reaches_a_replica_with_its_own_method_only(fake_replicas):
    replica = await fake_replicas("r0")
    async with running_router([replica.url]) as (url, _), httpx.AsyncClient() as c:
        for path, method in FORWARDED_ROUTES:
            other = "GET" if method == "POST" else "POST"
            wrong = await c.request(other, url + path, json={} if other == "POST" else None)
            assert wrong.status_code == 405, path
            assert wrong.json()["error"]["type"] == "MethodNotAllowedError"
        ok = await c.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "x"})
        models = await c.get(url + "/v1/models")
    assert ok.status_code == models.status_code == 200
    assert models.json()["data"][0]["id"] == "fake-model"  # the replica's own list
    assert replica.reached() == ["POST /v1/completions"]


async def test_the_routers_own_routes_answer_without_a_replica():
    async with running_router([]) as (url, _), httpx.AsyncClient() as c:
        health = await c.get(url + "/health")
        ready = await c.get(url + "/ready")
        metrics = await c.get(url + "/metrics")
        admin = await c.get(url + "/admin/replicas")
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 503 and ready.json()["error"]["code"] == 503
    assert metrics.status_code == 200 and "dpserve_replicas_ready 0.0" in metrics.text
    assert admin.status_code == 200 and admin.json() == {"replicas": []}


def test_a_router_is_complete_when_constructed():
    router = Router(ReplicaPool([]), RouterConfig())
    # Everything a request or a probe touches exists before start(): nothing raises.
    assert router.upstream is not None and router.health is not None
    assert router.discovery is None and router.scraper is None and router.routes == []


def test_a_router_serving_adapters_places_them_by_affinity_unless_told_not_to():
    lora = Router(ReplicaPool([]), RouterConfig(enable_lora=True, max_loras=2))
    assert isinstance(lora.policy, AdapterAffinity) and lora.policy.max_loras == 2
    assert lora.scraper is not None  # reads the engines' running adapters
    off = Router(ReplicaPool([]), RouterConfig(enable_lora=True, lora_affinity=False))
    assert not isinstance(off.policy, AdapterAffinity) and off.scraper is None


async def test_a_kv_aware_router_is_ready_once_its_tokenizer_is_loaded(fake_replicas):
    replica = await fake_replicas("r0")
    release = threading.Event()

    def slow_open(source: str) -> PromptTokenizer:  # transformers' import, on a busy host
        release.wait(30)
        return open_named("sim")

    config = RouterConfig(policy="kv-aware", tokenizer="sim", health_interval_s=0.2)
    router = Router(ReplicaPool([Replica(id="r0", url=replica.url)]), config,
                    open_tokenizer=slow_open)
    async with serving(router) as (url, _), httpx.AsyncClient() as c:
        await wait_for(lambda: router.pool.ready(), "the replica ready")
        loading = await c.get(url + "/ready")
        release.set()
        await wait_for(lambda: router.kv is not None and router.kv.tokenizer_settled.is_set(),
                       "the tokenizer loaded")
        ready = await c.get(url + "/ready")
    assert loading.status_code == 503
    assert "tokenizer is loading" in loading.json()["error"]["message"]
    assert ready.status_code == 200


async def test_what_start_up_and_the_tokenizer_built_is_kept_out_of_garbage_collections(
        fake_replicas):
    """A full collection stops the event loop for as long as it takes to visit every
    tracked object: with transformers and torch imported for the tokenizer, ~280 ms
    (dpserve.router.heap). What the router built to start, and what loading the
    tokenizer left, must not be visited again."""
    replica = await fake_replicas("r0")
    release = threading.Event()
    imported: list[list[int]] = []  # what an import leaves behind, for the process's life

    def slow_open(source: str) -> PromptTokenizer:
        release.wait(30)
        imported.extend([i] for i in range(10_000))
        return open_named("sim")

    config = RouterConfig(policy="kv-aware", tokenizer="sim", health_interval_s=0.2)
    router = Router(ReplicaPool([Replica(id="r0", url=replica.url)]), config,
                    open_tokenizer=slow_open)
    gc.unfreeze()
    try:
        async with serving(router) as _:
            started = gc.get_freeze_count()
            release.set()
            await wait_for(lambda: router.kv is not None
                           and router.kv.tokenizer_settled.is_set(), "the tokenizer loaded")
            loaded = gc.get_freeze_count()
        assert started > 0
        assert loaded >= started + len(imported)
    finally:
        gc.unfreeze()
