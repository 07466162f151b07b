"""Why two kv-aware routers cost more TTFT than one, though they read one KV index and
the same engines: ``kv_study.py``'s runs watched decision by decision, and what-ifs.

    python -m benchmarks.routing.kv_ties [--seeds 0,...,9] [--jitter-seeds 0]
        [--pressure 0.75,1.5] [--scrape-s 1] [--stored-half-life 0.5,2] [--arms ...]

The study's workload, cache sizes and reset at 90 s, kv-aware only. Arms:

- ``x1``, ``x2``: one router, two (the study's ``kv-aware`` and ``kv-aware x2``);
- ``x2 one memory``: both routers share one policy object, so one spreading memory
  (``RecentWork``), each with its own in-flight counts and scrapes. No deployment can:
  it asks whether tie-breaking on each router's own sends is the cost;
- ``x2 live queue``: each router reads every engine's queue as it is at each decision,
  as no scrape can: does the queue's staleness cost?
- ``x2 one memory, live queue``: both at once;
- ``x1 stored ties H``, ``x2 stored ties H``: ties broken on the KV blocks each replica
  stored lately (decayed, half-life H s), a signal every router reads alike from the
  engines' events; then on the router's own recent sends;
- ``x1 random ties``, ``x2 random ties``: ties broken at random, each router its own
  draw, so that two routers acting on the same stale view do not pick alike (the
  answer to stale load information in "How Useful Is Old Information?").

A run is one workload seed and one ``--jitter-seeds`` draw of the engines' step times.
The draw alone moves a run's mean TTFT as much as a policy change does (printed: x1 on
another draw over x1 on the first, run by run), so several draws tell a policy's effect
from luck. Per arm, medians over runs: hit rate, TTFT mean and p99; the mean TTFT over
its base arm's on the same run (median [min, max]); then, of the decisions where no
replica held any of the prompt (**new**: first turns, and later turns after the reset
or an eviction), the share placed on a replica with another prefill waiting or running
(**onto a prefill**, the engine's truth); of those, the share where the last request
sent there came from the other router (**other**), where the router's queue for that
replica was below the engine's (**queue low**), and where the index held any block of
that prefill (**seen**: what a stored-blocks signal can know of it). **lag**: decisions
where some engine held more of the prompt than the index said (events not yet applied).
Last, where each two-router arm's extra TTFT over its base went: first turns, later
turns with nothing cached, cached turns (ms per run).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.routing import workloads
from benchmarks.routing.kv_report import spread
from benchmarks.routing.kv_study import START_WINDOW_S, Arm, Router, Run, sim_config, simulate
from benchmarks.routing.vclock import VirtualFleet
from dpserve.router.fleet.pool import Replica
from dpserve.router.kv.events import Event, Stored
from dpserve.router.kv.index import KVIndex
from dpserve.router.routing.policies import KVAware, PrefixAffinity
from dpserve.router.routing.policies.engine_load import engine_queue
from dpserve.router.routing.policies.kv_aware import ENGINE_REPORT_MAX_AGE_S
from dpserve.router.routing.policies.recent_work import RecentWork
from dpserve.sim.prefix_cache import block_hashes

CATEGORIES = ("first turn", "later, nothing cached", "cached")


@dataclass(frozen=True)
class WhatIf:
    name: str
    routers: int
    base: str | None = None
    """The arm whose mean TTFT this one's is divided by, run by run."""
    one_memory: bool = False
    live_queue: bool = False
    stored_half_life_s: float | None = None
    random_ties: bool = False


def what_ifs(half_lives: Sequence[float]) -> list[WhatIf]:
    arms = [WhatIf("x1", 1), WhatIf("x2", 2, "x1"),
            WhatIf("x2 one memory", 2, "x1", one_memory=True),
            WhatIf("x2 live queue", 2, "x1", live_queue=True),
            WhatIf("x2 one memory, live queue", 2, "x1", one_memory=True, live_queue=True)]
    for h in half_lives:
        one = WhatIf(f"x1 stored ties {h:g}", 1, "x1", stored_half_life_s=h)
        arms += [one, WhatIf(f"x2 stored ties {h:g}", 2, one.name, stored_half_life_s=h)]
    return [*arms, WhatIf("x1 random ties", 1, "x1", random_ties=True),
            WhatIf("x2 random ties", 2, "x1 random ties", random_ties=True)]


