"""Canary traffic in a deploy (`--canary-weight`): the split, the comparison, promotion
and rollback, against FakeReplicas whose new weights can serve badly on cue."""

from __future__ import annotations

import asyncio
import io
import random
from pathlib import Path

import httpx
import pytest

from dpserve.rollout.client import AdminClient, run_deploy
from dpserve.rollout.deployed import weights_for
from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.canary import (
    CanarySplit,
    Thresholds,
    baseline_weight,
    compare,
    reference,
)
from tests.fakes import MODEL
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.fleet import HOT_LOAD, deploy, fleet

CANARY = {"canary_weight": 50, "canary_duration_s": 1.5, "canary_min_requests": 3}


@pytest.fixture(scope="module")
def checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_variant(tiny_model, tmp_path_factory.mktemp("ckpts"), 1,
                         tensors=perturbed(0.01, seed=1))


def test_the_weight_sets_the_canarys_share_of_first_attempts_only():
    replicas = [Replica(id=f"r{i}", url=f"http://r{i}") for i in range(3)]
    split = CanarySplit("r0", 20, rng=random.Random(0))
    picks = [split.narrow(replicas, first_attempt=True) for _ in range(2000)]
    to_canary = sum(p == replicas[:1] for p in picks)
    assert 340 < to_canary < 460  # 20% of 2000, +-3 sigma
    assert all(p == replicas[:1] or p == replicas[1:] for p in picks)
    assert split.narrow(replicas, first_attempt=False) == replicas  # a retry: anywhere
    assert split.narrow(replicas[1:], first_attempt=True) == replicas[1:]  # canary gone


def test_a_baseline_gets_the_canarys_share_and_the_rest_of_the_fleet_the_remainder():
    replicas = [Replica(id=f"r{i}", url=f"http://r{i}") for i in range(4)]
    split = CanarySplit("r0", 20, baseline_id="r1", baseline_weight_pct=20,
                        rng=random.Random(0))
    picks = [split.narrow(replicas, first_attempt=True) for _ in range(2000)]
    assert 340 < sum(p == replicas[:1] for p in picks) < 460
    assert 340 < sum(p == replicas[1:2] for p in picks) < 460
    assert all(p in (replicas[:1], replicas[1:2], replicas[2:]) for p in picks)
    assert split.narrow(replicas, first_attempt=False) == replicas
    # The baseline out of rotation: its share goes to the others, never to the canary.
    without = [replicas[0], *replicas[2:]]
    picks = [split.narrow(without, first_attempt=True) for _ in range(2000)]
    assert 340 < sum(p == replicas[:1] for p in picks) < 460
    assert all(p in (replicas[:1], replicas[2:]) for p in picks)


@pytest.mark.parametrize(("weight", "replicas", "share"), [
    (20, 3, 20), (50, 3, 50), (60, 3, 40), (10, 8, 10), (20, 2, 80), (50, 2, 50)])
def test_the_baseline_carries_the_canarys_load_when_a_third_replica_takes_the_rest(
        weight, replicas, share):
    assert baseline_weight(weight, replicas) == share


def test_the_canary_is_judged_against_its_baseline_once_it_served_enough():
    limits = Thresholds(max_error_rate_delta=0.05, max_ttft_ratio=2.0, ttft_slack_ms=20,
                        min_requests=3)
    split = CanarySplit("r0", 20, baseline_id="r1", baseline_weight_pct=20)
    for _ in range(5):
        split.record("r0", Outcome.SUCCESS, 0.3)  # cold, like the baseline
        split.record("r2", Outcome.SUCCESS, 0.05)  # warm
    for _ in range(2):
        split.record("r1", Outcome.SUCCESS, 0.3)
    # Too few baseline requests yet: judged against everyone else, and failed.
    assert reference(split, limits)[0] == "the others"
    assert "TTFT p50 300 ms on the canary against 50 ms on the others" in compare(split,
                                                                                  limits)
    split.record("r1", Outcome.SUCCESS, 0.3)
    assert reference(split, limits) == ("the baseline r1", split.baseline)
    assert compare(split, limits) is None
    split.record("r0", Outcome.SERVER_ERROR, None)
    assert "on the baseline r1" in compare(split, limits)


