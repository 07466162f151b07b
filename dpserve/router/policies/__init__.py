"""Replica selection policies.

A policy is pure: `select(candidates, request) -> replica | None` looks only at
its arguments (and its own counter or random source), does no I/O and logs
nothing. The proxy passes only replicas that may take the request.
"""

from __future__ import annotations

import random

from dpserve.router.policies.base import Policy, RequestInfo
from dpserve.router.policies.least_outstanding import LeastOutstanding
from dpserve.router.policies.round_robin import RoundRobin

__all__ = ["LeastOutstanding", "Policy", "RequestInfo", "RoundRobin", "make_policy"]


def make_policy(name: str, *, rng: random.Random | None = None) -> Policy:
    """Build a policy by its configuration name."""
    if name == "least-outstanding":
        return LeastOutstanding(rng=rng)
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown policy {name!r}")