class StoredTies(KVAware):
    """The candidate: of equal-cost replicas, those that stored the fewest KV blocks
    lately (`stored`, fed from the events); of those, the one sent the least lately."""

    def __init__(self, index: KVIndex, *, stored: RecentWork, fallback: PrefixAffinity,
                 load_weight: float, load_factor: float, clock: Callable[[], float]) -> None:
        super().__init__(index, fallback=fallback, load_weight=load_weight,
                         load_factor=load_factor, clock=clock)
        self.stored = stored
        self.now = clock

    def break_tie(self, tied: Sequence[Replica]) -> Replica:
        now = self.now()
        work = {r.id: self.stored.work(r, now) for r in tied}
        low = min(work.values())
        return super().break_tie([r for r in tied if work[r.id] <= low + 1e-9])


class RandomTies(KVAware):
    """Of equal-cost replicas, one at random."""

    def __init__(self, index: KVIndex, *, rng: random.Random, fallback: PrefixAffinity,
                 load_weight: float, load_factor: float, clock: Callable[[], float]) -> None:
        super().__init__(index, fallback=fallback, load_weight=load_weight,
                         load_factor=load_factor, clock=clock)
        self.rng = rng

    def break_tie(self, tied: Sequence[Replica]) -> Replica:
        return self.rng.choice(list(tied))


@dataclass(frozen=True, slots=True)
class Decision:
    category: str
    onto_prefill: bool
    others: bool
    queue_low: bool
    seen: bool
    lag: bool


@dataclass
class Watch:
    """A `kv_study.Probe`: applies one what-if and records every decision."""

    what: WhatIf
    convs: Sequence[workloads.Conversation]
    decisions: dict[tuple[int, int], Decision] = field(default_factory=dict)
    _vf: VirtualFleet | None = None
    _routers: list[Router] = field(default_factory=list)
    _stored: RecentWork | None = None
    _last_sender: dict[int, int] = field(default_factory=dict)

    def start(self, vf: VirtualFleet, routers: list[Router]) -> None:
        self._vf, self._routers = vf, routers
        if self.what.stored_half_life_s is not None:
            stored = self._stored = RecentWork(half_life_s=self.what.stored_half_life_s,
                                               clock=lambda: vf.now)
            for router in routers:
                p = router.policy
                assert isinstance(p, KVAware)
                router.policy = StoredTies(p.index, stored=stored, fallback=p.fallback,
                                           load_weight=p.load_weight,
                                           load_factor=p.load_factor, clock=lambda: vf.now)
        if self.what.random_ties:
            for i, router in enumerate(routers):
                p = router.policy
                assert isinstance(p, KVAware)
                router.policy = RandomTies(p.index, rng=random.Random(i), fallback=p.fallback,
                                           load_weight=p.load_weight,
                                           load_factor=p.load_factor, clock=lambda: vf.now)
        if self.what.one_memory:
            for router in routers[1:]:
                router.policy = routers[0].policy

    def applied(self, replica: int, events: Sequence[Event]) -> None:
        if self._stored is not None:
            blocks = sum(len(e.block_hashes) for e in events if isinstance(e, Stored))
            if blocks:
                self._stored.add(f"r{replica}", blocks)

    def before_pick(self, router: Router) -> None:
        if self.what.live_queue:
            assert self._vf is not None
            router.scrape(self._vf)

    def picked(self, router: Router, conversation: int, turn: int, replica: int) -> None:
        vf = self._vf
        assert vf is not None and isinstance(router.policy, KVAware)
        me = self._routers.index(router)
        ids = self.convs[conversation].turns[turn].ids
        held = router.policy.index.cached_tokens(ids, None)
        engine = vf.engines[replica]
        bs = engine.config.block_size
        hashes = block_hashes(ids, bs)
        lag = any(e.pool.match(hashes) * bs > held.get(f"r{i}", 0)
                  for i, e in enumerate(vf.engines))
        new = max(held.values(), default=0) == 0
        pending = [s for s in (*engine.running, *engine.waiting)
                   if s.num_tokens - s.num_computed > 1]  # decoding ones have 1 left
        truth = engine.num_running + engine.num_waiting
        self.decisions[(conversation, turn)] = Decision(
            category=CATEGORIES[0] if turn == 0 else CATEGORIES[1] if new else CATEGORIES[2],
            onto_prefill=new and bool(pending),
            others=self._last_sender.get(replica, me) != me,
            queue_low=engine_queue(router.reps[replica], vf.now, ENGINE_REPORT_MAX_AGE_S)
            < truth,
            seen=any(s.named_upto * bs > s.num_cached for s in pending),
            lag=lag)
        self._last_sender[replica] = me


@dataclass
class Result:
    run: Run
    decisions: dict[tuple[int, int], Decision]

    def mean(self) -> float:
        return float(self.run.ttft_ms().mean())

    def by_category(self) -> dict[str, float]:
        """Total TTFT (ms) of each category's turns."""
        out = dict.fromkeys(CATEGORIES, 0.0)
        for p in self.run.placements:
            out[self.decisions[(p.conversation, p.turn)].category] += p.ttft_s * 1e3
        return out


