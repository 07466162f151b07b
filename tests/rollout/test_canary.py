"""Canary traffic in a deploy (`--canary-weight`): the split, the comparison, promotion
and rollback, against FakeReplicas whose new weights can serve badly on cue."""

from __future__ import annotations

import asyncio
import io
import random
import re
from pathlib import Path

import httpx
import pytest

from dpserve.rollout.canary_phase import pick_baseline, window
from dpserve.rollout.client import AdminClient, run_deploy, run_status
from dpserve.rollout.deployed import weights_for
from dpserve.rollout.progress import DeployOptions
from dpserve.router.fleet.breaker import Outcome
from dpserve.router.fleet.pool import Replica
from dpserve.router.routing.canary import CanarySplit, baseline_weight
from dpserve.router.routing.canary_verdict import Rule, reference
from tests.fakes import MODEL
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.fleet import HOT_LOAD, deploy, fleet

CANARY = {"canary_weight": 50, "canary_duration_s": 2, "canary_max_duration_s": 12,
          "canary_min_requests": 3, "canary_max_error_rate_delta": 0.5,
          "canary_ttft_slack_ms": 100}
"""A short window, extended while unsure: 0 errors in 15 requests a side is 'within 50
points' at 95%, and fakes answer in a few ms, where 100 ms is noise on a busy
machine."""


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
    rule = Rule(min_requests=3)
    split = CanarySplit("r0", 20, baseline_id="r1", baseline_weight_pct=20)
    for _ in range(5):
        split.record("r0", Outcome.SUCCESS, 0.3)
        split.record("r2", Outcome.SUCCESS, 0.05)
    for _ in range(2):
        split.record("r1", Outcome.SUCCESS, 0.3)
    assert reference(split, rule)[0] == "the others"  # too few baseline requests yet
    split.record("r1", Outcome.SUCCESS, 0.3)
    assert reference(split, rule) == ("the baseline r1", split.baseline)


def test_the_baseline_shares_the_canarys_device_when_one_does():
    """CPU replicas on the same cores have the same neighbours: the fairest baseline."""
    rs = [Replica(id=f"r{i}", url=f"http://r{i}", device=f"cpu:{i % 2}", weight_version="a")
          for i in range(4)]
    rs[0].weight_version = "b"
    assert pick_baseline(rs, rs[0]) is rs[2]
    gpus = [Replica(id=f"r{i}", url=f"http://r{i}", device=f"gpu:{i}", weight_version="a")
            for i in range(3)]
    gpus[1].weight_version = "b"
    assert pick_baseline(gpus, gpus[1]) is gpus[0]  # none shares: the next one
    gpus[0].weight_version = gpus[2].weight_version = "b"
    assert pick_baseline(gpus, gpus[1]) is None  # all on the canary's version


@pytest.mark.parametrize(("duration", "longest", "every", "looks"), [
    (60, None, 15, 8), (60, 60, 15, 4), (40, 100, 10, 10), (10, 5, 2.5, 4)])
def test_a_window_is_looked_at_every_quarter_until_its_longest(duration, longest, every,
                                                               looks):
    w = window(DeployOptions(canary_weight=10, canary_duration_s=duration,
                             canary_max_duration_s=longest))
    assert (w.every_s, w.rule.looks, w.max_s) == (every, looks, every * looks)


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
    """After a prefix-cache reset, every fake answers 60 ms late for the rest of the test
    (a cache that stays cold through the window, so the medians below cannot depend on
    how many requests the window took). The canary (reset by its reload) and its
    baseline (reset as the window opens) pay that alike; the third replica, warm, does
    not. Judged against it, the same canary would fail at 1.5x and 20 ms."""
    async with fleet(fake_replicas, tiny_model, 3, cold_requests=1_000_000,
                     cold_delay_s=0.06) as f:
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
    ({"bad_mode": "error500"}, "errors "),
    ({"bad_delay_s": 0.2}, "TTFT "),
], ids=["erroring", "slow"])
async def test_a_canary_serving_worse_is_rolled_back_with_the_comparison(
        fake_replicas, tiny_model, checkpoint, bad, reason):
    async with fleet(fake_replicas, tiny_model, 3, bad_weights="step-000001", **bad) as f:
        _, record, _ = await deploy_under_load(f, checkpoint,
                                               **{**CANARY, "canary_ttft_slack_ms": 20})
        versions = f.versions()
    assert record["state"] == "rolled_back", record
    canary = record["canary"]
    assert canary["passed"] is False and canary["outcome"] == "failed", canary
    assert canary["reason"].startswith("worse than the baseline r1 at 95% confidence: " + reason)
    assert record["error"] == "r0: canary traffic: " + canary["reason"]
    assert versions == [weights_for(str(tiny_model)).version] * 3
    assert [r["phase"] for r in record["replicas"]][1:] == ["pending", "pending"]


