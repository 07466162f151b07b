"""Routing policies on the simulated fleet in virtual time: exact, repeatable, no CPU noise.

    python -m benchmarks.routing.vclock tenants 10 least-outstanding,prefix-affinity,cache_aware \\
        [--seeds 0,1,2,3,4] [--num-prompts 400] [--replicas 8] [--load-factor 2]

The same engines as ``quality.py`` (``dpserve.sim.engine.Engine`` with
``sim_fleet.SIM_CONFIG``), the same workloads and Poisson arrivals, but no
sockets and no wall clock: engine steps are events on a virtual clock, so a run
takes a second of CPU and gives the same answer on a busy machine as on an idle
one. Use it to ask "what if the policy did X" before changing the router, and to
tell a policy's own effect from a busy machine's. It leaves out the network, the
router's own latency and the engine's scrape lag beyond ``--scrape-s``.

Policies:

- dpserve's own, built by ``dpserve.router.routing.policies.make_policy`` and fed real
  ``Replica`` objects whose in-flight counts this loop keeps: ``least-outstanding``,
  ``round-robin``, ``prefix-affinity``, ``session-affinity``, ``engine-load``;
- ``cache_aware``: a *model* of vllm-router's (shortest queue when
  max - min in flight > 64 and max > 1.5 min; else the replica whose routed-text
  history shares the longest prefix with the prompt, if over 30% of it; else the
  replica with the least text routed so far) — an approximation of its radix tree;
- alternatives for dpserve: ``jsq`` (least in flight of all replicas, ties in
  turn), ``jsq-tokens`` (least outstanding prompt + output tokens of all
  replicas), ``home`` / ``homeK`` (a prefix key's first request goes to the ``jsq``
  choice, which becomes its home; later ones go home, unless home holds more
  than K requests above the least loaded replica, then to the ``jsq`` choice,
  home unchanged), ``recent-tokens`` (prefix-affinity's spreading, but charging each
  request its prompt tokens instead of one unit: what the router could do if it
  were told prompt sizes; it is not).

Prints, per policy, the median over seeds of p50/p99 TTFT (ms), output tokens/s
(all output over the time from the first arrival to the last token), the
prefix-cache hit rate, the spread (most requests on one replica / mean) and
preemptions.
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import dpserve.sim.engine as engine_module
from benchmarks.routing import sim_fleet as fleet
from benchmarks.routing import workloads
from dpserve.config import RouterConfig
from dpserve.router.fleet.engine_metrics import EngineLoad
from dpserve.router.fleet.pool import Replica, ReplicaState
from dpserve.router.routing.policies import RequestInfo, make_policy
from dpserve.router.routing.policies.prefix_affinity import PREFIX_LOAD_FACTOR
from dpserve.router.routing.policies.recent_work import RecentWork, under_cap
from dpserve.sim.config import SimConfig, build_sim_config
from dpserve.sim.engine import SimSequence
from dpserve.sim.tokenizer import encode

PREFIX_CHARS = 256


@dataclass
class Load:
    """What the loop knows of one replica beyond its in-flight count."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    routed_chars: int = 0


class InTurn:
    """Least of ``score`` over all replicas; ties go to the next one in turn."""

    def __init__(self, score: Callable[[int], float]) -> None:
        self.score = score
        self.last = -1

    def pick(self, n: int) -> int:
        scores = [self.score(i) for i in range(n)]
        low = min(scores)
        for j in range(n):
            k = (self.last + 1 + j) % n
            if scores[k] == low:
                self.last = k
                return k
        raise AssertionError("unreachable")