def report(arms: Sequence[WhatIf], results: dict[str, list[Result]], draws: int) -> None:
    """The tables of one cache size; each arm's runs are by workload seed, then by draw."""
    print(f"{'arm':<28}{'hit rate':>9}{'mean':>6}{'p99':>6}  {'mean / base, per run':<26}"
          f"{'new':>5}{'onto a prefill':>15}{'other':>7}{'queue low':>10}{'seen':>6}{'lag':>5}")
    for what in arms:
        rs = results[what.name]
        ratio = (spread([r.mean() / b.mean() for r, b in
                         zip(rs, results[what.base], strict=True)], "{:.3f}")
                 + f" ({what.base})" if what.base in results else "")
        new = [d for r in rs for d in r.decisions.values() if d.category != CATEGORIES[2]]
        onto = [d for d in new if d.onto_prefill]

        def share(ds: list[Decision], f: Callable[[Decision], bool]) -> str:
            return f"{100 * sum(map(f, ds)) / len(ds):.0f}%" if ds else "-"

        print(f"{what.name:<28}{100 * np.median([r.run.hit_rate for r in rs]):>8.1f}%"
              f"{np.median([r.mean() for r in rs]):>6.0f}"
              f"{np.median([np.percentile(r.run.ttft_ms(), 99) for r in rs]):>6.0f}  "
              f"{ratio:<36}{len(new) / len(rs):>5.0f}{share(new, lambda d: d.onto_prefill):>15}"
              f"{share(onto, lambda d: d.others):>7}{share(onto, lambda d: d.queue_low):>10}"
              f"{share(onto, lambda d: d.seen):>6}"
              f"{sum(d.lag for r in rs for d in r.decisions.values()):>5}")
    if draws > 1 and "x1" in results:
        x1 = results["x1"]
        noise = [x1[i + j].mean() / x1[i].mean()
                 for i in range(0, len(x1), draws) for j in range(1, draws)]
        print(f"x1 on another draw of step times / on the first, per run: "
              f"{spread(noise, '{:.3f}')}")
    print("extra TTFT over the base arm, ms per run (sums over the run's turns):")
    for what in arms:
        if what.routers < 2 or what.base not in results:
            continue
        rs, bs = results[what.name], results[what.base]
        extra = {c: float(np.mean([r.by_category()[c] - b.by_category()[c]
                                   for r, b in zip(rs, bs, strict=True)])) for c in CATEGORIES}
        print(f"  {what.name:<28}" + ", ".join(f"{c} {v:+,.0f}" for c, v in extra.items())
              + f"; all {sum(extra.values()):+,.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9", help="workload seeds")
    p.add_argument("--jitter-seeds", default="0",
                   help="draws of the engines' step times, each run on every workload seed")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--pressure", default="0.75,1.5")
    p.add_argument("--reset-at", type=float, default=90.0)
    p.add_argument("--scrape-s", type=float, default=1.0)
    p.add_argument("--stored-half-life", default="2",
                   help="half-lives (s) of the stored-blocks what-if, one arm pair each")
    p.add_argument("--arms", default=None, help="comma-separated names (default: all)")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    jitters = [int(s) for s in args.jitter_seeds.split(",")]
    halves = [float(h) for h in args.stored_half_life.split(",") if h]
    arms = what_ifs(halves)
    if args.arms is not None:
        arms = [a for a in arms if a.name in args.arms.split(",")]
    print(f"kv-aware, {args.replicas} replicas, {args.conversations} conversations, scrape "
          f"every {args.scrape_s:g} s; runs: workload seeds {seeds} x jitter seeds {jitters}")
    for pressure in (float(x) for x in args.pressure.split(",")):
        print(f"\n== working set / fleet KV cache = {pressure:g}")
        results: dict[str, list[Result]] = {a.name: [] for a in arms}
        for s in seeds:
            convs = workloads.chat(args.conversations, seed=s, think_s=workloads.CHAT_THINK_S,
                                   start_window_s=START_WINDOW_S)
            cfg = sim_config(convs, args.replicas, pressure)
            for j in jitters:
                for what in arms:
                    watch = Watch(what, convs)
                    run = simulate(Arm("kv-aware", what.routers), convs, cfg,
                                   replicas=args.replicas, reset_at=args.reset_at,
                                   scrape_s=args.scrape_s, seed=s, probe=watch, jitter_seed=j)
                    results[what.name].append(Result(run, watch.decisions))
        report(arms, results, len(jitters))
    return 0


if __name__ == "__main__":
    sys.exit(main())