@pytest.mark.parametrize(("means", "state", "action"), [
    ("rollback", "rolled_back", "rolled_back"), ("promote", "succeeded", "promoted")])
async def test_a_window_still_unsure_at_its_end_does_what_the_flag_says(
        fake_replicas, tiny_model, checkpoint, means, state, action):
    options = {**CANARY, "canary_duration_s": 1, "canary_max_duration_s": 1,
               "canary_min_requests": 1_000_000, "canary_inconclusive": means}
    async with fleet(fake_replicas, tiny_model, 3) as f:
        _, record, statuses = await deploy_under_load(f, checkpoint, **options)
        async with httpx.AsyncClient(base_url=f.base) as c:
            metrics = (await c.get("/metrics")).text
    assert record["state"] == state, record
    canary = record["canary"]
    assert canary["outcome"] == "inconclusive" and canary["looks"] == 4
    assert canary["passed"] is (means == "promote")
    # The baseline too served fewer than the minimum: judged against everyone else.
    assert canary["reason"].startswith("unsure against the others at 95% confidence: TTFT ")
    assert "fewer than the 1000000 each needs" in canary["reason"]
    assert canary["reason"].endswith(f"s, 4 looks); inconclusive means {means}")
    assert canary["verdict"]["outcome"] == "unsure"
    assert (f'dpserve_canary_windows_total{{action="{action}",verdict="inconclusive"}} 1.0'
            in metrics)
    assert set(statuses) == {200}


async def test_the_metrics_carry_the_last_verdicts_interval(fake_replicas, tiny_model,
                                                           checkpoint):
    async with fleet(fake_replicas, tiny_model, 3) as f:
        _, record, _ = await deploy_under_load(f, checkpoint, **CANARY)
        async with httpx.AsyncClient(base_url=f.base) as c:
            metrics = (await c.get("/metrics")).text
    assert record["state"] == "succeeded", record
    ttft = record["canary"]["verdict"]["ttft_ratio"]
    assert 'dpserve_canary_windows_total{action="promoted",verdict="passed"} 1.0' in metrics
    for bound in ("estimate", "low"):
        line = next(ln for ln in metrics.splitlines() if ln.startswith(
            f'dpserve_canary_last{{bound="{bound}",check="ttft_ratio"}}'))
        assert float(line.split()[-1]) == pytest.approx(ttft[bound], abs=1e-3)
    assert (f'dpserve_canary_last{{bound="canary",check="answers"}} '
            f'{float(ttft["canary_n"])}') in metrics


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
        status = io.StringIO()
        await run_status(client, status)
    lines = [ln for ln in out.getvalue().splitlines() if "canary r0" in ln]
    assert code == 0 and len(lines) >= 2, out.getvalue()  # while it runs, then the verdict
    assert re.match(r"canary r0 \d/6 s at 50%: ", lines[-1].strip()), lines
    assert "; passed: not worse than the baseline r1 at 95% confidence: TTFT " in lines[-1]
    assert " · baseline r1 at 50%: " in lines[-1]
    assert status.getvalue().splitlines()[-1] == lines[-1]  # `dpserve status` says it too


@pytest.mark.parametrize(("options", "param", "message"), [
    ({"canary_weight": 0}, "canary_weight", "in (0, 100)"),
    ({"canary_weight": 100}, "canary_weight", "in (0, 100)"),
    ({"canary_weight": 10, "canary_duration_s": 0}, "canary_duration_s", "in (0,"),
    ({"canary_duration_s": 30}, "canary_weight", "need canary_weight"),
    ({"canary_weight": 10, "canary_max_ttft_ratio": 0.5}, "canary_max_ttft_ratio", "1..1e+06"),
    ({"canary_weight": 10, "canary_ttft_slack_ms": -1}, "canary_ttft_slack_ms", "0..1e+06"),
    ({"canary_weight": 10, "canary_min_requests": 2.5}, "canary_min_requests", "an integer"),
    ({"canary_weight": 10, "canary_confidence": 1}, "canary_confidence", "in (0.5, 1)"),
    ({"canary_weight": 10, "canary_max_duration_s": 0}, "canary_max_duration_s", "in (0,"),
    ({"canary_weight": 10, "canary_inconclusive": "maybe"}, "canary_inconclusive",
     "rollback or promote"),
    ({"canary_inconclusive": "promote"}, "canary_weight", "need canary_weight"),
], ids=["zero", "hundred", "no-duration", "no-weight", "ratio-below-1", "negative-slack",
         "fractional", "certain", "no-longest", "inconclusive-what", "inconclusive-alone"])
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