class CacheAwareModel:
    """vllm-router's cache_aware, approximately (see the module docstring)."""

    def __init__(self, reps: list[Replica], loads: list[Load], *, threshold: float = 0.3,
                 abs_threshold: int = 64, rel_threshold: float = 1.5, chunk: int = 64) -> None:
        self.reps, self.loads = reps, loads
        self.seen: list[set[int]] = [set() for _ in reps]
        self.threshold, self.abs_threshold, self.rel_threshold = (
            threshold, abs_threshold, rel_threshold)
        self.chunk = chunk

    def pick(self, prompt: str) -> int:
        n = len(self.reps)
        flight = [r.in_flight for r in self.reps]
        prefixes = [hash(prompt[:k]) for k in range(self.chunk, len(prompt) + 1, self.chunk)]
        if (max(flight) - min(flight) > self.abs_threshold
                and max(flight) > min(flight) * self.rel_threshold):
            i = min(range(n), key=flight.__getitem__)
        else:
            matched = [self._matched(k, prefixes) for k in range(n)]
            best = max(range(n), key=matched.__getitem__)
            if matched[best] / max(1, len(prompt)) > self.threshold:
                i = best
            else:
                i = min(range(n), key=lambda k: self.loads[k].routed_chars)
        for h in prefixes:
            if h not in self.seen[i]:
                self.seen[i].add(h)
                self.loads[i].routed_chars += self.chunk
        return i

    def _matched(self, k: int, prefixes: list[int]) -> int:
        m = 0
        for h in prefixes:
            if h not in self.seen[k]:
                break
            m += self.chunk
        return m


class Home:
    """A prefix key's home replica, chosen by ``jsq`` at first sight (see the docstring)."""

    def __init__(self, reps: list[Replica], jsq: InTurn, slack: int | None) -> None:
        self.reps, self.jsq, self.slack = reps, jsq, slack
        self.table: dict[str, int] = {}

    def pick(self, key: str) -> int:
        home = self.table.get(key)
        if home is None:
            home = self.table[key] = self.jsq.pick(len(self.reps))
            return home
        low = min(r.in_flight for r in self.reps)
        if self.slack is None or self.reps[home].in_flight <= low + self.slack:
            return home
        return self.jsq.pick(len(self.reps))


ARRIVAL, STEP_END, TICK = 0, 1, 2
"""Order of events at one virtual instant: requests arrive, then steps end, then ticks
(scrapes, windows) run."""


class VirtualFleet:
    """Engines stepping on one virtual clock: a heap of timed callbacks, each engine
    step one of them. `at` schedules a callback, `send` queues a request on an
    engine, `run` plays the heap out. The engines' clock is `now`."""

    def __init__(self, cfg: SimConfig, replicas: int, *,
                 on_kv_events: Callable[[int, list[Any]], None] | None = None,
                 after_step: Callable[[int], None] | None = None,
                 jitter_seed: int = 0) -> None:
        """`on_kv_events(replica, events)`: each step's KV events, if given.
        `after_step(replica)`: called when a step ends, before finished requests are
        reported and the next step is scheduled (between two steps of that engine).
        `jitter_seed`: another draw of the engines' step-time jitter (engine i is seeded
        1000 x jitter_seed + i), to tell a policy's effect from the luck of the draw."""
        self.now = 0.0
        engine_module._now = lambda: self.now  # the engines' clock becomes the virtual one
        self.engines = [engine_module.Engine(
            cfg, seed=1000 * jitter_seed + i, on_kv_events=None if on_kv_events is None
            else (lambda events, i=i: on_kv_events(i, events))) for i in range(replicas)]
        self.after_step = after_step
        self._heap: list[tuple[float, int, int, int, Callable[[], None]]] = []
        self._count = 0
        self._step: list[Any] = [None] * replicas
        self._live: list[dict[int, tuple[SimSequence, Callable[[SimSequence], None]]]] = [
            {} for _ in range(replicas)]
        """Per replica: request key -> its engine sequence and what to call when it ends."""

    def at(self, t: float, order: int, key: int, fn: Callable[[], None]) -> None:
        """Call `fn` at virtual time `t`; equal times run by `order`, then `key`."""
        self._count += 1
        heapq.heappush(self._heap, (t, order, key, self._count, fn))

    def stepping(self, r: int) -> bool:
        """Whether engine `r` has a step in flight."""
        return self._step[r] is not None

    def send(self, r: int, key: int, ids: Sequence[int], max_tokens: int,
             done: Callable[[SimSequence], None]) -> SimSequence:
        """Queue a request on engine `r` now; `done(seq)` when it finishes."""
        seq = self.engines[r].add(ids, max_tokens)
        self._live[r][key] = (seq, done)
        self._kick(r)
        return seq

    def run(self) -> None:
        while self._heap:
            self.now, _, _, _, fn = heapq.heappop(self._heap)
            fn()

    def _kick(self, r: int) -> None:
        e = self.engines[r]
        if self._step[r] is None and (e.running or e.waiting):
            batch, seconds = e._schedule()
            self._step[r] = batch
            self.at(self.now + seconds, STEP_END, r, lambda: self._step_end(r))

    def _step_end(self, r: int) -> None:
        e = self.engines[r]
        e._finish_step(self._step[r], self.now)
        self._step[r] = None
        if self.after_step is not None:
            self.after_step(r)
        e.publish_kv_events()
        for key, (seq, done) in list(self._live[r].items()):
            if seq.finished:
                del self._live[r][key]
                done(seq)
        self._kick(r)