@pytest.mark.parametrize(("canary", "others", "reason"), [
    ([(Outcome.SUCCESS, 0.1)] * 10, [(Outcome.SUCCESS, 0.1)] * 10, None),
    ([(Outcome.SUCCESS, 0.1)] * 2, [(Outcome.SUCCESS, 0.1)] * 10, "fewer than the 3"),
    ([(Outcome.SERVER_ERROR, None)] * 2 + [(Outcome.SUCCESS, 0.1)] * 8,
     [(Outcome.SUCCESS, 0.1)] * 10, "error rate 20.0% on the canary against 0.0%"),
    ([(Outcome.SUCCESS, 0.3)] * 10, [(Outcome.SUCCESS, 0.1)] * 10, "TTFT p50 300 ms"),
    # twice as slow, but by 1 ms: noise at this scale, under the 20 ms slack
    ([(Outcome.SUCCESS, 0.002)] * 10, [(Outcome.SUCCESS, 0.001)] * 10, None),
    ([(Outcome.SUCCESS, 0.025)] * 10, [(Outcome.SUCCESS, 0.001)] * 10, "and 20 ms slower"),
    ([(Outcome.CLIENT_ERROR, None)] * 5 + [(Outcome.SUCCESS, 0.1)] * 5,
     [(Outcome.SUCCESS, 0.1)] * 10, None),  # bad requests are not the replica's fault
    # ...nor its speed: 400s answered at once do not hide a slow canary's TTFT
    ([(Outcome.CLIENT_ERROR, 0.001)] * 20 + [(Outcome.SUCCESS, 0.3)] * 10,
     [(Outcome.SUCCESS, 0.1)] * 10, "TTFT p50 300 ms"),
])
def test_the_canary_is_judged_against_the_others(canary, others, reason):
    split = CanarySplit("r0", 50)
    for outcome, ttfb in canary:
        split.record("r0", outcome, ttfb)
    for outcome, ttfb in others:
        split.record("r1", outcome, ttfb)
    got = compare(split, Thresholds(max_error_rate_delta=0.05, max_ttft_ratio=2.0,
                                    ttft_slack_ms=20, min_requests=3))
    assert (got is None) if reason is None else (got is not None and reason in got)


async def deploy_under_load(f, checkpoint, **options):
    """Deploy while a client keeps sending; (status, record, every response's status)."""
    statuses: list[int] = []
    stop = asyncio.Event()

    async def load() -> None:
        async with httpx.AsyncClient(base_url=f.base, timeout=30) as c:
            while not stop.is_set():
                r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
                statuses.append(r.status_code)
                await asyncio.sleep(0.01)

    loading = asyncio.create_task(load())
    try:
        status, record = await deploy(f, checkpoint, **options)
    finally:
        stop.set()
        await loading
    return status, record, statuses


async def test_a_canary_serving_like_the_others_is_promoted(fake_replicas, tiny_model,
                                                            checkpoint):
    async with fleet(fake_replicas, tiny_model, 3) as f:
        status, record, statuses = await deploy_under_load(f, checkpoint, **CANARY)
        versions = f.versions()
    assert status == 202 and record["state"] == "succeeded", record
    canary = record["canary"]
    assert canary["passed"] is True and canary["replica"] == "r0"
    assert canary["against"] == "the baseline r1" and canary["baseline"]["weight"] == 50
    assert canary["canary"]["requests"] >= 3 and canary["baseline"]["requests"] >= 3
    assert set(statuses) == {200}
    assert versions == [weights_for(str(checkpoint)).version] * 3


async def test_a_canary_is_judged_against_a_baseline_as_cold_as_it(fake_replicas, tiny_model,
                                                                   checkpoint):
    """Every fake answers its first 15 requests after a prefix-cache reset 60 ms late.
    The canary (reset by its reload) and its baseline (reset as the window opens) pay
    that alike; the third replica, warm, does not. Judged against it, the same canary
    would fail at 1.5x and 20 ms."""
    async with fleet(fake_replicas, tiny_model, 3, cold_requests=15, cold_delay_s=0.06) as f:
        _, record, statuses = await deploy_under_load(
            f, checkpoint, **{**CANARY, "canary_weight": 30, "canary_duration_s": 2,
                              "canary_max_ttft_ratio": 1.5, "canary_ttft_slack_ms": 20})
        baseline_calls = list(f.fakes[1].dev_calls)
    assert record["state"] == "succeeded", record
    canary = record["canary"]
    assert canary["passed"] is True and canary["against"] == "the baseline r1", canary
    # Its own window's reset first, then the baseline's hot-load.
    assert baseline_calls[0] == "/reset_prefix_cache?reset_running_requests=true"
    assert baseline_calls[1:] == HOT_LOAD
    assert canary["baseline"]["weight"] == 30 and canary["others"]["requests"] >= 3
    warm, cold = canary["others"]["ttft_p50_ms"], canary["canary"]["ttft_p50_ms"]
    assert cold > 1.5 * warm and cold - warm > 20, canary  # what the others would judge
    assert set(statuses) == {200}


