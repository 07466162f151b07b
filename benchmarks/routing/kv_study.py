"""Routing on KV events in virtual time: several routers, cache pressure, a deploy's reset.

    python -m benchmarks.routing.kv_study [--seeds 0,1,2,3,4,5,6,7,8,9] [--conversations 64]
        [--replicas 8] [--pressure 0.75,1.5] [--reset-at 90] [--window-s 10] [--scrape-s 1]

The engines of ``vclock.py`` (its ``VirtualFleet``, ``sim_fleet.SIM_CONFIG``) serve a
multi-turn chat (``workloads.chat``): each conversation has its own system prompt and
sends its next message a think time after the answer to the last, so its prompts grow
turn by turn and a turn served where the conversation was served before finds all but
its new message cached (the answers' blocks too: the simulated engines cache them).

Arms: a policy and a number of routers. Requests go to the routers in turn (clients
behind a Kubernetes Service), and each router has its own memory (prefix affinity's
homes, the spreading counters, the ``cache_aware`` model's tree) and its own in-flight
counts. Every ``kv-aware`` router reads one ``KVIndex``, fed by every engine's events
at the end of each step (encoded as the simulator publishes them and read back by the
router's decoder, as over ZMQ, without the network's delay), and the engines' queues as
its scrape saw them (every ``--scrape-s``, routers out of phase) plus its own in-flight
change since.

Cache sizes: the working set is the sum over conversations of the KV blocks of their
last prompt and answer, the most each must keep cached for every turn to hit. The
conversations start within the first ``--start-window-s`` and overlap, but not all of
them entirely: the report also gives the peak, over the run, of the open conversations'
contexts added up (measured, per arm; it varies little). Each ``--pressure`` P sets every
replica's KV cache to working set / P / replicas blocks: 0.75 fits with room, 1.5
needs evictions.

The deploy: at ``--reset-at`` virtual seconds every engine resets its prefix cache at the
end of its current step, as vLLM does after a weight reload (running requests are
preempted and recompute; ``AllBlocksCleared`` goes out with the next step's events).

Prints per arm the medians over seeds of the fleet's prefix-cache hit rate (engine
counters), TTFT mean/p50/p99 and output tokens/s (all output over the time from the
first message to the last token), then the targets' ratios (per seed, median [min,
max]) and the hit rate and mean TTFT per ``--window-s`` window around the reset.
Leaves out the network, the router's own latency, tokenization cost and a real vLLM.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import msgspec
import numpy as np

from benchmarks.routing import quality, workloads
from benchmarks.routing import sim_fleet as fleet
from benchmarks.routing.kv_report import report
from benchmarks.routing.vclock import (
    ARRIVAL,
    PREFIX_CHARS,
    TICK,
    CacheAwareModel,
    Load,
    VirtualFleet,
)
from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaState
from dpserve.router.kv.events import Event, decode
from dpserve.router.kv.index import KVIndex
from dpserve.router.peers.state import SHARE_BIAS
from dpserve.router.routing.policies import (
    KVAware,
    Policy,
    PrefixAffinity,
    RequestInfo,
    make_policy,
)
from dpserve.router.routing.policies.kv_aware import KV_LOAD_FACTOR, KV_LOAD_WEIGHT
from dpserve.sim.config import SimConfig, build_sim_config
from dpserve.sim.engine import SimSequence
from dpserve.sim.kv_events import KVEventBatch
from dpserve.sim.tokenizer import decode as spell

START_WINDOW_S = 40.0
ONE_TURN_REQUESTS = 400
"""`--workload` other than chat: as many requests as quality.py sends."""


@dataclass(frozen=True)
class Arm:
    policy: str
    routers: int
    peers: bool = False
    """kv-aware routers told of each other (`dpserve.router.peers`), with no delay."""

    @property
    def name(self) -> str:
        name = self.policy if self.routers == 1 else f"{self.policy} x{self.routers}"
        return name + " peers" if self.peers else name


ARMS = tuple(Arm(p, n, peers) for p, n, peers in (
    ("round-robin", 1, False), ("prefix-affinity", 1, False), ("prefix-affinity", 2, False),
    ("cache_aware", 1, False), ("cache_aware", 2, False), ("kv-aware", 1, False),
    ("kv-aware", 2, False), ("kv-aware", 2, True)))


@dataclass(frozen=True)
class KVKnobs:
    """kv-aware's constants, to ask "what if" (defaults: the policy's own)."""

    load_weight: float = KV_LOAD_WEIGHT
    load_factor: float = KV_LOAD_FACTOR
    forecast: bool = True
    """Count the prompts a router sent as held where they went until their blocks are
    reported (`dpserve.router.kv.forecast`), as the policy does."""
    peer_delay_s: float = 0.015
    """`Arm.peers`: how late a router hears another: the link's 10 ms period plus the
    network and the event loop (`dpserve.router.peers.link`)."""


@dataclass(frozen=True, slots=True)
class Placement:
    conversation: int
    turn: int
    router: int
    replica: int
    sent_s: float
    ttft_s: float
    cached_tokens: int
    """Prompt tokens the engine found cached when it (last) admitted the request."""


@dataclass
class Run:
    placements: list[Placement]
    hit_rate: float
    output_tok_s: float
    windows: list[float] = field(default_factory=list)
    """Per window: the fleet's hit rate over the prompt tokens looked up in it."""
    fallbacks: int = 0
    """kv-aware decisions left to the fallback (no events known yet)."""
    preemptions: int = 0
    """Sequences the engines preempted for KV space (or the reset) and recomputed."""
    peak_open_blocks: int = 0
    """Most KV blocks the open conversations' contexts (the latest prompt and its whole
    answer, from the first message to the last answer) added up to at one time."""

    def moved(self) -> int:
        """Turns placed on another replica than the conversation's turn before."""
        last = {(p.conversation, p.turn): p.replica for p in self.placements}
        return sum(1 for p in self.placements
                   if p.turn and last[(p.conversation, p.turn - 1)] != p.replica)

    def ttft_ms(self) -> np.ndarray:
        return np.array([p.ttft_s for p in self.placements]) * 1e3

    def window_ttft_ms(self, window_s: float) -> list[float]:
        """Per window: mean TTFT of the requests sent in it (nan where none were)."""
        by: dict[int, list[float]] = {}
        for p in self.placements:
            by.setdefault(int(p.sent_s // window_s), []).append(p.ttft_s * 1e3)
        return [float(np.mean(by[w])) if w in by else math.nan
                for w in range(len(self.windows))]


class Router:
    """One router process: its own view of the replicas and its own policy."""

    def __init__(self, policy: str, replicas: int, index: KVIndex, clock: Callable[[], float],
                 seed: int, kv: KVKnobs) -> None:
        self.reps = [Replica(id=f"r{i}", url=f"sim://{i}", state=ReplicaState.READY)
                     for i in range(replicas)]
        self._by_id = {r.id: i for i, r in enumerate(self.reps)}
        self._clock = clock
        self._model = (CacheAwareModel(self.reps, [Load() for _ in range(replicas)])
                       if policy == "cache_aware" else None)
        self.policy: Policy | None = None
        self.peers: list[Router] = []
        """The other routers, when they are told of each other (`Arm.peers`)."""
        self.peer_delay_s = kv.peer_delay_s
        self.rank = 0
        self._said: list[tuple[float, list[int], list[float]]] = []
        """What this router told its peers: (when, in flight and recent work per replica)."""
        self._inbox: list[tuple[float, str, tuple[int, ...]]] = []
        """Peers' prompts on their way here: (when they arrive, replica id, chain keys)."""
        if policy == "kv-aware":  # make_policy's, with the knobs of this study
            fallback = make_policy("prefix-affinity", clock=clock)
            assert isinstance(fallback, PrefixAffinity)
            self.policy = KVAware(index, fallback=fallback,
                                  load_weight=kv.load_weight, load_factor=kv.load_factor,
                                  forecast=index.forecast() if kv.forecast else None,
                                  clock=clock)
        elif self._model is None:
            self.policy = make_policy(policy, rng=random.Random(seed), clock=clock)

    def pick(self, ids: list[int]) -> int:
        if self._model is not None:
            return self._model.pick(spell(ids))
        assert self.policy is not None
        info = RequestInfo(route="/v1/completions", model="sim-model",
                           prefix=spell(ids[:PREFIX_CHARS])[:PREFIX_CHARS], tokens=tuple(ids))
        self._hear_peers()
        chosen = self.policy.select(self.reps, info)
        assert chosen is not None
        if self.peers and isinstance(self.policy, KVAware):
            arrives = self._clock() + self.peer_delay_s
            for url, _size, keys in self.policy.take_sent():
                for peer in self.peers:
                    peer._inbox.append((arrives, f"r{url.removeprefix('sim://')}", keys))
        return self._by_id[chosen.id]

    def say(self) -> None:
        """Record what this router would report now (after each change of its counts)."""
        if self.peers and isinstance(self.policy, KVAware):
            fallback = self.policy.fallback
            self._said.append((self._clock(), [r.in_flight for r in self.reps],
                               [fallback.work(r) for r in self.reps]))

    def _heard(self, now: float) -> tuple[float, list[int], list[float]] | None:
        """The last report of this router that reached a peer by `now`."""
        i = bisect.bisect_right(self._said, now - self.peer_delay_s, key=lambda x: x[0])
        return self._said[i - 1] if i else None

    def _hear_peers(self) -> None:
        """What `dpserve.router.peers` tells a router, as of now, `peer_delay_s` late: the
        others' in flight on each replica, their recent work (`work`) and the prompts
        they sent (into its forecast)."""
        if not self.peers:
            return
        now = self._clock()
        heard = [h for p in self.peers if (h := p._heard(now)) is not None]
        for i, rep in enumerate(self.reps):
            rep.peer_in_flight = sum(h[1][i] for h in heard)
        assert isinstance(self.policy, KVAware) and self.policy.forecast is not None
        due = [m for m in self._inbox if m[0] <= now]
        if due:
            self._inbox = [m for m in self._inbox if m[0] > now]
            for at, rid, keys in due:
                self.policy.forecast.add(rid, keys, at)

    def work(self, url: str, now: float) -> float:
        """The peers' recent work on the replica at `url` as last heard, decayed to
        `now` (`PeerWork`)."""
        i = int(url.removeprefix("sim://"))
        assert isinstance(self.policy, KVAware)
        rate = math.log(2) / self.policy.fallback.half_life_s
        total = 0.0
        for peer in self.peers:
            heard = peer._heard(now)
            if heard is not None:
                total += heard[2][i] * math.exp(-rate * (now - heard[0]))
        return total

    def bias(self, url: str) -> float:
        """This router's share of the replicas, as `PeerState.bias` deals them."""
        i = int(url.removeprefix("sim://"))
        return 0.0 if i % (len(self.peers) + 1) == self.rank else SHARE_BIAS

    def tell(self, peers: list[Router], rank: int) -> None:
        """Make this router hear `peers` (the others); it is `rank`-th of them all."""
        self.peers = peers
        self.rank = rank
        assert isinstance(self.policy, KVAware)
        self.policy.fallback.peers = self
        self.policy.take_sent()  # start keeping

    def scrape(self, vf: VirtualFleet) -> None:
        self._hear_peers()
        for rep, e in zip(self.reps, vf.engines, strict=True):
            rep.engine = EngineLoad(num_requests_running=e.num_running,
                                    num_requests_waiting=e.num_waiting,
                                    kv_cache_usage_perc=e.kv_cache_usage)
            rep.engine_scraped_at = vf.now
            rep.engine_in_flight_at_scrape = rep.in_flight
            rep.engine_peer_in_flight_at_scrape = rep.peer_in_flight


class Probe(Protocol):
    """Watches (and for a what-if, rewires) one run: `kv_ties.py`'s diagnostics."""

    def start(self, vf: VirtualFleet, routers: list[Router]) -> None:
        """Once, before the first request."""

    def applied(self, replica: int, events: Sequence[Event]) -> None:
        """The KV index has just applied a batch of `replica`'s events."""

    def before_pick(self, router: Router) -> None:
        """Just before `router` places a request."""

    def picked(self, router: Router, conversation: int, turn: int, replica: int) -> None:
        """`router` placed the turn on `replica` (not yet counted in flight)."""


def working_set_blocks(convs: Sequence[workloads.Conversation], block_size: int) -> int:
    """KV blocks of every conversation's last prompt and answer (see the docstring)."""
    return sum(math.ceil(c.context_tokens() / block_size) for c in convs)


def sim_config(convs: Sequence[workloads.Conversation], replicas: int, pressure: float
               ) -> SimConfig:
    """SIM_CONFIG with each replica's KV cache sized so that working set / fleet cache
    is `pressure`, and `max_model_len` the longest conversation (the engine must hold
    one request of that length; nothing else reads it here)."""
    bs = int(fleet.SIM_CONFIG["block_size"])  # type: ignore[call-overload]
    blocks = math.ceil(working_set_blocks(convs, bs) / pressure / replicas)
    longest = max(c.context_tokens() for c in convs)
    return build_sim_config({}, {**fleet.SIM_CONFIG, "kv_cache_tokens": blocks * bs,
                                 "max_model_len": longest})


def simulate(arm: Arm, convs: Sequence[workloads.Conversation], cfg: SimConfig, *,
             replicas: int, reset_at: float | None, window_s: float = 10.0,
             scrape_s: float = 1.0, seed: int = 0, kv_knobs: KVKnobs = KVKnobs(),
             probe: Probe | None = None, jitter_seed: int = 0) -> Run:
    """One arm on one workload: every conversation played to its end. `probe` watches
    it; `jitter_seed` draws the engines' step times anew (`VirtualFleet`)."""
    index = KVIndex()
    encoder = msgspec.msgpack.Encoder()
    published = [0] * replicas

    def on_events(r: int, events: list[Any]) -> None:
        payload = encoder.encode(KVEventBatch(ts=vf.now, events=events, data_parallel_rank=0))
        batch = decode([b"kv", published[r].to_bytes(8, "big"), payload])
        published[r] += 1
        assert index.apply(f"r{r}", batch.seq, batch.events, skipped=batch.skipped) is None
        if probe is not None:
            probe.applied(r, batch.events)

    def reset(r: int) -> None:
        assert vf.engines[r].reset_prefix_cache(reset_running_requests=True)

    pending = [False] * replicas

    def after_step(r: int) -> None:
        if pending[r]:
            pending[r] = False
            reset(r)

    kv = arm.policy == "kv-aware"
    vf = VirtualFleet(cfg, replicas, on_kv_events=on_events if kv else None,
                      after_step=after_step, jitter_seed=jitter_seed)
    routers = [Router(arm.policy, replicas, index, lambda: vf.now, seed + i, kv_knobs)
               for i in range(arm.routers)]
    if arm.peers:
        for rank, router in enumerate(routers):
            router.tell([r for r in routers if r is not router], rank)
    placements: list[Placement] = []
    remaining = sum(len(c.turns) for c in convs)
    sent_count, last_token = 0, 0.0
    open_blocks: dict[int, int] = {}
    peak = [0]

    def send(c: int, k: int) -> None:
        nonlocal sent_count
        turn = convs[c].turns[k]
        n, sent_count = sent_count, sent_count + 1
        router = routers[n % len(routers)]  # clients behind a Service: routers in turn
        if probe is not None:
            probe.before_pick(router)
        r = router.pick(turn.ids)
        if probe is not None:
            probe.picked(router, c, k, r)
        router.reps[r].in_flight += 1
        router.say()
        sent = vf.now
        open_blocks[c] = math.ceil((len(turn.ids) + turn.output_tokens) / cfg.block_size)
        peak[0] = max(peak[0], sum(open_blocks.values()))

        def done(seq: SimSequence) -> None:
            nonlocal remaining, last_token
            remaining -= 1
            last_token = vf.now
            router.reps[r].in_flight -= 1
            router.say()
            assert seq.first_token_at is not None
            placements.append(Placement(c, k, n % len(routers), r, sent,
                                        seq.first_token_at - sent, seq.num_cached))
            if k + 1 < len(convs[c].turns):
                vf.at(vf.now + convs[c].turns[k + 1].think_s, ARRIVAL, c,
                      partial(send, c, k + 1))
            else:
                del open_blocks[c]

        vf.send(r, n, turn.ids, turn.output_tokens, done)

    windows: list[float] = []
    seen = [0, 0]  # fleet hits and queries at the last window's end

    def tick() -> None:
        hits = sum(e.stats.prefix_cache_hits for e in vf.engines)
        queries = sum(e.stats.prefix_cache_queries for e in vf.engines)
        windows.append((hits - seen[0]) / (queries - seen[1]) if queries > seen[1] else math.nan)
        seen[:] = [hits, queries]
        if remaining:
            vf.at(vf.now + window_s, TICK, -1, tick)

    def scrape(i: int) -> None:
        routers[i].scrape(vf)
        if remaining:
            vf.at(vf.now + scrape_s, TICK, i, partial(scrape, i))

    for c, conv in enumerate(convs):
        vf.at(conv.start_s, ARRIVAL, c, partial(send, c, 0))
    vf.at(window_s, TICK, -1, tick)
    if kv:
        for i in range(len(routers)):
            vf.at(scrape_s * (1 + i / len(routers)), TICK, i, partial(scrape, i))
    if reset_at is not None:
        def deploy() -> None:
            for r in range(replicas):
                if vf.stepping(r):
                    pending[r] = True
                else:
                    reset(r)
        vf.at(reset_at, TICK, -2, deploy)
    if probe is not None:
        probe.start(vf, routers)
    vf.run()

    stats = [e.stats for e in vf.engines]
    queries = sum(s.prefix_cache_queries for s in stats)
    first = min(c.start_s for c in convs)
    out = sum(t.output_tokens for c in convs for t in c.turns)
    policies = {id(r.policy): r.policy for r in routers}.values()  # a what-if may share one
    fallbacks = sum(sum((p.stats.fallbacks or {}).values()) for p in policies
                    if isinstance(p, KVAware))
    return Run(placements=placements,
               hit_rate=sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
               output_tok_s=out / (last_token - first), windows=windows,
               fallbacks=fallbacks, preemptions=sum(s.preemptions for s in stats),
               peak_open_blocks=peak[0])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9",
                   help="workload seeds; medians printed")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--pressure", default="0.75,1.5",
                   help="working set / fleet KV cache, one run of every arm per value")
    p.add_argument("--reset-at", type=float, default=90.0,
                   help="virtual second of the deploy's prefix-cache reset (negative: none)")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--scrape-s", type=float, default=1.0)
    p.add_argument("--think-s", type=float, default=workloads.CHAT_THINK_S)
    p.add_argument("--start-window-s", type=float, default=START_WINDOW_S)
    p.add_argument("--arms", default=",".join(a.name for a in ARMS))
    p.add_argument("--kv-load-weight", type=float, default=KV_LOAD_WEIGHT,
                   help="kv-aware's price of a queued request (default: the policy's)")
    p.add_argument("--kv-load-factor", type=float, default=KV_LOAD_FACTOR,
                   help="kv-aware's bounded-load cap (default: the policy's)")
    p.add_argument("--workload", choices=("chat", *workloads.WORKLOADS), default="chat",
                   help="other than chat: quality.py's (400 requests at its open-loop "
                        "rate; tenants: 32 tenants' system prompts), the fleet's default "
                        "cache; --pressure ignored")
    p.add_argument("--peer-delay-ms", type=float, default=15.0,
                   help="arms with peers: how late a router hears another")
    p.add_argument("--no-forecast", action="store_true",
                   help="kv-aware on the events alone, without forecasting what it sent")
    args = p.parse_args(argv)
    arms = [a for a in ARMS if a.name in args.arms.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    reset_at = args.reset_at if args.reset_at >= 0 else None
    knobs = KVKnobs(load_weight=args.kv_load_weight, load_factor=args.kv_load_factor,
                    forecast=not args.no_forecast, peer_delay_s=args.peer_delay_ms / 1e3)
    print(f"kv-aware: load_weight {knobs.load_weight:g}, load_factor {knobs.load_factor:g}, "
          f"forecast {'on' if knobs.forecast else 'off'}, peers heard "
          f"{knobs.peer_delay_s * 1e3:g} ms late")
    pressures = [float(x) for x in args.pressure.split(",")]
    for pressure in pressures if args.workload == "chat" else [math.nan]:
        if args.workload == "chat":
            convs = {s: workloads.chat(args.conversations, seed=s, think_s=args.think_s,
                                       start_window_s=args.start_window_s) for s in seeds}
            cfgs = {s: sim_config(convs[s], args.replicas, pressure) for s in seeds}
        else:
            rate = quality.RATE_PER_REPLICA[args.workload] * args.replicas
            cfg = build_sim_config({}, fleet.SIM_CONFIG)
            convs = {s: workloads.one_turn(args.workload, ONE_TURN_REQUESTS, seed=s,
                                           rate=rate, max_model_len=cfg.max_model_len)
                     for s in seeds}
            cfgs = dict.fromkeys(seeds, cfg)
        runs = {a.name: [simulate(a, convs[s], cfgs[s], replicas=args.replicas,
                                  reset_at=reset_at, window_s=args.window_s,
                                  scrape_s=args.scrape_s, seed=s, kv_knobs=knobs)
                      for s in seeds]
                for a in arms}
        working_sets = {s: working_set_blocks(convs[s], cfgs[s].block_size) for s in seeds}
        report(pressure, args.replicas, convs, cfgs, working_sets, runs, reset_at=reset_at,
               window_s=args.window_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
