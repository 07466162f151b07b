"""Replica selection policies.

A policy is pure: `select(candidates, request) -> replica | None` looks only at
its arguments (and its own counter, ring cache, clock or random source), does
no I/O and logs nothing. The proxy passes only replicas that may take the request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from dpserve.config import POLICIES
from dpserve.router.kv.index import KVIndex
from dpserve.router.routing.policies.adapter_affinity import ADAPTER_LOAD_FACTOR, AdapterAffinity
from dpserve.router.routing.policies.base import Journal, Policy, RequestInfo, Shared
from dpserve.router.routing.policies.consistent_hash import DEFAULT_LOAD_FACTOR
from dpserve.router.routing.policies.engine_load import EngineLoadPolicy
from dpserve.router.routing.policies.keys import DEFAULT_PREFIX_CHARS
from dpserve.router.routing.policies.kv_aware import KV_LOAD_FACTOR, KVAware
from dpserve.router.routing.policies.least_outstanding import LeastOutstanding
from dpserve.router.routing.policies.prefix_affinity import PREFIX_LOAD_FACTOR, PrefixAffinity
from dpserve.router.routing.policies.round_robin import RoundRobin
from dpserve.router.routing.policies.session_affinity import SessionAffinity

__all__ = [
    "POLICY_NAMES",
    "AdapterAffinity",
    "EngineLoadPolicy",
    "Journal",
    "KVAware",
    "LeastOutstanding",
    "Policy",
    "PrefixAffinity",
    "RequestInfo",
    "RoundRobin",
    "SessionAffinity",
    "Shared",
    "kv_aware_of",
    "make_policy",
    "shared_memory",
]

POLICY_NAMES = tuple(name for name in POLICIES if name != "auto")
"""Every policy's configuration name (owned by dpserve.config, which validates it), but
`auto`, which names one of them (`dpserve.config.effective_policy`)."""


def shared_memory(policy: Policy) -> Shared | None:
    """The part of `policy` whose memory data-plane workers share, if it has one (its
    inner policy, behind adapter affinity; `kv-aware`'s fallback, whose count of recent
    work it spreads by too)."""
    inner = policy.inner if isinstance(policy, AdapterAffinity) else policy
    if isinstance(inner, KVAware):
        return inner.fallback
    return inner if isinstance(inner, PrefixAffinity) else None


def kv_aware_of(policy: Policy) -> KVAware | None:
    """The `kv-aware` policy in `policy` (itself, or behind adapter affinity), if any."""
    inner = policy.inner if isinstance(policy, AdapterAffinity) else policy
    return inner if isinstance(inner, KVAware) else None


def make_policy(
    name: str,
    *,
    rng: random.Random | None = None,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    load_factor: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    adapter_slots: int | None = None,
    kv_index: KVIndex | None = None,
) -> Policy:
    """Build a policy by its configuration name; options a policy does not use are ignored.
    `load_factor` None: each affinity policy's own default. `adapter_slots` (the
    replicas' `--max-loras`): requests for a LoRA adapter prefer replicas where it is
    active (:class:`AdapterAffinity`), then the named policy chooses among those.
    `kv_index`: what `kv-aware` reads (the replicas' KV events); a fresh one if None."""
    policy = _named_policy(name, rng=rng, prefix_chars=prefix_chars,
                           load_factor=load_factor, clock=clock, kv_index=kv_index)
    if adapter_slots is None:
        return policy
    return AdapterAffinity(policy, max_loras=adapter_slots, clock=clock,
                           load_factor=load_factor or ADAPTER_LOAD_FACTOR)


def _named_policy(name: str, *, rng: random.Random | None, prefix_chars: int,
                  load_factor: float | None, clock: Callable[[], float],
                  kv_index: KVIndex | None = None) -> Policy:
    if name == "least-outstanding":
        return LeastOutstanding(rng=rng)
    if name == "round-robin":
        return RoundRobin()
    if name == "session-affinity":
        return SessionAffinity(load_factor=load_factor or DEFAULT_LOAD_FACTOR, rng=rng)
    if name == "prefix-affinity":
        return PrefixAffinity(prefix_chars=prefix_chars, clock=clock,
                              load_factor=load_factor or PREFIX_LOAD_FACTOR)
    if name == "engine-load":
        return EngineLoadPolicy(clock=clock, rng=rng)
    if name == "kv-aware":
        fallback = PrefixAffinity(prefix_chars=prefix_chars, clock=clock,
                                  load_factor=load_factor or PREFIX_LOAD_FACTOR)
        index = kv_index if kv_index is not None else KVIndex()
        return KVAware(index, fallback=fallback, forecast=index.forecast(), clock=clock,
                       load_factor=load_factor or KV_LOAD_FACTOR)
    raise ValueError(f"unknown policy {name!r}")
