"""`dpserve deploy` and `dpserve status` against a real router in front of FakeReplicas
(tests/fakes.py); the real-vLLM path is in tests/integration/test_deploy.py."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest

from dpserve.cli import main
from dpserve.rollout.client import (
    AdminClient,
    ReplicaLines,
    read_admin_key,
    run_deploy,
    run_status,
    run_watch,
    shown_path,
)
from dpserve.rollout.deployed import weights_for
from tests.conftest import running_router
from tests.fakes import MODEL
from tests.rollout.checkpoints import perturbed, write_variant
from tests.rollout.test_rollout import fleet

ADMIN_KEY = "admin-key-0123456789abcdef"


def test_a_path_below_the_working_directory_is_shown_as_typed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shown_path(str(tmp_path / "runs" / "ft" / "step-000040")) == "runs/ft/step-000040"
    assert shown_path("/elsewhere/step-000040") == "/elsewhere/step-000040"


async def test_deploy_prints_each_replica_and_exits_0(fake_replicas, tiny_model, tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path, 3, tensors=perturbed(0.01, seed=3))
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 2) as f, AdminClient(f.base) as client:
        code = await run_deploy(client, ckpt_dir, {"batch": 1}, out)
        status_out = io.StringIO()
        await run_status(client, status_out)
    version = weights_for(str(ckpt_dir)).version
    text = out.getvalue()
    assert code == 0, text
    assert text.startswith("deploy ") and f": {ckpt_dir}\n" in text.splitlines(True)[0]
    assert f"version {version} (was base:tiny-llama), 2 replica(s), 1 at a time" in text
    assert "r0   done" in text and "r1   done" in text
    # the phases the client saw, each with the time of the steps it took (the fakes are
    # too quick for a 0.25 s poll to see every phase)
    assert text.count("pre-check canary ") == 2 and text.count(" reload ") == 2
    assert text.index("r0   done") < text.index("r1   done")
    assert "succeeded in" in text and f"{version} is deployed" in text
    table = status_out.getvalue().splitlines()
    assert table[0].split() == ["replica", "state", "in-flight", "weight", "version", "device",
                                "url"]
    assert table[1].split()[:4] == ["r0", "ready", "0", version]
    assert table[-1].startswith("last deploy ") and "succeeded" in table[-1]


def test_a_phase_that_lasts_gets_a_line_every_10_s_saying_what_it_waits_for():
    lines = ReplicaLines()
    r = {"id": "r0", "phase": "precheck", "note": "", "error": None, "steps": {},
         "seconds": None, "version": None}
    assert lines.update([r], 0.0) == ["r0   precheck"]
    assert lines.update([r], 9.0) == []
    assert lines.update([r], 10.5) == ["r0   precheck    still, after 10 s"]
    assert lines.update([r], 12.0) == []
    assert lines.update([r], 20.2) == ["r0   precheck    still, after 20 s"]
    done = r | {"phase": "done", "seconds": 0.3, "version": "v2",
                "steps": {"precheck": 21.5, "reload": 0.2}}
    assert lines.update([done], 21.0) == [
        "r0   done        in 0.30 s, now serving v2 (pre-check canary 21.50 s, reload 0.20 s)"]
    assert lines.update([done], 60.0) == []  # done is not waiting for anything


async def test_a_refused_deploy_exits_1_with_the_reason(fake_replicas, tiny_model):
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 1, checkpoint_root=tiny_model.parent) as f, \
            AdminClient(f.base) as client:
        code = await run_deploy(client, tiny_model, {}, out)
    assert code == 1
    assert "deploy refused: HTTP 422:" in out.getvalue() and "no dpserve.json" in out.getvalue()


async def test_watch_deploys_each_new_checkpoint_once(fake_replicas, tiny_model, tmp_path):
    output = tmp_path / "out"
    first = write_variant(tiny_model, output, 1, tensors=perturbed(0.01, seed=1))
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 2) as f, AdminClient(f.base) as client:
        watching = asyncio.create_task(run_watch(client, output, {}, out, interval_s=0.05,
                                                 max_deploys=2, timeout_s=60))
        want = weights_for(str(first)).version
        while f.versions() != [want, want]:
            assert not watching.done(), out.getvalue()
            await asyncio.sleep(0.02)
        second = write_variant(tiny_model, output, 2, tensors=perturbed(0.01, seed=2))
        code = await watching
    assert code == 0, out.getvalue()
    assert f.versions() == [weights_for(str(second)).version] * 2
    assert out.getvalue().count("deploy ") >= 2
    assert "stopped watching: 2 deploy(s), 0 not succeeded" in out.getvalue()


async def test_watch_stops_at_its_deadline(fake_replicas, tiny_model, tmp_path):
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 1) as f, AdminClient(f.base) as client:
        code = await run_watch(client, tmp_path / "empty", {}, out, interval_s=0.02,
                               max_deploys=None, timeout_s=0.1)
    assert code == 0 and "stopped watching: 0 deploy(s)" in out.getvalue()


async def test_the_admin_key_is_sent_when_the_router_wants_one(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], admin_key=ADMIN_KEY) as (base, _):
        async with AdminClient(base) as anonymous:
            out = io.StringIO()
            assert await run_status(anonymous, out) == 1
        async with AdminClient(base, ADMIN_KEY) as admin:
            assert (await admin.replicas())[0]["id"] == "r0"
    assert "HTTP 401: missing or invalid admin key" in out.getvalue()


def test_the_admin_key_comes_from_a_file_or_the_environment(tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text("# rotated monthly\n" + ADMIN_KEY + "\n")
    assert read_admin_key(str(key_file), {}) == ADMIN_KEY
    assert read_admin_key(None, {"DPSERVE_ADMIN_KEY": "from-env"}) == "from-env"
    assert read_admin_key(None, {}) is None


@pytest.mark.parametrize("command", [["status"], ["deploy", "/tmp/x"]])
def test_a_command_with_no_router_to_talk_to_says_how_to_start_or_find_one(command, capsys):
    assert main([*command, "--router", "http://127.0.0.1:9"]) == 1
    out = capsys.readouterr().out
    assert "no router answers at http://127.0.0.1:9: start one with `dpserve serve" in out
    assert "point --router (or $DPSERVE_ROUTER_URL) at the one running" in out


def test_deploy_needs_a_checkpoint_or_a_directory_to_watch(capsys):
    with pytest.raises(SystemExit):
        main(["deploy"])
    assert "one of the arguments CHECKPOINT_DIR --watch is required" in capsys.readouterr().err


async def test_deploy_says_how_many_responses_may_mix_two_versions(fake_replicas, tiny_model,
                                                                    tmp_path):
    ckpt_dir = write_variant(tiny_model, tmp_path, 4, tensors=perturbed(0.01, seed=4))
    out = io.StringIO()
    async with fleet(fake_replicas, tiny_model, 2, chunks=40, chunk_delay_s=0.05) as f, \
            AdminClient(f.base) as client, httpx.AsyncClient(base_url=f.base) as c:
        stream = asyncio.create_task(c.post("/v1/completions", json={
            "model": MODEL, "prompt": "long", "stream": True}, timeout=30))
        while sum(r.in_flight for r in f.router.pool) == 0:
            await asyncio.sleep(0.01)
        code = await run_deploy(client, ckpt_dir, {}, out)
        assert (await stream).status_code == 200
    assert code == 0
    assert ("up to 1 response(s) in flight at a pause finished on the new weights "
            "(--no-mixed-versions to avoid)") in out.getvalue()
