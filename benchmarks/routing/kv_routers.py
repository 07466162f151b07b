"""The routers the KV-event benchmarks start, built one way for both: `quality_kv.py`
(simulated replicas) and `real_kv.py` (real vLLM CPU engines).

An arm (`quality_kv_report.Arm`) is a dpserve router (`--policy`, kv-aware with a
tokenizer, with or without peers) or a vllm-router (`cache_aware`, or `kv_aware` fed
the engines' event endpoints from `GET /kv_event_sources`). `router_command` gives its
command line, the environment it adds and where its metrics are; `wait_following`
holds a kv-aware router back until it follows every replica's events (else its
first requests are placed by the fallback, which the run would count against it).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common.services import HOST, Service, http_call
from benchmarks.common.tools import vllm_router_argv, vllm_router_kv_args
from benchmarks.routing.quality_kv_report import Arm

FOLLOW_TIMEOUT_S = 30.0
PEER_KEY = "quality-kv-peer-key-0123456789abcdef"
"""The key two benchmark routers share as peers: a throwaway, on loopback only."""


@dataclass(frozen=True)
class RouterCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables to add to the benchmark's environment."""
    metrics_url: str = ""


def router_command(arm: Arm, urls: Sequence[str], port: int, metrics_port: int, *,
                   tokenizer: str, peer_ports: Sequence[int] = (), me: int = 0,
                   vllm_router: str | None = None, block_size: int = 0,
                   model: str = "") -> RouterCommand:
    """How to start `arm` on `port` in front of `urls`. dpserve: kv-aware reads prompts
    with `tokenizer`; with `peer_ports`, router `me` of them binds its own and peers
    with the others. vllm-router: its metrics on `metrics_port`; `kv_aware` is told
    each engine's event endpoints, its `block_size` and `model`."""
    url = f"http://{HOST}:{port}"
    if arm.kind == "dpserve":
        argv = [sys.executable, "-m", "dpserve", "router", "--host", HOST, "--port",
                str(port), "--policy", arm.policy, "--log-level", "warning",
                *(a for u in urls for a in ("--replica", u))]
        if arm.policy == "kv-aware":
            argv += ["--tokenizer", tokenizer]
        if arm.workers > 1:
            argv += ["--workers", str(arm.workers)]
        env = {}
        if peer_ports:
            argv += ["--peer-bind", f"{HOST}:{peer_ports[me]}",
                     *(a for i, p in enumerate(peer_ports) if i != me
                       for a in ("--peer", f"{HOST}:{p}"))]
            env["DPSERVE_PEER_KEY"] = PEER_KEY
        return RouterCommand(argv, env, f"{url}/metrics")
    if vllm_router is None:
        raise RuntimeError("vllm-router is not installed")
    argv = vllm_router_argv(vllm_router, list(urls), port, metrics_port, arm.policy)
    if arm.policy == "kv_aware":
        argv += vllm_router_kv_args(list(urls), [event_sources(u) for u in urls],
                                    block_size=block_size, model=model)
    return RouterCommand(argv, {}, f"http://{HOST}:{metrics_port}/metrics")


def event_sources(url: str) -> dict[str, Any]:
    """A replica's KV event endpoints and topic (`GET /kv_event_sources`)."""
    status, body = http_call(f"{url}/kv_event_sources")
    if status != 200:
        raise RuntimeError(f"{url}/kv_event_sources answered HTTP {status}")
    return dict(json.loads(body))


def wait_following(service: Service, metrics_url: str, replicas: int) -> None:
    """Until a kv-aware dpserve router follows every replica's events."""
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    following = 0.0
    while time.monotonic() < deadline:
        service.check_alive("start-up")
        text = http_call(metrics_url, timeout=2.0)[1].decode(errors="replace")
        following = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("dpserve_kv_events_following"))
        if following >= replicas:
            return
        time.sleep(0.2)
    raise RuntimeError(f"{service.name} followed {following:.0f} of {replicas} replicas' "
                       f"events after {FOLLOW_TIMEOUT_S:.0f} s:\n{service.log_tail(10)}")