@pytest.mark.parametrize(("bad", "reason"), [
    ({"bad_mode": "error500"}, "error rate 100.0% on the canary"),
    ({"bad_delay_s": 0.2}, "on the canary against"),
], ids=["erroring", "slow"])
async def test_a_canary_serving_worse_is_rolled_back_with_the_comparison(
        fake_replicas, tiny_model, checkpoint, bad, reason):
    async with fleet(fake_replicas, tiny_model, 3, bad_weights="step-000001", **bad) as f:
        _, record, _ = await deploy_under_load(f, checkpoint, **CANARY)
        versions = f.versions()
    assert record["state"] == "rolled_back", record
    assert record["canary"]["passed"] is False and reason in record["canary"]["reason"]
    assert record["error"].startswith("r0: canary traffic: ") and reason in record["error"]
    assert versions == [weights_for(str(tiny_model)).version] * 3
    assert [r["phase"] for r in record["replicas"]][1:] == ["pending", "pending"]


async def test_dpserve_deploy_shows_the_canary_as_it_runs(fake_replicas, tiny_model,
                                                          checkpoint):
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 2) as f, AdminClient(f.base) as client:
        stop = asyncio.Event()

        async def load() -> None:
            async with httpx.AsyncClient(base_url=f.base, timeout=30) as c:
                while not stop.is_set():
                    await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})

        loading = asyncio.create_task(load())
        code = await run_deploy(client, checkpoint, {**CANARY, "canary_duration_s": 6}, out)
        stop.set()
        await loading
    lines = [ln for ln in out.getvalue().splitlines() if "canary r0" in ln]
    assert code == 0 and len(lines) >= 2, out.getvalue()  # while it runs, then the verdict
    assert lines[-1].strip().startswith("canary r0 6/6 s at 50%: ")
    assert lines[-1].endswith("; passed") and " · baseline r1 at 50%: " in lines[-1]


@pytest.mark.parametrize(("options", "param", "message"), [
    ({"canary_weight": 0}, "canary_weight", "in (0, 100)"),
    ({"canary_weight": 100}, "canary_weight", "in (0, 100)"),
    ({"canary_weight": 10, "canary_duration_s": 0}, "canary_duration_s", "in (0,"),
    ({"canary_duration_s": 30}, "canary_weight", "need canary_weight"),
    ({"canary_weight": 10, "canary_max_ttft_ratio": 0.5}, "canary_max_ttft_ratio", "1..1e+06"),
    ({"canary_weight": 10, "canary_ttft_slack_ms": -1}, "canary_ttft_slack_ms", "0..1e+06"),
    ({"canary_weight": 10, "canary_min_requests": 2.5}, "canary_min_requests", "an integer"),
], ids=["zero", "hundred", "no-duration", "no-weight", "ratio-below-1", "negative-slack",
         "fractional"])
async def test_bad_canary_options_are_refused_and_change_nothing(
        fake_replicas, tiny_model, checkpoint, options, param, message):
    async with fleet(fake_replicas, tiny_model, 2) as f:
        status, body = await deploy(f, checkpoint, **options)
        versions = f.versions()
    assert status == 400 and body["error"]["param"] == param
    assert message in body["error"]["message"]
    assert versions == [weights_for(str(tiny_model)).version] * 2


async def test_a_single_replica_has_no_canary(fake_replicas, tiny_model, checkpoint):
    async with fleet(fake_replicas, tiny_model, 1) as f:
        status, body = await deploy(f, checkpoint, canary_weight=10)
    assert status == 400 and "a single replica has none to compare with" in \
        body["error"]["message"]
