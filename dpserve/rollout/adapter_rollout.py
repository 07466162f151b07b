"""Putting a validated adapter version into service, and a replaced one out of it.

    load NAME@V on every replica ─▶ switch NAME to V (one assignment, no await)
        ─▶ the old version retires: no new request, running ones finish on it
        ─▶ none left: unload it from every replica

Loading an adapter pauses nothing the router can see, but the engine stops
stepping while it reads the new one: replicas load one at a time, and new
requests avoid the one loading (`Replica.avoid`) while another can take them.
Failure: if any replica cannot load the version, the rest are not tried, it is
unloaded from those that did and forgotten; the name keeps meaning what it meant
(rollback). A replica that is down or starting at deploy time is skipped here and
given every served version before it turns ready again (`converge`), so a
restarted engine never answers a request for an adapter it lacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.pool import Replica, ReplicaState

log = logging.getLogger("dpserve.rollout.adapters")

RETIRE_POLL_S = 0.05


class AdapterAdmin(Protocol):
    async def load_lora(self, name: str, path: str) -> None: ...

    async def unload_lora(self, name: str) -> None: ...


AdminFor = Callable[[Replica], AdapterAdmin]
"""The admin calls of one replica (an EngineAdmin over the deploy's client)."""


class AdapterLoadFailed(Exception):
    """A version could not be loaded everywhere; it was unloaded where it had been."""


async def load_everywhere(adapters: Adapters, version: AdapterVersion,
                          replicas: Iterable[Replica], admin_for: AdminFor) -> None:
    """Load `version` into every serving replica, then make its name mean it.
    AdapterLoadFailed (nothing left loaded, the name unchanged) if any replica fails.

    A vLLM engine stops stepping while it loads an adapter (0.1 to 2 s seen on CPU), so
    with several replicas serving they load one at a time, each avoided by new
    requests meanwhile: no request starts on an engine that cannot run it. A lone
    replica loads in place (its requests wait; there is nowhere else to send them).
    """
    replicas = list(replicas)
    targets = [r for r in replicas if r.state in (ReplicaState.READY, ReplicaState.DRAINING)]
    if not targets:
        raise AdapterLoadFailed("no replica is serving: nothing to load the adapter into")
    adapters.add(version)
    failed: list[tuple[Replica, BaseException]] = []
    alone = len(targets) == 1
    for replica in targets:
        if not alone:
            replica.avoid = f"loading adapter {version.engine_name}"
        try:
            error = await _load(admin_for(replica), replica, version)
        finally:
            replica.avoid = None
        if error is not None:  # the rest are left untouched
            failed = [(replica, error)]
            break
    if failed:  # from every replica that has it: one may have been admitted meanwhile
        await unload_everywhere(adapters, version, replicas, admin_for)
        reasons = "; ".join(f"replica {r.id}: {e}" for r, e in failed)
        raise AdapterLoadFailed(f"{version.engine_name} did not load ({reasons}); "
                                "unloaded from the others, nothing changed")
    previous = adapters.switch(version)
    if previous is not None:
        log.info("adapter %s now serves %s (was %s, retiring)", version.name,
                 version.version, previous.version)


async def _load(admin: AdapterAdmin, replica: Replica, version: AdapterVersion
                ) -> BaseException | None:
    try:
        await admin.load_lora(version.engine_name, version.path)
    except EngineAdminError as exc:
        return exc
    version.replicas.add(replica.id)
    replica.models = replica.models | {version.engine_name}
    return None


async def unload_everywhere(adapters: Adapters, version: AdapterVersion,
                            replicas: Iterable[Replica], admin_for: AdminFor) -> None:
    """Unload `version` from every replica that has it, then forget it. A replica that
    fails to unload keeps a name nobody can reach (the router refuses it): logged.
    Forgotten first, with no await before `loaded` is read: a `converge` loading it
    into a replica that turned ready meanwhile either is listed here or, ending
    later, finds it forgotten and unloads it itself."""
    adapters.remove(version)
    loaded = [r for r in replicas if r.id in version.replicas]
    for replica in loaded:  # out of routing first: no request may pick it mid-unload
        replica.models = replica.models - {version.engine_name}
    results = await asyncio.gather(
        *(admin_for(r).unload_lora(version.engine_name) for r in loaded),
        return_exceptions=True)
    for replica, result in zip(loaded, results, strict=True):
        if isinstance(result, Exception):
            log.warning("replica %s: could not unload %s: %s", replica.id,
                        version.engine_name, result)
    version.replicas.clear()


async def retire(adapters: Adapters, version: AdapterVersion,
                 replicas: Callable[[], Iterable[Replica]], admin_for: AdminFor) -> None:
    """Once no request is on the retiring `version`, unload it everywhere. Requests
    are bounded (the router's stream idle and first-byte timeouts), so this ends."""
    assert version.retiring
    if adapters.settle is not None:  # other workers may still resolve names to it
        await adapters.settle()
    while version.in_flight:
        await asyncio.sleep(RETIRE_POLL_S)
    await unload_everywhere(adapters, version, replicas(), admin_for)
    log.info("adapter %s: version %s unloaded", version.name, version.version)


async def converge(adapters: Adapters, replica: Replica, admin: AdapterAdmin) -> None:
    """Load every served, non-retiring version `replica` lacks (it was restarted, or
    down during a deploy). EngineAdminError if one cannot load: the replica must not
    turn ready without it."""
    for version in adapters.versions():
        if version.retiring or version.engine_name in replica.models:
            continue
        await admin.load_lora(version.engine_name, version.path)
        if adapters.get(version.engine_name) is not version:  # rolled back meanwhile
            await admin.unload_lora(version.engine_name)
            continue
        version.replicas.add(replica.id)
        replica.models = replica.models | {version.engine_name}
