"""The adapter deploy's order of events, against engines that fail on cue.

The real engines' side (vLLM loading, serving and unloading adapters) is covered
by the integration tests; these check what the router does around it: nothing
half-loaded after a failure, the name switched only once every replica has the
version, a retiring version unloaded only when its last request ended.
"""

from __future__ import annotations

import asyncio

import pytest

from dpserve.rollout.adapter_rollout import (
    AdapterLoadFailed,
    converge,
    load_everywhere,
    retire,
)
from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.pool import Replica, ReplicaState


class EngineAdapters:
    """What one engine holds, recording calls; `fail` names engine names it refuses."""

    def __init__(self, fail: frozenset[str] = frozenset()) -> None:
        self.loaded: dict[str, str] = {}
        self.fail = fail
        self.calls: list[str] = []

    async def load_lora(self, name: str, path: str) -> None:
        self.calls.append(f"load {name}")
        await asyncio.sleep(0)
        if name in self.fail:
            raise EngineAdminError("load_lora_adapter", "HTTP 500: cannot load")
        self.loaded[name] = path

    async def unload_lora(self, name: str) -> None:
        self.calls.append(f"unload {name}")
        self.loaded.pop(name)


def fleet(n: int = 2, **fail: frozenset[str]) -> tuple[list[Replica], dict[str, EngineAdapters]]:
    replicas = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}", state=ReplicaState.READY)
                for i in range(n)]
    engines = {r.id: EngineAdapters(fail.get(r.id, frozenset())) for r in replicas}
    return replicas, engines


def version(v: str) -> AdapterVersion:
    return AdapterVersion(name="support", version=v, path=f"/snap/{v}", rank=8)


async def test_a_version_serves_once_every_replica_has_it():
    replicas, engines = fleet()
    adapters = Adapters()
    v1 = version("v1")
    await load_everywhere(adapters, v1, replicas, lambda r: engines[r.id])
    assert adapters.resolve("support") is v1
    assert all(e.loaded == {"support@v1": "/snap/v1"} for e in engines.values())
    assert all("support@v1" in r.models for r in replicas)


async def test_a_replica_that_cannot_load_leaves_nothing_loaded_and_the_name_unchanged():
    replicas, engines = fleet(r1=frozenset({"support@v2"}))
    adapters = Adapters()
    admin = lambda r: engines[r.id]  # noqa: E731
    await load_everywhere(adapters, v1 := version("v1"), replicas, admin)
    with pytest.raises(AdapterLoadFailed, match=r"replica r1: load_lora_adapter: HTTP 500"):
        await load_everywhere(adapters, version("v2"), replicas, admin)
    assert adapters.resolve("support") is v1 and not v1.retiring
    assert adapters.get("support@v2") is None
    assert all(e.loaded == {"support@v1": "/snap/v1"} for e in engines.values())
    assert all(r.models == {"support@v1"} for r in replicas)


async def test_replicas_out_of_rotation_are_skipped_and_converged_before_serving_again():
    replicas, engines = fleet()
    replicas[1].state = ReplicaState.DOWN
    adapters = Adapters()
    await load_everywhere(adapters, version("v1"), replicas, lambda r: engines[r.id])
    assert engines["r1"].loaded == {}
    replicas[1].models = frozenset({"base"})  # restarted: its /v1/models shows the base only
    await converge(adapters, replicas[1], engines["r1"])
    assert engines["r1"].loaded == {"support@v1": "/snap/v1"}
    assert replicas[1].models == {"base", "support@v1"}


async def test_a_retiring_version_is_unloaded_only_after_its_last_request():
    replicas, engines = fleet()
    adapters = Adapters()
    admin = lambda r: engines[r.id]  # noqa: E731
    await load_everywhere(adapters, v1 := version("v1"), replicas, admin)
    lease = adapters.lease(v1)
    lease.__enter__()  # a stream still running on v1
    await load_everywhere(adapters, version("v2"), replicas, admin)
    retiring = asyncio.create_task(retire(adapters, v1, lambda: replicas, admin))
    await asyncio.sleep(0.2)
    assert not retiring.done() and all("support@v1" in e.loaded for e in engines.values())
    lease.__exit__(None, None, None)
    await asyncio.wait_for(retiring, 5)
    assert all(e.loaded == {"support@v2": "/snap/v2"} for e in engines.values())
    assert adapters.get("support@v1") is None and adapters.resolve("support@v2") is not None


async def test_no_serving_replica_is_a_clear_failure():
    replicas, engines = fleet()
    for r in replicas:
        r.state = ReplicaState.STARTING
    with pytest.raises(AdapterLoadFailed, match="no replica is serving"):
        await load_everywhere(Adapters(), version("v1"), replicas, lambda r: engines[r.id])


async def test_a_failed_version_is_unloaded_from_a_replica_admitted_during_the_load():
    replicas, engines = fleet(r1=frozenset({"support@v1"}))
    replicas.append(late := Replica("r2", "http://127.0.0.1:9002", state=ReplicaState.STARTING))
    engines["r2"] = EngineAdapters()
    adapters = Adapters()
    admitted: list[asyncio.Task[None]] = []

    def admin_for(r):
        if r.id == "r1" and late.state is ReplicaState.STARTING:  # r2 turns ready meanwhile
            late.state = ReplicaState.READY
            admitted.append(asyncio.get_running_loop().create_task(
                converge(adapters, late, engines["r2"])))
        return engines[r.id]

    with pytest.raises(AdapterLoadFailed):
        await load_everywhere(adapters, version("v1"), replicas, admin_for)
    await asyncio.wait_for(asyncio.gather(*admitted), 5)  # its load may end after the rollback
    assert all(e.loaded == {} for e in engines.values())
    assert "support@v1" not in late.models


async def test_replicas_load_one_at_a_time_and_new_requests_avoid_the_one_loading():
    replicas, _ = fleet(3)
    seen: list[tuple[str, list[str | None]]] = []

    class Watching(EngineAdapters):
        async def load_lora(self, name: str, path: str) -> None:
            seen.append((name, [r.avoid for r in replicas]))
            await super().load_lora(name, path)

    watched = {r.id: Watching() for r in replicas}
    await load_everywhere(Adapters(), version("v1"), replicas, lambda r: watched[r.id])
    loading = "loading adapter support@v1"
    assert [avoid for _, avoid in seen] == [[loading, None, None], [None, loading, None],
                                            [None, None, loading]]
    assert all(r.avoid is None for r in replicas)


async def test_a_failed_load_leaves_the_later_replicas_untouched():
    replicas, engines = fleet(3, r1=frozenset({"support@v1"}))
    with pytest.raises(AdapterLoadFailed, match="replica r1"):
        await load_everywhere(Adapters(), version("v1"), replicas, lambda r: engines[r.id])
    assert engines["r0"].calls == ["load support@v1", "unload support@v1"]
    assert engines["r2"].calls == []
    assert all(r.avoid is None for r in replicas)


async def test_a_lone_replica_loads_in_place():
    replicas, _ = fleet(1)
    marks: list[str | None] = []

    class Watching(EngineAdapters):
        async def load_lora(self, name: str, path: str) -> None:
            marks.append(replicas[0].avoid)
            await super().load_lora(name, path)

    await load_everywhere(Adapters(), version("v1"), replicas, lambda r: Watching())
    assert marks == [None]
