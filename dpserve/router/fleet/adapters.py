"""LoRA adapters served beside the base model: names, versions, and what a request means.

A client asks for an adapter by `NAME` (the version deployed last) or pins one with
`NAME@VERSION`. Every version is loaded into the engines under its own engine name,
`NAME@VERSION`, so two versions serve side by side while one replaces the other:

    deploy v2: load NAME@v2 everywhere ─▶ switch NAME to v2 (atomic, no await)
               ─▶ v1 retires: no new request reaches it, running ones finish on it
               ─▶ once none is left, unload NAME@v1 everywhere

A request holds a lease on the version it resolved to from the moment it is
resolved to the moment its response ends, so "none is left" is exact, and every
request is answered wholly by the version it started on.

The engine name never leaks: the request body sent to a replica names
`NAME@VERSION`, and the `model` of its answer is renamed back to what the client
asked for (`rename_model`). Pure state and byte functions, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.errors import RouterError
from dpserve.router.jsonbody import TOO_DEEP, encode

VERSION_SEP = "@"


@dataclass(eq=False)
class AdapterVersion:
    """One deployed version of an adapter and the requests it is answering."""

    name: str
    version: str
    path: str
    """The (snapshot) directory the engines loaded."""
    rank: int
    in_flight: int = 0
    serving: bool = False
    """Its name has meant it (`switch`): only then may a request pin it."""
    retiring: bool = False
    """Replaced by a newer version: takes no new request, unloaded once idle."""
    replicas: set[str] = field(default_factory=set)
    """Replicas it is loaded on."""

    @property
    def engine_name(self) -> str:
        return f"{self.name}{VERSION_SEP}{self.version}"


class Adapters:
    """The adapters a router serves: which version each name means now, and leases."""

    def __init__(self) -> None:
        self._current: dict[str, AdapterVersion] = {}
        self._versions: dict[str, AdapterVersion] = {}
        """Every version loaded somewhere, retiring ones included, by engine name."""
        self._names: set[str] = set()
        """Every adapter name this table has served, withdrawn ones included: a pinned
        `NAME@VERSION` of one of them is judged here, never by the engines (which may
        still hold a withdrawn version until its unload ends, or after a failed one)."""
        self.settle: Callable[[], Awaitable[None]] | None = None
        """With data-plane workers: returns once every worker has applied this table as
        it is now and reported its leases (`dpserve.router.workers`)."""

    def __len__(self) -> int:
        return len(self._versions)

    def names(self) -> frozenset[str]:
        return frozenset(self._current)

    @property
    def in_use(self) -> bool:
        """An adapter was served at some point: requests' model names are resolved here
        first (`resolve`)."""
        return bool(self._names)

    def current(self, name: str) -> AdapterVersion | None:
        return self._current.get(name)

    def versions(self) -> list[AdapterVersion]:
        return list(self._versions.values())

    def get(self, engine_name: str) -> AdapterVersion | None:
        return self._versions.get(engine_name)

    def resolve(self, model: str | None) -> AdapterVersion | None:
        """The version a request's `model` means, None for anything not an adapter
        (the base model, or a name the replicas' own check decides on). RouterError 404
        for a pinned `NAME@VERSION` of an adapter this table has served that is not
        serving now: replaced, withdrawn, still loading, or never deployed, whatever
        NAME means now (an engine may still hold a withdrawn version, on base weights
        it was not trained on)."""
        if model is None or not self._names:
            return None
        current = self._current.get(model)
        if current is not None:
            return current
        name, sep, _ = model.partition(VERSION_SEP)
        if not sep or name not in self._names:
            return None
        pinned = self._versions.get(model)
        if pinned is None or pinned.retiring or not pinned.serving:
            now = self._current.get(name)
            serves = (f"serves version {now.version}" if now is not None
                      else "is not served")
            raise RouterError(404, f"The model `{model}` does not exist: adapter `{name}` "
                                   f"{serves}"
                                   f"{' (the one named was replaced)' if pinned else ''}.",
                              param="model")
        return pinned

    @contextmanager
    def lease(self, version: AdapterVersion) -> Iterator[None]:
        """Held while a request is on `version` (from resolution to its response's end)."""
        version.in_flight += 1
        try:
            yield
        finally:
            version.in_flight -= 1

    def add(self, version: AdapterVersion) -> None:
        """A version being loaded: no request reaches it (not even pinned) before
        `switch` makes its name mean it."""
        if version.engine_name in self._versions:
            raise ValueError(f"{version.engine_name} is already served")
        self._versions[version.engine_name] = version
        self._names.add(version.name)

    def switch(self, version: AdapterVersion) -> AdapterVersion | None:
        """Make `version` what its name means; the version it replaces (now retiring)."""
        assert self._versions.get(version.engine_name) is version
        previous = self._current.get(version.name)
        self._current[version.name] = version
        version.serving = True
        if previous is not None and previous is not version:
            previous.retiring = True
            return previous
        return None

    def withdraw(self, name: str) -> AdapterVersion | None:
        """Stop serving `name`: new requests for it (pinned too) are 404s; its version,
        now retiring, is returned for unloading once its requests end."""
        version = self._current.pop(name, None)
        if version is not None:
            version.retiring = True
        return version

    def served_names(self) -> frozenset[str]:
        """Every adapter name this table has served (`in_use`), withdrawn ones too."""
        return frozenset(self._names)

    def mirror(self, versions: list[AdapterVersion], current: dict[str, str],
               names: frozenset[str] = frozenset()) -> None:
        """Make this table a copy of another's (a data-plane worker's copy of the
        leader's): `current` maps names to engine names, `names` are every name it has
        served. A version already here is updated in place, so the leases requests hold
        on it stay counted."""
        kept: dict[str, AdapterVersion] = {}
        for version in versions:
            mine = self._versions.get(version.engine_name)
            if mine is None:
                mine = version
            else:
                mine.path, mine.rank = version.path, version.rank
                mine.serving, mine.retiring = version.serving, version.retiring
                mine.replicas = version.replicas
            kept[version.engine_name] = mine
        self._versions = kept
        self._current = {name: kept[engine] for name, engine in current.items()
                         if engine in kept}
        self._names |= names | {v.name for v in kept.values()}

    def remove(self, version: AdapterVersion) -> None:
        """Forget a version unloaded everywhere (or whose load was rolled back)."""
        self._versions.pop(version.engine_name, None)
        if self._current.get(version.name) is version:
            del self._current[version.name]


def list_models(payload: bytes, adapters: Adapters) -> bytes:
    """A replica's `/v1/models` answer with its adapter entries replaced by the router's:
    every adapter name (meaning its current version) and every version by its pinned
    name, each with its version and parent; retiring and loading versions left out, and
    adapters the router did not deploy (loaded by hand) too. The list is then the same
    whichever replica answered. An answer that is not the
    expected JSON is returned as it is."""
    try:
        body = json.loads(payload)
        data = body["data"]
        # vLLM's base model cards have no parent; its adapter cards name the base.
        base = [m for m in data if m.get("parent") is None]
    except (ValueError, KeyError, TypeError, AttributeError):
        return payload
    if not adapters and len(base) == len(data):
        return payload  # no adapter anywhere: the replica's answer as it is
    parent = base[0].get("id") if base else None
    created = base[0].get("created") if base else None
    entries = []
    for name in sorted(adapters.names()):
        current = adapters.current(name)
        assert current is not None
        entries.append(_card(name, current, parent, created))
    for version in sorted(adapters.versions(), key=lambda v: v.engine_name):
        if version.serving and not version.retiring:
            entries.append(_card(version.engine_name, version, parent, created))
    body["data"] = base + entries
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _card(model_id: str, version: AdapterVersion, parent: object, created: object
          ) -> dict[str, object]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "dpserve",
            "root": version.engine_name, "parent": parent,
            "dpserve": {"adapter": version.name, "version": version.version,
                        "rank": version.rank}}


def rewrite_model(payload: dict[str, Any], engine_name: str) -> bytes:
    """The request body (`payload`, as parsed from the client's) with `model` set to
    `engine_name`, every other field's value kept. Written from what was parsed, not
    parsed again: parsing again deeper in the stack failed on a body nested just under
    the first parse's limit. Written as ASCII JSON: a string may hold a lone surrogate
    (`"\\ud800"` is valid JSON) that UTF-8 cannot encode, and escaped it reaches the
    engine exactly as the client sent it. RouterError 400 if writing it back nests
    deeper than Python can."""
    encoded = encode(payload | {"model": engine_name})
    if encoded is None:
        raise RouterError(400, TOO_DEEP)
    return encoded


def rename_model(data: bytes, version: AdapterVersion, client_name: str) -> bytes:
    """Rename `"model":"ENGINE_NAME"` to the client's name in a response or SSE chunk,
    and give its `system_fingerprint` (where it has one) the adapter's version.

    vLLM writes compact JSON, and an adapter name is plain (letters, digits, `._-@`),
    so the field is exactly these bytes; the same bytes inside generated text would be
    escaped (`\\"model\\"`), so nothing else matches. Likewise for the fingerprint, a
    string without quotes or backslashes, or null (`with_fingerprint`)."""
    renamed = data.replace(b'"model":"%s"' % version.engine_name.encode(),
                           b'"model":"%s"' % client_name.encode())
    return with_fingerprint(renamed, version.version)


def with_fingerprint(data: bytes, version: str) -> bytes:
    """Give the `system_fingerprint` of a response or SSE chunk (a string or null, where
    it has one) the version of the weights that answer: base weights or an adapter."""
    if b'"system_fingerprint"' not in data:
        return data
    field = b'"system_fingerprint":' + json.dumps(version).encode()
    return _FINGERPRINT.sub(lambda _: field, data)


_FINGERPRINT = re.compile(rb'"system_fingerprint"[ ]?:[ ]?(?:"[^"\\]*"|null)')
"""The field as vLLM writes it (compact JSON) or as `json.dumps` does (a space after the
colon). Inside generated text the quotes are escaped (`\\"`), so it cannot match there."""


def versioned(data: bytes, adapter: AdapterVersion | None, client_model: str,
              version: str | None) -> bytes:
    """An answer (or SSE chunk) as the client gets it: on an adapter, renamed to the
    model the client asked for; its `system_fingerprint` names the weights' version."""
    if adapter is not None:
        return rename_model(data, adapter, client_model)
    return with_fingerprint(data, version) if version is not None else data
