"""`dpserve deploy ADAPTER --name NAME`: the checks before any replica changes, and the run.

Refused before anything changes (the OpenAI envelope, with the status below):

- 409: the replicas do not take adapters (start them with `--enable-lora`); the name
  is the served base model's; the adapter was trained on other weights than those
  served, has a rank above `--max-lora-rank` or targets a module the base lacks;
  this exact version already serves under the name;
- 400: a name that is not plain (`config.lora_name_problem`);
- 422: not a sound adapter checkpoint (manifest, sha256, adapter files), or a full
  checkpoint (deploy that without `--name`).

Then `adapter_rollout.load_everywhere` loads it into every serving replica and
switches the name; the version it replaces retires in the background.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from dpserve.checkpoint import CheckpointMeta, base_fingerprint, fingerprint_of
from dpserve.config import lora_name_problem
from dpserve.httpclient import shared_or_new
from dpserve.rollout.adapter_rollout import (
    AdapterLoadFailed,
    converge,
    load_everywhere,
    retire,
)
from dpserve.rollout.engine_admin import EngineAdmin, EngineAdminError
from dpserve.rollout.progress import DeployProgress, DeployState, Phase
from dpserve.rollout.validate import Refused
from dpserve.rollout.validate_adapter import validate_adapter
from dpserve.router.fleet.adapters import Adapters, AdapterVersion
from dpserve.router.fleet.pool import Replica, ReplicaPool

log = logging.getLogger("dpserve.rollout")


class AdapterDeploys:
    """Adapter deploys against one pool: checks, the load-and-switch, retirements."""

    def __init__(self, pool: ReplicaPool, adapters: Adapters, *, enabled: bool,
                 max_lora_rank: int, client: httpx.AsyncClient | None = None) -> None:
        """`client`: shared, closed by its owner (None: one per operation)."""
        self._pool = pool
        self.adapters = adapters
        self._enabled = enabled
        self._max_rank = max_lora_rank
        self._client = client
        self._fingerprints: dict[str, str] = {}
        """Base fingerprint per served weights directory (hashing reads every byte)."""
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def enabled(self) -> bool:
        """Whether the engines run with LoRA enabled (`--enable-lora`)."""
        return self._enabled

    def check_request(self, name: str, served_names: frozenset[str]) -> None:
        """What can be refused before reading the checkpoint. Refused otherwise.
        `served_names`: every model name the replicas report (whatever their state now;
        `ReplicaPool.reported_models`); empty means none reported yet, and the name
        cannot be checked against the base model's."""
        if not self._enabled:
            raise Refused(409, "the replicas do not take LoRA adapters: start them with "
                               "`dpserve serve --enable-lora` (for `dpserve router`: vLLM's "
                               "--enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, "
                               "and --enable-lora here)", param="name")
        problem = lora_name_problem(name)
        if problem is not None:
            raise Refused(400, problem, param="name")
        if not served_names:
            raise Refused(409, "no replica has reported the models it serves yet, so "
                               f"{name!r} cannot be checked against the base model's name; "
                               "deploy once a replica has started (GET /admin/replicas)",
                          param="name")
        if name in served_names:
            raise Refused(409, f"{name!r} is the served base model's name; give the adapter "
                               "another", param="name")

    def know_weights(self, weights_dir: str, meta: CheckpointMeta) -> None:
        """A full checkpoint's snapshot, its files checked against `meta` on the copy:
        its base fingerprint, from those hashes, so that an adapter deployed once it
        serves is not held up (nor the engines slowed) by hashing it again."""
        self._fingerprints[weights_dir] = fingerprint_of(meta.files)

    def validate(self, name: str, snapshot: Path, meta: CheckpointMeta, *,
                 served_weights: Path) -> AdapterVersion:
        """Check the snapshot of an adapter checkpoint against the weights served now
        (blocking: hashes the served weights once per weights directory)."""
        key = str(served_weights)
        fingerprint = self._fingerprints.get(key)
        if fingerprint is None:
            fingerprint = self._fingerprints[key] = base_fingerprint(key)
        info = validate_adapter(snapshot, meta, served_base=served_weights,
                                served_fingerprint=fingerprint, max_lora_rank=self._max_rank)
        version = AdapterVersion(name=name, version=info.version, path=info.path,
                                 rank=info.rank)
        loaded = self.adapters.get(version.engine_name)
        if loaded is not None:
            raise Refused(409, f"{name} already serves version {info.version}"
                          if not loaded.retiring else
                          f"version {info.version} of {name} was replaced and is still "
                          "finishing its requests; deploy it again once it is unloaded")
        return version

    def in_use(self) -> list[str]:
        """Snapshot directories of every loaded version (not to be pruned)."""
        return [v.path for v in self.adapters.versions()]

    async def run(self, progress: DeployProgress, version: AdapterVersion) -> DeployState:
        """Load everywhere and switch; the deploy's final state (its error noted)."""
        replicas = list(self._pool)
        previous = self.adapters.current(version.name)
        progress.event(f"loading {version.engine_name} into {len(replicas)} replica(s)")
        async with shared_or_new(self._client) as client:
            try:
                await load_everywhere(self.adapters, version, replicas,
                                      lambda r: EngineAdmin(client, r.url))
            except AdapterLoadFailed as exc:
                for r in progress.replicas:
                    r.phase = Phase.ROLLED_BACK
                progress.error = str(exc)
                return DeployState.ROLLED_BACK
        for r in progress.replicas:
            loaded = r.id in version.replicas
            r.phase = Phase.DONE if loaded else Phase.SKIPPED
            r.version = version.version if loaded else r.from_version
            r.note = None if loaded else "not serving: loads it before it serves again"
        progress.event(f"{version.name} now means {version.version}"
                       + (f" (was {previous.version}, retiring)" if previous else ""))
        if previous is not None:
            self._start_retiring(previous)
        return DeployState.SUCCEEDED

    def withdraw_all(self) -> list[AdapterVersion]:
        """Stop serving every adapter (new requests for them are 404s); each is unloaded
        once its last request ends. What was withdrawn."""
        withdrawn = [v for v in map(self.adapters.withdraw, sorted(self.adapters.names()))
                     if v is not None]
        for version in withdrawn:
            self._start_retiring(version)
        return withdrawn

    def _start_retiring(self, version: AdapterVersion) -> None:
        task = asyncio.create_task(self._retire(version),
                                   name=f"dpserve-retire-{version.engine_name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, version: AdapterVersion) -> None:
        async with shared_or_new(self._client) as client:
            await retire(self.adapters, version, lambda: list(self._pool),
                         lambda r: EngineAdmin(client, r.url))

    async def admit(self, replica: Replica) -> str | None:
        """Load the served versions `replica` lacks before it turns ready (it restarted,
        or was down at a deploy); why it cannot be admitted yet, or None."""
        if not self.adapters:
            return None
        async with shared_or_new(self._client) as client:
            try:
                await converge(self.adapters, replica, EngineAdmin(client, replica.url))
            except EngineAdminError as exc:
                return f"could not load the served adapters: {exc}"
        return None

    async def aclose(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