def simulate(workload: str, rate: float, policy: str, *, seed: int = 0, arrivals_seed: int = 0,
             num_prompts: int = 400, replicas: int = 8, load_factor: float | None = None,
             scrape_s: float = 1.0) -> dict[str, float]:
    cfg = build_sim_config({}, fleet.SIM_CONFIG)
    vf = VirtualFleet(cfg, replicas)
    reps = [Replica(id=f"r{i}", url=f"sim://{i}", state=ReplicaState.READY)
            for i in range(replicas)]
    loads = [Load() for _ in range(replicas)]
    reqs = workloads.build(workload, num_prompts, seed=seed, max_model_len=cfg.max_model_len)
    ids = [encode(r.prompt) for r in reqs]
    gaps = np.random.default_rng(arrivals_seed).exponential(1 / rate, num_prompts)
    arrivals = np.cumsum(gaps) * (num_prompts / rate) / gaps.sum()  # as loadtest rescales
    choose = _chooser(policy, reps, loads, random.Random(seed), load_factor, lambda: vf.now)
    ttft: dict[int, float] = {}

    def arrive(x: int) -> None:
        req, sent = reqs[x], vf.now
        r = choose(req)
        reps[r].in_flight += 1
        loads[r].prompt_tokens += req.prompt_tokens
        loads[r].output_tokens += req.output_tokens

        def done(seq: SimSequence) -> None:
            assert seq.first_token_at is not None
            ttft[x] = seq.first_token_at - sent
            reps[r].in_flight -= 1
            loads[r].prompt_tokens -= req.prompt_tokens
            loads[r].output_tokens -= req.output_tokens

        vf.send(r, x, ids[x], req.output_tokens, done)

    def scrape() -> None:
        for rep, e in zip(reps, vf.engines, strict=True):
            rep.engine = EngineLoad(num_requests_running=e.num_running,
                                    num_requests_waiting=e.num_waiting,
                                    kv_cache_usage_perc=e.kv_cache_usage)
            rep.engine_scraped_at = vf.now
            rep.engine_in_flight_at_scrape = rep.in_flight

    for i, t in enumerate(arrivals):
        vf.at(float(t), ARRIVAL, i, lambda i=i: arrive(i))
    if policy == "engine-load":
        for k in range(1, int(arrivals[-1] / scrape_s) + 2):
            vf.at(k * scrape_s, TICK, -1, scrape)
    vf.run()

    t = np.array([ttft[i] for i in range(num_prompts)]) * 1e3
    stats = [e.stats for e in vf.engines]
    finished = np.array([s.requests_finished for s in stats])
    queries = sum(s.prefix_cache_queries for s in stats)
    return {"ttft_p50_ms": float(np.median(t)), "ttft_p99_ms": float(np.percentile(t, 99)),
            "hit_rate": sum(s.prefix_cache_hits for s in stats) / queries if queries else 0.0,
            "spread": float(finished.max() / finished.mean()),
            "output_tok_s": sum(r.output_tokens for r in reqs) / vf.now,
            "preemptions": float(sum(s.preemptions for s in stats))}


