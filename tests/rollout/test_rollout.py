"""The rolling state machine and `/admin/deploy`, against FakeReplicas (tests/fakes.py):
fakes because these cases need a replica whose reload or canary fails on cue. Real
vLLM replicas are covered in tests/integration/test_deploy.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dpserve import checkpoint as ckpt
from dpserve.rollout.deployed import weights_for
from dpserve.router.fleet.adapters import AdapterVersion
from dpserve.router.fleet.pool import ReplicaState
from tests import fake_tokens
from tests.fakes import MODEL
from tests.rollout.checkpoints import perturbed, write_adapter, write_variant
from tests.rollout.fleet import HOT_LOAD, deploy, fleet, take_down
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def checkpoints(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("ckpts")
    return [write_variant(tiny_model, out, step, tensors=perturbed(0.01, seed=step))
            for step in (1, 2)]


async def test_replicas_are_hot_loaded_one_at_a_time(fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 3) as f:
        status, record = await deploy(f, checkpoints[0])
    version = weights_for(str(checkpoints[0])).version
    assert status == 202 and record["state"] == "succeeded", record
    assert [r["phase"] for r in record["replicas"]] == ["done"] * 3
    assert f.versions() == [version] * 3 and f.states() == ["ready"] * 3
    assert f.deployed.current.version == version
    for fake in f.fakes:
        assert [c for c in fake.dev_calls] == HOT_LOAD  # in this order, a canary between
        assert fake.weights == record["snapshot"] and fake.weight_version == version
        assert fake.requests[-2]["logprobs"] == 1  # the canary, before the version is set
    assert f.most_out_of_rotation == 1


async def test_a_batch_reloads_that_many_at_once_but_never_all(fake_replicas, tiny_model,
                                                                checkpoints):
    async with fleet(fake_replicas, tiny_model, 3) as f:
        too_many, refused = await deploy(f, checkpoints[0], batch=3)
        _, record = await deploy(f, checkpoints[0], batch=2)
    assert too_many == 400 and refused["error"]["param"] == "batch"
    assert record["state"] == "succeeded" and f.most_out_of_rotation == 2


async def test_requests_in_flight_or_arriving_during_a_deploy_all_complete(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, chunks=20, chunk_delay_s=0.01) as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

        async def one(stream: bool) -> tuple[int, str]:
            r = await c.post("/v1/completions", json={**body, "stream": stream})
            return r.status_code, r.text

        streams = [asyncio.create_task(one(True)) for _ in range(4)]
        while sum(r.in_flight for r in f.router.pool) < 4:  # under way on both replicas
            await asyncio.sleep(0.005)
        deploying = asyncio.create_task(deploy(f, checkpoints[0]))
        during = [await one(i % 2 == 0) for i in range(12)]
        _, record = await deploying
        results = [*(await asyncio.gather(*streams)), *during]
    assert record["state"] == "succeeded"
    assert all(status == 200 for status, _ in results)
    for _, text in results[:4]:
        assert text.count("data: ") == 21 and text.endswith("data: [DONE]\n\n")  # whole


async def test_a_replica_alone_stays_in_rotation_while_paused(fake_replicas, tiny_model,
                                                             checkpoints):
    async with fleet(fake_replicas, tiny_model, 1) as f:
        seen: list[str] = []
        f.router.pool.on_state_change(lambda r, old, new: seen.append(new.value))
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "succeeded"
    assert seen == []  # no 503s: requests queue in the paused engine meanwhile
    assert f.fakes[0].dev_calls == HOT_LOAD


async def test_a_failed_reload_rolls_back_the_replicas_already_updated(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 3) as f:
        f.fakes[1].fail["reload"] = "error_once"
        _, record = await deploy(f, checkpoints[0])
        metrics = f.router.metrics.render().decode()
    base = weights_for(str(tiny_model))
    assert 'dpserve_deploys_total{outcome="rolled_back"} 1.0' in metrics
    assert 'dpserve_replica_reloads_total{outcome="failed",replica="r1"} 1.0' in metrics
    assert 'dpserve_replica_reloads_total{outcome="rolled_back",replica="r0"} 1.0' in metrics
    assert record["state"] == "rolled_back"
    assert "r1: reload: HTTP 500: fake reload failure on f1" in record["error"]
    assert [r["phase"] for r in record["replicas"]] == ["rolled_back", "rolled_back", "pending"]
    assert f.versions() == [base.version] * 3 and f.states() == ["ready"] * 3
    assert f.deployed.current == base
    assert f.fakes[0].weights == f.fakes[1].weights == base.path  # loaded back
    assert f.fakes[2].dev_calls == []  # never touched
    assert f.restarter is not None and f.restarter.restarts == []


async def test_a_canary_failing_on_the_old_weights_stops_before_that_replica_changes(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        f.fakes[1].weights, f.fakes[1].fail["canary"] = "/loaded/earlier", "error"
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "rolled_back"
    assert "r1: before reloading, on the old weights: canary: HTTP 500" in record["error"]
    assert f.fakes[1].dev_calls == []  # never paused
    assert f.fakes[0].dev_calls.count("/collective_rpc") == 2  # updated, then back
    assert f.versions() == [weights_for(str(tiny_model)).version] * 2


async def test_a_replica_that_cannot_be_reloaded_back_is_restarted(fake_replicas, tiny_model,
                                                                   checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        f.fakes[1].fail["reload"] = "error"
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "rolled_back"
    assert f.restarter is not None and f.restarter.restarts == ["r1"]
    assert record["replicas"][1]["phase"] == "restarting"
    assert f.versions() == [weights_for(str(tiny_model)).version] * 2


async def test_a_replica_that_computed_nan_is_restarted_not_reloaded(fake_replicas, tiny_model,
                                                                     checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        f.fakes[0].fail["canary"] = "nan"
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "rolled_back"
    assert "non" in record["replicas"][0]["note"] or "NaN" in record["replicas"][0]["note"]
    assert f.restarter is not None and f.restarter.restarts == ["r0"]
    assert f.fakes[0].dev_calls.count("/collective_rpc") == 1  # no reload over poisoned KV
    assert f.fakes[1].dev_calls == []


async def test_without_a_supervisor_an_unrestorable_replica_is_held_out(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, supervised=False) as f:
        f.fakes[1].fail["canary"] = "error"
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "failed"
    replica = f.router.pool.get("r1")
    assert replica is not None and replica.state is ReplicaState.DRAINING
    assert "restart this engine, then undrain it" in (replica.last_error or "")
    assert f.states()[0] == "ready" and f.versions()[0] == weights_for(str(tiny_model)).version


async def test_a_second_deploy_while_one_runs_is_refused(fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, chunks=30, chunk_delay_s=0.05) as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        stream = asyncio.create_task(c.post("/v1/completions", json={
            "model": MODEL, "prompt": "long", "stream": True}))
        while sum(r.in_flight for r in f.router.pool) == 0:
            await asyncio.sleep(0.01)
        first = await c.post("/admin/deploy", json={"checkpoint": str(checkpoints[0]),
                                                    "drain_wait_s": 10})
        second = await c.post("/admin/deploy", json={"checkpoint": str(checkpoints[1])})
        await f.rollout.wait()
        latest = (await c.get("/admin/deploy")).json()
        assert (await stream).status_code == 200
    assert first.status_code == 202
    assert second.status_code == 409 and "in progress" in second.json()["error"]["message"]
    assert latest["id"] == first.json()["id"] and latest["state"] == "succeeded"
    # drain_wait_s: the stream ended before its replica was paused
    assert all(r["steps"]["drain"] < 10 for r in latest["replicas"])


async def test_a_refused_checkpoint_changes_nothing(fake_replicas, tiny_model, tmp_path):
    # the model directory is inside the root, so it is refused for what it holds
    async with fleet(fake_replicas, tiny_model, 2, checkpoint_root=tiny_model.parent) as f, \
            httpx.AsyncClient(base_url=f.base) as c:
        r = await c.post("/admin/deploy", json={"checkpoint": str(tiny_model)})
        relative = await c.post("/admin/deploy", json={"checkpoint": "out/step-000001"})
        latest = (await c.get("/admin/deploy")).json()
    assert r.status_code == 422 and r.json()["error"]["param"] == "checkpoint"
    assert "no dpserve.json" in r.json()["error"]["message"]
    assert relative.status_code == 400
    assert latest["state"] == "refused"
    assert all(fake.dev_calls == [] for fake in f.fakes)
    assert f.versions() == [weights_for(str(tiny_model)).version] * 2


async def test_the_version_already_served_is_skipped(fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        await deploy(f, checkpoints[0])
        calls = [len(fake.dev_calls) for fake in f.fakes]
        _, again = await deploy(f, checkpoints[0])
    assert again["state"] == "succeeded"
    assert [r["phase"] for r in again["replicas"]] == ["skipped", "skipped"]
    assert [len(fake.dev_calls) for fake in f.fakes] == calls


async def test_a_replica_down_at_its_turn_is_restarted_on_the_new_weights(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        r1 = await take_down(f, 1)
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "succeeded"
    assert record["replicas"][1]["phase"] == "restarting"
    assert f.restarter is not None and f.restarter.restarts == ["r1"]
    assert r1.weight_version == weights_for(str(checkpoints[0])).version
    assert f.fakes[1].dev_calls == []


async def test_without_a_supervisor_a_replica_that_stays_down_fails_the_deploy(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, supervised=False) as f:
        await take_down(f, 1)
        _, record = await deploy(f, checkpoints[0], ready_timeout_s=0.3)
    assert record["state"] == "rolled_back"
    assert "r1: not ready within 0.3 s" in record["error"]
    assert f.fakes[0].weights == str(tiny_model.resolve())  # r0 was reloaded, then back


async def test_an_admin_drained_replica_is_reloaded_but_stays_drained(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f, httpx.AsyncClient(base_url=f.base) as c:
        await c.post("/admin/replicas/r0/drain")
        _, record = await deploy(f, checkpoints[0])
    assert record["state"] == "succeeded"
    assert f.states() == ["draining", "ready"]
    assert f.versions() == [weights_for(str(checkpoints[0])).version] * 2


async def test_a_router_that_does_not_know_its_model_refuses_deploys(fake_replicas, tiny_model,
                                                                     checkpoints):
    async with fleet(fake_replicas, tiny_model, 1, knows_model=False) as f:
        status, body = await deploy(f, checkpoints[0])
    assert status == 409 and "--base-model" in body["error"]["message"]


async def test_versions_are_in_the_replica_list_and_the_metrics(fake_replicas, tiny_model,
                                                                 checkpoints):
    async with fleet(fake_replicas, tiny_model, 2) as f, httpx.AsyncClient(base_url=f.base) as c:
        await deploy(f, checkpoints[0])
        listing = (await c.get("/admin/replicas")).json()["replicas"]
        metrics = (await c.get("/metrics")).text
        served = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    version = weights_for(str(checkpoints[0])).version
    assert [r["weight_version"] for r in listing] == [version, version]
    assert f'dpserve_replica_weight_info{{replica="r0",version="{version}"}} 1.0' in metrics
    assert 'dpserve_deploys_total{outcome="succeeded"} 1.0' in metrics
    assert 'dpserve_replica_reloads_total{outcome="succeeded",replica="r1"} 1.0' in metrics
    assert "dpserve_deploy_duration_seconds_count 1.0" in metrics
    assert served.headers["x-dpserve-weight-version"] == version


async def test_unknown_deploys_and_a_router_without_a_model_answer_in_the_envelope(
        fake_replicas, tiny_model):
    async with fleet(fake_replicas, tiny_model, 1, knows_model=False) as f, \
            httpx.AsyncClient(base_url=f.base) as c:
        none_yet = await c.get("/admin/deploy")
        unknown = await c.get("/admin/deploy/nope")
        blind = await c.post("/admin/deploy", json={"checkpoint": "/x"})
    assert none_yet.status_code == 404 and none_yet.json()["error"]["code"] == 404
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "deploy_id"
    assert blind.status_code == 409 and "--base-model" in blind.json()["error"]["message"]


async def test_full_weights_under_served_adapters_need_drop_adapters(fake_replicas, tiny_model,
                                                                      checkpoints, tmp_path,
                                                                      monkeypatch):
    async with fleet(fake_replicas, tiny_model, 2, enable_lora=True) as f:
        table = f.rollout.adapters.adapters
        served = AdapterVersion(name="assistant", version="v1", path="/snap/v1", rank=8)
        table.add(served)
        table.switch(served)
        for replica in f.router.pool:  # the engines list the adapters they hold
            replica.models = replica.models | {"assistant@v1"}
        before = f.deployed.current.version
        status, refused = await deploy(f, checkpoints[0])
        assert status == 409 and refused["error"]["param"] == "drop_adapters"
        assert "assistant" in refused["error"]["message"]
        # An adapter without --name is no full-weight deploy to drop adapters for.
        adapter, _ = write_adapter(tiny_model, tmp_path / "adapter")
        status, refused = await deploy(f, adapter)
        assert status == 422 and "is a LoRA adapter" in refused["error"]["message"]
        assert "`dpserve deploy CHECKPOINT --name NAME`" in refused["error"]["message"]
        assert f.deployed.current.version == before and table.current("assistant") is served
        status, record = await deploy(f, checkpoints[0], drop_adapters=True)
        assert status == 202 and record["state"] == "succeeded", record
        assert table.names() == frozenset() and served.retiring
        canaries = [r for fake in f.fakes for r in fake.requests if r.get("logprobs")]
        assert canaries and {r["model"] for r in canaries} == {MODEL}  # not the adapter
        assert any("adapter assistant no longer served" in e
                   for e in record["events"]), record["events"]
        async with httpx.AsyncClient(base_url=f.base, timeout=30) as c:
            gone = await c.post("/v1/completions", json={"model": "assistant", "prompt": "x"})
        assert gone.status_code == 404
        bad, body = await deploy(f, checkpoints[1], drop_adapters="yes")
        assert bad == 400 and body["error"]["param"] == "drop_adapters"
        # An adapter of the new weights is checked against the hashes the deploy already
        # verified: deploying it does not read the weights again.
        fits, _ = write_adapter(Path(f.deployed.current.path), tmp_path)
        monkeypatch.setattr(ckpt, "sha256_file", lambda path: pytest.fail(f"read {path}"))
        f.rollout.check_adapter(str(fits), "assistant", frozenset({MODEL}))


async def _stream_in_flight(f, c: httpx.AsyncClient) -> asyncio.Task[httpx.Response]:
    stream = asyncio.create_task(c.post("/v1/completions", json={
        "model": MODEL, "prompt": "long", "stream": True}))
    while sum(r.in_flight for r in f.router.pool) == 0:
        await asyncio.sleep(0.01)
    return stream


def _whole(resp: httpx.Response, chunks: int) -> bool:
    return (resp.status_code == 200 and resp.text.count("data: ") == chunks + 1
            and resp.text.endswith("data: [DONE]\n\n"))


async def test_a_request_in_flight_at_a_pause_is_counted_as_mixing_versions(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, chunks=40, chunk_delay_s=0.05) as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        stream = await _stream_in_flight(f, c)
        busy = next(r.id for r in f.router.pool if r.in_flight)
        status, record = await deploy(f, checkpoints[0])
        assert _whole(await stream, 40)
    assert status == 202 and record["state"] == "succeeded"
    assert record["mixed_versions"] == 1
    assert {r["id"]: r["mixed_versions"] for r in record["replicas"]}[busy] == 1


async def test_no_mixed_versions_pauses_a_replica_once_its_requests_have_ended(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, chunks=20, chunk_delay_s=0.05) as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        stream = await _stream_in_flight(f, c)
        status, record = await deploy(f, checkpoints[0], no_mixed_versions=True)
        assert _whole(await stream, 20)
    assert status == 202 and record["state"] == "succeeded", record
    assert record["mixed_versions"] == 0 and record["options"]["no_mixed_versions"] is True


async def test_no_mixed_versions_fails_the_deploy_rather_than_pause_a_busy_replica(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 2, chunks=100, chunk_delay_s=0.05) as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        before = f.versions()
        stream = await _stream_in_flight(f, c)
        status, record = await deploy(f, checkpoints[0], no_mixed_versions=True,
                                      drain_wait_s=0.2)
        assert f.versions() == before and f.states() == ["ready", "ready"]
        assert _whole(await stream, 100)
    assert status == 202 and record["state"] in ("rolled_back", "failed"), record
    assert "1 request(s) still in flight after 0.2 s of draining" in record["error"]
    assert "raise drain_wait_s" in record["error"] and record["mixed_versions"] == 0


async def test_no_mixed_versions_is_refused_for_a_lone_replica_or_a_non_boolean(
        fake_replicas, tiny_model, checkpoints):
    async with fleet(fake_replicas, tiny_model, 1) as f:
        lone, body = await deploy(f, checkpoints[0], no_mixed_versions=True)
        assert lone == 400 and body["error"]["param"] == "no_mixed_versions"
        assert "needs a second replica" in body["error"]["message"]
        bad, body = await deploy(f, checkpoints[0], no_mixed_versions="yes")
        assert bad == 400 and body["error"]["param"] == "no_mixed_versions"
        assert f.versions() == [weights_for(str(tiny_model)).version]


LONG_STREAM = {"model": MODEL, "prompt": "long", "max_tokens": 60, "stream": True,
               "temperature": 0}


@contextlib.asynccontextmanager
async def streaming_fleet(fake_replicas, tiny_model
                          ) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """Two fakes in token mode (their streams can move), 20 tokens/s, round robin."""
    async with fleet(fake_replicas, tiny_model, 2, tokens=True, chunk_delay_s=0.05,
                     policy="round-robin") as f, \
            httpx.AsyncClient(base_url=f.base, timeout=30) as c:
        await wait_for(lambda: len(f.router.pool.ready()) == 2, "both replicas ready")
        yield f, c


def stream_chunks(answer: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in answer.text.splitlines()
            if line.startswith("data: {")]


def stream_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["text"] for e in chunks for c in e.get("choices", []))


async def test_a_stream_still_running_at_the_drain_deadline_moves_to_another_replica(
        fake_replicas, tiny_model, checkpoints):
    """The shared fake engine's token mode: its streams can be continued elsewhere.
    Moved first to r1 (still on the old weights: no mixing), then, when r1's turn
    comes, back to r0 (on the new weights: counted as mixing versions)."""
    body = LONG_STREAM
    async with streaming_fleet(fake_replicas, tiny_model) as (f, c):
        stream = asyncio.create_task(c.post("/v1/completions", json=body))
        await wait_for(lambda: f.router.pool.get("r0").in_flight, "the stream on r0")
        status, record = await deploy(f, checkpoints[0], drain_wait_s=0.2)
        answer = await stream
    assert status == 202 and record["state"] == "succeeded", record
    moved = {r["id"]: (r["migrated_streams"], r["mixed_versions"]) for r in record["replicas"]}
    assert moved == {"r0": (1, 0), "r1": (1, 1)}
    chunks = stream_chunks(answer)
    assert all("choices" in e for e in chunks), chunks[-3:]
    assert stream_text(chunks) == fake_tokens.expected_text(body, 60)
    seams = next(e["dpserve"]["migrations"] for e in chunks if "dpserve" in e)
    assert [(s["from"], s["to"], s["reason"]) for s in seams] == [
        ("r0", "r1", "drained"), ("r1", "r0", "drained")]


async def test_a_stream_that_starts_over_elsewhere_is_restarted_not_migrated(
        fake_replicas, tiny_model, checkpoints):
    """r1's engine has not got to the stream's first token when r1's turn comes: the
    stream starts over on r0, already on the new weights, and runs wholly there. The
    record says restarted, not migrated, and counts no mixing of versions."""
    async with streaming_fleet(fake_replicas, tiny_model) as (f, c):
        f.fakes[1].first_chunk_gate = asyncio.Event()  # never set: r1 stays in prefill
        on_r0 = await c.post("/v1/completions", json=LONG_STREAM | {"stream": False})
        stream = asyncio.create_task(c.post("/v1/completions", json=LONG_STREAM))
        await wait_for(lambda: f.router.dispatcher.streams.movable("r1"),
                       "the stream waiting on r1")
        status, record = await deploy(f, checkpoints[0], drain_wait_s=0.2)
        answer = await stream
    assert on_r0.status_code == 200
    assert status == 202 and record["state"] == "succeeded", record
    moved = {r["id"]: (r["migrated_streams"], r["restarted_streams"], r["mixed_versions"])
             for r in record["replicas"]}
    assert moved == {"r0": (0, 0, 0), "r1": (0, 1, 0)}
    assert f.fakes[1].closed_streams == 1  # r1's request abandoned
    chunks = stream_chunks(answer)
    assert stream_text(chunks) == fake_tokens.expected_text(LONG_STREAM, 60)
    assert not any("dpserve" in e for e in chunks)  # no seam: it ran on r0 alone


async def test_a_drain_waits_for_the_streams_it_moved_not_for_those_that_stay(
        fake_replicas, tiny_model, checkpoints):
    """r0 runs a stream that can move and one that cannot (penalties: not continuable
    elsewhere as the same request). The deploy moves the first, waits for it to leave
    and pauses the replica over the second (counted as mixing versions) instead of
    waiting ~3 s for it to end."""
    body = LONG_STREAM
    async with streaming_fleet(fake_replicas, tiny_model) as (f, c):
        r0 = f.router.pool.get("r0")
        movable = asyncio.create_task(c.post("/v1/completions", json=body))
        await wait_for(lambda: f.router.dispatcher.streams.movable("r0"), "a stream on r0")
        between = await c.post("/v1/completions", json=body | {"stream": False,
                                                                 "max_tokens": 1})  # on r1
        staying = asyncio.create_task(c.post("/v1/completions", json=body | {
            "prompt": "stays", "presence_penalty": 0.5}))
        await wait_for(lambda: r0.in_flight == 2, "the second stream on r0")
        status, record = await deploy(f, checkpoints[0], drain_wait_s=0.2)
        answers = [await movable, await staying]
    assert between.status_code == 200
    assert status == 202 and record["state"] == "succeeded", record
    first = record["replicas"][0]
    assert first["id"] == "r0"
    assert (first["migrated_streams"], first["mixed_versions"]) == (1, 1)
    assert first["steps"]["drain"] < 1.5, first["steps"]  # the staying one runs ~3 s
    for answer, prompt in zip(answers, ("long", "stays"), strict=True):
        assert stream_text(stream_chunks(answer)) == \
            fake_tokens.expected_text(body | {"prompt": prompt}, 60)
