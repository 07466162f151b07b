"""The hot-load calls to one engine (`EngineAdmin`), against the shared fake replica:
each step names itself when it fails, and the canary tells a poisoned engine (NaN or
infinite logprobs) from a merely failing one."""

from __future__ import annotations

import httpx
import pytest

from dpserve.replicas.launcher import free_port
from dpserve.rollout.engine_admin import EngineAdmin, EngineAdminError
from tests.fakes import MODEL


async def test_a_hot_load_is_the_dev_calls_vllm_documents_in_order(fake_replicas):
    fake = await fake_replicas("f0")
    async with httpx.AsyncClient() as client:
        admin = EngineAdmin(client, fake.url + "/")
        await admin.pause()
        assert fake.paused
        await admin.reload_weights("/snapshots/step-000001-abc")
        await admin.reset_prefix_cache()
        await admin.resume()
        canary = await admin.canary(MODEL, "The quick brown fox")
        await admin.set_weight_version("step-000001@abcd1234")
    assert fake.dev_calls == ["/pause?mode=keep", "/collective_rpc",
                              "/reset_prefix_cache?reset_running_requests=true", "/resume",
                              "/update_weight_version"]
    assert fake.weights == "/snapshots/step-000001-abc"
    assert fake.weight_version == "step-000001@abcd1234" and not fake.paused
    assert canary.token_logprobs and all(lp <= 0 for lp in canary.token_logprobs)


@pytest.mark.parametrize("step, call", [
    ("pause", lambda a: a.pause()),
    ("reload", lambda a: a.reload_weights("/x")),
    ("reset_prefix_cache", lambda a: a.reset_prefix_cache()),
    ("resume", lambda a: a.resume()),
    ("update_weight_version", lambda a: a.set_weight_version("v")),
])
async def test_a_failing_step_is_an_error_naming_the_step_and_the_replicas_answer(
        fake_replicas, step, call):
    fake = await fake_replicas("f0", fail={step: "error"})
    async with httpx.AsyncClient() as client:
        with pytest.raises(EngineAdminError) as caught:
            await call(EngineAdmin(client, fake.url))
    assert caught.value.step == step
    assert f"HTTP 500: fake {step} failure on f0" in str(caught.value)
    assert not caught.value.non_finite


async def test_a_canary_that_cannot_encode_its_logprobs_marks_the_engine_poisoned(
        fake_replicas):
    fake = await fake_replicas("f0", fail={"canary": "nan"}, weights="/reloaded")
    async with httpx.AsyncClient() as client:
        with pytest.raises(EngineAdminError) as caught:
            await EngineAdmin(client, fake.url).canary(MODEL, "hi")
    assert caught.value.step == "canary" and caught.value.non_finite


async def test_an_unreachable_engine_is_an_error_not_a_hang():
    async with httpx.AsyncClient() as client:
        with pytest.raises(EngineAdminError) as caught:
            await EngineAdmin(client, f"http://127.0.0.1:{free_port()}").pause()
    assert caught.value.step == "pause"
    assert "ConnectError" in str(caught.value)
