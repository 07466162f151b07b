"""`dpserve top` as a person runs it: in a terminal (tmux), against a real `dpserve router`
process in front of the shared fake replicas (tests/fakes.py), then `q`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from dpserve.replicas.launcher import free_port
from tests.fakes import MODEL
from tests.procs import process_alive, processes_in_group
from tests.top.terminal import TMUX, Terminal
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(not os.path.exists(TMUX), reason="needs tmux")

DPSERVE = [sys.executable, "-m", "dpserve"]


@contextlib.asynccontextmanager
async def router_process(port: int, replicas: list[str], log: Path, *,
                         admin_key: str | None = None, policy: str | None = None
                         ) -> AsyncIterator[str]:
    """`dpserve router` on 127.0.0.1:`port` serving `base:fake-model`, its replicas all
    ready; stopped after."""
    args = [a for url in replicas for a in ("--replica", url)]
    args += ["--policy", policy] if policy is not None else []
    model = log.parent / MODEL  # a model directory, as `--base-model` must name
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPSERVE_")}
    if admin_key is not None:
        env["DPSERVE_ADMIN_KEY"] = admin_key
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *DPSERVE, "router", *args, "--base-model", str(model), "--port", str(port),
            "--health-interval-s", "0.2", "--log-level", "warning", stdout=out, stderr=out,
            env=env)
    base = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        async with httpx.AsyncClient(timeout=2.0, headers=headers) as client:
            async def all_ready() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(await asyncio.to_thread(log.read_text))
                with contextlib.suppress(httpx.HTTPError):
                    body = (await client.get(base + "/admin/replicas")).json()
                    return [r["state"] for r in body["replicas"]] == ["ready"] * len(replicas)
                return False

            await wait_for(all_ready, "the router's replicas all ready", within_s=30,
                           every_s=0.1)
        yield base
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


@contextlib.contextmanager
def terminal(tmp_path: Path, router: str) -> Iterator[Terminal]:
    term = Terminal(tmp_path, ["env", "-u", "DPSERVE_ADMIN_KEY", *DPSERVE, "top",
                               "--router", router, "--interval", "0.5"])
    try:
        yield term
    finally:
        term.close()


async def shows(term: Terminal, *texts: str, within_s: float = 30) -> str:
    """The screen, once every one of `texts` is on it."""
    async def screen() -> str | None:
        text = await asyncio.to_thread(term.capture)
        return text if all(t in text for t in texts) else None

    try:
        return await wait_for(screen, f"{texts} on the screen", within_s=within_s,
                              every_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the screen:\n{term.capture()}") from None


async def quits_cleanly(term: Terminal, key: str = "q") -> None:
    """`key` ends `dpserve top` with status 0 and nothing of it left running."""
    term.keys(key)
    await wait_for(lambda: term.exit_status() is not None, "dpserve top to exit",
                   within_s=15, every_s=0.1)
    assert term.exit_status() == 0
    pid = term.pane_pid
    assert pid is not None
    await wait_for(lambda: not process_alive(pid) and not processes_in_group(pid),
                   "the pane's processes to end", within_s=10, every_s=0.1)


def row(screen: str, replica: str) -> str:
    """The line of `replica`'s row (its first word is the replica id)."""
    lines = [ln for ln in screen.splitlines() if ln.split() and ln.split()[0] == replica]
    assert lines, f"no row for {replica}:\n{screen}"
    return lines[0]


async def test_top_shows_every_replica_live_and_q_quits(fake_replicas, tmp_path):
    a = await fake_replicas("a")
    b = await fake_replicas("b")
    async with router_process(free_port(), [a.url, b.url], tmp_path / "router.log") as base:
        with terminal(tmp_path, base) as term:
            screen = await shows(term, "r0", "r1", "2 replicas, 2 ready")
            assert "prefix hit" in screen and "KV index" not in screen
            for replica in ("r0", "r1"):
                assert row(screen, replica).split()[1:3] == ["ready", f"base:{MODEL}"]
            async with httpx.AsyncClient(timeout=10) as client:
                resp = await client.post(base + "/v1/completions",
                                         json={"model": MODEL, "prompt": "hi"})
                assert resp.status_code == 200
            # The fake's TTFT histogram counts that request under 0.1 s: p50 50 ms.
            screen = await shows(term, "50 ms", "99 ms")
            await quits_cleanly(term)


async def test_under_kv_aware_top_shows_the_kv_index_and_the_routing_summary(
        fake_replicas, tmp_path):
    a = await fake_replicas("a")  # offers no KV events: the router does not follow it
    async with router_process(free_port(), [a.url], tmp_path / "router.log",
                              policy="kv-aware") as base:
        with terminal(tmp_path, base) as term:
            screen = await shows(term, "KV index", "kv-aware: - on events", " off ")
            assert row(screen, "r0").split()[-3:] == ["off", "-", "-"]  # then util, memory
            await quits_cleanly(term)


async def test_a_router_that_is_down_is_a_message_and_top_retries_until_it_is_up(
        fake_replicas, tmp_path):
    port = free_port()
    with terminal(tmp_path, f"http://127.0.0.1:{port}") as term:
        await shows(term, f"cannot reach the router at http://127.0.0.1:{port}",
                    "retrying every 0.5 s")
        assert "Traceback" not in term.capture()
        a = await fake_replicas("a")
        async with router_process(port, [a.url], tmp_path / "router.log"):
            screen = await shows(term, "1 replica, 1 ready")
            assert "ready" in row(screen, "r0")
            await quits_cleanly(term)


async def test_a_router_that_wants_an_admin_key_is_a_message_not_a_traceback(
        fake_replicas, tmp_path):
    a = await fake_replicas("a")
    async with router_process(free_port(), [a.url], tmp_path / "router.log",
                              admin_key="top-admin-key-0123456789") as base:
        with terminal(tmp_path, base) as term:
            screen = await shows(term, "the router refused the admin key (HTTP 401",
                                 "DPSERVE_ADMIN_KEY", "retrying every 0.5 s")
            assert "Traceback" not in screen
            await quits_cleanly(term, "C-c")  # as `top` quits