def _chooser(policy: str, reps: list[Replica], loads: list[Load], rng: random.Random,
             load_factor: float | None, clock: Callable[[], float]
             ) -> Callable[[workloads.Request], int]:
    index = {id(r): i for i, r in enumerate(reps)}
    jsq = InTurn(lambda i: reps[i].in_flight)
    if policy == "jsq":
        return lambda req: jsq.pick(len(reps))
    if policy == "jsq-tokens":
        by_tokens = InTurn(lambda i: loads[i].prompt_tokens + loads[i].output_tokens)
        return lambda req: by_tokens.pick(len(reps))
    if policy == "recent-tokens":
        spread = RecentWork(clock=clock)
        return lambda req: _charged(spread, reps, index, req.prompt_tokens,
                                    load_factor or PREFIX_LOAD_FACTOR)
    if policy.startswith("home"):
        home = Home(reps, jsq, int(policy[4:]) if policy[4:] else None)
        return lambda req: home.pick(req.prompt[:PREFIX_CHARS])
    if policy == "cache_aware":
        model = CacheAwareModel(reps, loads)
        return lambda req: model.pick(req.prompt)
    dpserve = make_policy(policy, rng=rng, load_factor=load_factor, clock=clock)

    def pick(req: workloads.Request) -> int:
        info = RequestInfo(route="/v1/completions", model="sim-model",
                           session_id=req.user, prefix=req.prompt[:PREFIX_CHARS])
        chosen = dpserve.select(reps, info)
        assert chosen is not None
        return index[id(chosen)]

    return pick


def _charged(spread: RecentWork, reps: list[Replica], index: dict[int, int], units: float,
             load_factor: float) -> int:
    chosen = spread.least(under_cap(reps, load_factor))
    spread.charge(chosen, units)
    return index[id(chosen)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("workload", choices=workloads.WORKLOADS)
    p.add_argument("rate", type=float, help="requests/s offered to the whole fleet")
    p.add_argument("policies", help="comma-separated, see the module docstring")
    p.add_argument("--seeds", default="0,1,2,3,4", help="arrival-time seeds; medians printed")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--load-factor", type=float, default=RouterConfig().load_factor,
                   help="dpserve affinity policies (default: the router's)")
    p.add_argument("--scrape-s", type=float, default=1.0, help="engine-load's scrape period")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{args.workload} at {args.rate:g} req/s, {args.num_prompts} requests, "
          f"{args.replicas} replicas, virtual clock; medians over arrival seeds {seeds}")
    print(f"{'policy':<20}{'TTFT p50':>9}{'TTFT p99':>9}{'out tok/s':>10}{'hit rate':>9}"
          f"{'spread':>7}{'preempt':>8}   p99 per seed")
    for policy in args.policies.split(","):
        runs = [simulate(args.workload, args.rate, policy, arrivals_seed=s,
                         num_prompts=args.num_prompts, replicas=args.replicas,
                         load_factor=args.load_factor, scrape_s=args.scrape_s) for s in seeds]

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return float(np.median([r[key] for r in runs]))

        print(f"{policy:<20}{med('ttft_p50_ms'):>9.0f}{med('ttft_p99_ms'):>9.0f}"
              f"{med('output_tok_s'):>10.0f}{100 * med('hit_rate'):>8.1f}%"
              f"{med('spread'):>7.2f}{med('preemptions'):>8.0f}"
              f"   {[round(r['ttft_p99_ms']) for r in runs]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
