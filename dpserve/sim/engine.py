"""A vLLM-like engine: continuous batching on a modelled clock, in one asyncio task.

Each engine step, like vLLM v1's scheduler:

1. gives every running sequence its tokens, oldest first, from a budget of
   `max_num_batched_tokens`: one for a decoding sequence, up to the rest of the
   budget for one still prefilling (chunked prefill). A sequence that needs a
   KV block when none is free preempts the newest running sequence, which goes
   back to the head of the queue and later recomputes its prompt and output;
2. if nothing was preempted, admits waiting sequences first come first served,
   while fewer than `max_num_seqs` run, budget is left and their blocks fit (one
   under a LoRA adapter beyond `max_loras` distinct ones in the batch is skipped).
   An admitted prompt starts after its longest cached block prefix (at least
   one token is always computed);
3. takes ``step_base_s + prefill_per_token_s * prefill tokens + decode_per_seq_s
   * decoding sequences + decode_per_context_token_s * their context`` seconds
   (times the jitter factor and the fault slowdown);
4. ends: every sequence whose known tokens are all computed emits one token;
   those that reach `max_tokens` finish and release their blocks. Blocks whose
   tokens (prompt or output) became all computed are named in the prefix cache.

Timing: step k ends at a deadline on a monotonic clock, the previous deadline
plus the step's time (or the first request's arrival when the engine was
idle), and the task sleeps until then. Waking late does not shift later steps,
so errors do not add up; only when the loop falls more than `RESYNC_S` behind
is the clock moved to "now". How far each wake-up missed its deadline is
recorded (see metrics.py); on an idle machine it is typically within 0.5 ms
(see `TIMER_SLACK_S`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from dpserve.sim import kv_events
from dpserve.sim.config import SimConfig, validate
from dpserve.sim.metrics import EngineStats
from dpserve.sim.prefix_cache import ROOT_HASH, BlockPool, block_hashes
from dpserve.sim.tokenizer import output_ids

if TYPE_CHECKING:
    from dpserve.sim.adapters import Adapter

_now = time.monotonic
"""The engine's clock: asyncio's own, and not uvloop's, which counts whole milliseconds."""

TIMER_SLACK_S = 0.0005
"""How much earlier than a deadline the engine asks asyncio to wake it: asyncio's epoll
timeouts round up to whole milliseconds, so wake-ups land within about +-0.5 ms of
the deadline instead of 0 to 1 ms after it. Not applied under uvloop, which rounds
to the nearest millisecond already."""

RESYNC_S = 0.5
"""Lateness after which the engine gives up catching up and restarts its clock now (as if
the GPU had stalled) rather than run the missed steps back to back."""


class SimSequence:
    """One request inside the engine. Read `output_count`, `finished`, `first_token_at`."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, arrival: float,
                 config: SimConfig, lora: Adapter | None = None) -> None:
        self.prompt_ids = prompt_ids
        self.lora = lora
        """The LoRA adapter it runs under (None: the base model): its blocks' hashes
        carry the adapter's extra keys, as vLLM's."""
        self._extra_keys = None if lora is None else lora.hash_keys
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens
        self.arrival = arrival
        self.hashes = (block_hashes(prompt_ids, config.block_size, ROOT_HASH, self._extra_keys)
                       if config.enable_prefix_caching else [])
        """Hashes of the full blocks known so far: the prompt's, then the output's as
        `hash_blocks` adds them."""
        self.output_count = 0
        self.num_computed = 0
        """Tokens whose KV is computed (cached ones included)."""
        self.num_cached = 0
        """Prompt tokens found in the prefix cache at (the last) admission."""
        self.first_token_at: float | None = None
        self.finished = False
        self.held: list[int] = []
        """Hashes of the named blocks this sequence holds, in prompt order."""
        self.unnamed = 0
        """Unnamed blocks this sequence holds."""
        self.named_upto = 0
        """Prompt blocks already offered to the cache (named or found taken)."""
        self._waiter: asyncio.Future[None] | None = None
        self._wanted = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.output_count

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of tokens `start .. end-1`, prompt and output alike."""
        split = min(max(start, self.prompt_len), end)
        return [*self.prompt_ids[start:split],
                *output_ids(self.prompt_ids, split - self.prompt_len, end - split)]

    def hash_blocks(self, n: int, block_size: int) -> None:
        """Extend `hashes` to the first `n` full blocks, into the output (whose tokens
        must be known that far): vLLM caches generated blocks as it does prompt ones."""
        done = len(self.hashes)
        if n > done:
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes += block_hashes(self.token_ids(done * block_size, n * block_size),
                                        block_size, parent, self._extra_keys)

    def _notify(self) -> None:
        if (self._waiter is not None and not self._waiter.done()
                and (self.output_count > self._wanted or self.finished)):
            self._waiter.set_result(None)

    async def wait_beyond(self, seen: int) -> int:
        """Wait until more than `seen` tokens were emitted or the sequence finished;
        return the number emitted. One waiter at a time."""
        if self.output_count <= seen and not self.finished:
            self._wanted = seen
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.output_count


class Engine:
    """The scheduler and its clock. `run()` is the one task; `add`/`abort` are called
    from request handlers on the same loop."""

    def __init__(self, config: SimConfig, *, seed: int | None = None,
                 on_kv_events: Callable[[list[kv_events.Event]], None] | None = None) -> None:
        """`on_kv_events(events)` is called at the end of every step that named or
        evicted blocks, with those changes in order, as vLLM's scheduler publishes."""
        validate(config)
        self.config = config
        self._on_kv_events = on_kv_events
        self._kv_events: list[kv_events.Event] = []
        self.pool = BlockPool(config.num_blocks,
                              on_evict=self._evicted if on_kv_events is not None else None)
        self.waiting: deque[SimSequence] = deque()
        self.running: list[SimSequence] = []
        self.stats = EngineStats()
        self.slowdown = 1.0
        """Factor on every step's time (fault injection: a slow replica)."""
        self._rng = random.Random(config.seed if seed is None else seed)
        self._work = asyncio.Event()
        self._step_in_flight = False
        """Between `_schedule` and `_finish_step`: the batch's tokens are being computed."""
        self._resets: list[tuple[bool, asyncio.Future[bool]]] = []
        """Resets waiting for the step in flight to end: (reset_running_requests, answer)."""

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def add(self, prompt_ids: Sequence[int], max_tokens: int,
            lora: Adapter | None = None) -> SimSequence:
        """Queue a request, under LoRA adapter `lora` if given; the caller must `abort` it
        if it stops listening."""
        seq = SimSequence(prompt_ids, max_tokens, _now(), self.config, lora)
        self.waiting.append(seq)
        self._work.set()
        return seq

    def abort(self, seq: SimSequence) -> None:
        """Drop a sequence wherever it is; a no-op once it finished."""
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finished = True
        self.stats.requests_aborted += 1
        seq._notify()

    async def run(self) -> None:
        """Step forever; cancel the task to stop. A reset still waiting for its step to
        end then fails with RuntimeError."""
        try:
            await self._step_forever()
        finally:
            resets, self._resets = self._resets, []
            for _, answer in resets:
                if not answer.done():
                    answer.set_exception(RuntimeError("the simulated engine stopped"))

    async def _step_forever(self) -> None:
        uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        slack = 0.0 if uvloop else TIMER_SLACK_S
        clock = 0.0
        while True:
            if not self.running:
                if not self.waiting:
                    self._work.clear()
                    await self._work.wait()
                    continue
                # An idle engine starts on a request the moment it arrives; how late the
                # loop woke this task is the simulator's delay, not the model's.
                clock = max(clock, self.waiting[0].arrival)
            batch, step_s = self._schedule()
            deadline = clock + step_s
            delay = deadline - _now() - slack
            if delay > 0:
                await asyncio.sleep(delay)
            late = _now() - deadline
            self.stats.timing_error.observe(abs(late))
            clock = deadline if late < RESYNC_S else _now()
            self._finish_step(batch, clock)
            self.publish_kv_events()
            self._serve_resets()

    def publish_kv_events(self) -> None:
        """Hand the KV events recorded since the last call to `on_kv_events`, if any.
        `run()` calls it after every step; a caller that steps the engine itself (the
        virtual-clock benchmarks) calls it after each `_finish_step`."""
        if self._kv_events and self._on_kv_events is not None:
            events, self._kv_events = self._kv_events, []
            self._on_kv_events(events)

    def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Forget every cached block, as vLLM's `POST /reset_prefix_cache` does after a
        weight reload. False, and nothing changed, while a running sequence holds blocks,
        unless `reset_running_requests`: then every running sequence is preempted first,
        newest first so they run again in their order, and recomputes what it had (its KV
        came from the old weights). `AllBlocksCleared` goes out with the next step's
        events, as vLLM publishes it. Only between steps, where vLLM's engine core serves
        it too: RuntimeError while a step is in flight."""
        if self._step_in_flight:
            raise RuntimeError("reset_prefix_cache while a step is in flight")
        if reset_running_requests:
            while self.running:
                self._preempt(self.running.pop())
        if not self.pool.reset_prefix_cache():
            return False
        if self._on_kv_events is not None:
            self._kv_events.append(kv_events.AllBlocksCleared())
        return True

    async def reset_prefix_cache_between_steps(self, *, reset_running_requests: bool = False
                                               ) -> bool:
        """`reset_prefix_cache` as soon as no step is in flight: at once when the engine
        is between steps, else when the step under way ends (after its events went out).
        That is where vLLM's engine core serves `POST /reset_prefix_cache`; an HTTP handler
        runs while the engine's task sleeps through a step, so it must wait for the end."""
        if not self._step_in_flight:
            return self.reset_prefix_cache(reset_running_requests=reset_running_requests)
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._resets.append((reset_running_requests, answer))
        return await answer

    def _serve_resets(self) -> None:
        resets, self._resets = self._resets, []
        for reset_running_requests, answer in resets:
            if not answer.done():  # its caller may have given up
                answer.set_result(self.reset_prefix_cache(
                    reset_running_requests=reset_running_requests))

    def _schedule(self) -> tuple[list[tuple[SimSequence, int]], float]:
        """Pick this step's work (steps 1 and 2 of the module docstring) and its time."""
        c = self.config
        budget = c.max_num_batched_tokens
        batch: list[tuple[SimSequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._blocks_for(seq, n)
            while not self.pool.allocate(need):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                seq.unnamed += need
                batch.append((seq, n))
                budget -= n
                i += 1
        # As vLLM: a request under an adapter beyond `max_loras` keeps its place, skipped.
        loras = {s.lora.id for s, _ in batch if s.lora is not None}
        j = 0
        while (not preempted and j < len(self.waiting) and budget > 0
               and len(self.running) < c.max_num_seqs):
            seq = self.waiting[j]
            if seq.lora is not None and seq.lora.id not in loras and len(loras) >= c.max_loras:
                j += 1
                continue
            if not self._admit(seq, budget):
                break
            if seq.lora is not None:
                loras.add(seq.lora.id)
            del self.waiting[j]
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            batch.append((seq, n))
            budget -= n
        self._step_in_flight = True
        return batch, self._step_time(batch)

    def _admit(self, seq: SimSequence, budget: int) -> bool:
        """Hold `seq`'s cached prefix and the blocks of its first chunk, if they fit."""
        bs = self.config.block_size
        hits = min(self.pool.match(seq.hashes), (seq.num_tokens - 1) // bs)
        cached = hits * bs
        n = min(seq.num_tokens - cached, budget)
        self.pool.acquire(seq.hashes[:hits])
        need = math.ceil((cached + n) / bs) - hits
        if not self.pool.allocate(need):
            self.pool.release(seq.hashes[:hits], 0)
            return False
        seq.held, seq.unnamed, seq.named_upto = seq.hashes[:hits], need, hits
        seq.num_computed = seq.num_cached = cached
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += cached
        return True

    def _blocks_for(self, seq: SimSequence, n: int) -> int:
        """More blocks `seq` needs to hold KV for `n` more tokens."""
        held = len(seq.held) + seq.unnamed
        return max(0, math.ceil((seq.num_computed + n) / self.config.block_size) - held)

    def _step_time(self, batch: list[tuple[SimSequence, int]]) -> float:
        c = self.config
        prefill = decode = context = 0
        for seq, n in batch:
            if n == 1 and seq.output_count > 0 and seq.num_computed == seq.num_tokens - 1:
                decode += 1
                context += seq.num_tokens
            else:
                prefill += n
        t = (c.step_base_s + c.prefill_per_token_s * prefill + c.decode_per_seq_s * decode
             + c.decode_per_context_token_s * context)
        if c.step_jitter:
            t *= 1.0 + self._rng.uniform(-c.step_jitter, c.step_jitter)
        return t * self.slowdown

    def _finish_step(self, batch: list[tuple[SimSequence, int]], now: float) -> None:
        """Step 4 of the module docstring."""
        self._step_in_flight = False
        self.stats.steps += 1
        bs = self.config.block_size
        done: list[SimSequence] = []
        for seq, n in batch:
            if seq.finished:  # aborted while the step ran
                continue
            seq.num_computed += n
            full = seq.num_computed // bs
            if self.config.enable_prefix_caching:
                seq.hash_blocks(full, bs)
            else:
                full = 0
            named = [j for j in range(seq.named_upto, full) if self.pool.name(seq.hashes[j])]
            seq.held += [seq.hashes[j] for j in named]
            seq.unnamed -= len(named)
            if named and self._on_kv_events is not None:
                self._kv_events += kv_events.stored_runs(named, seq.hashes, seq.token_ids, bs,
                                                         seq.lora)
            seq.named_upto = max(seq.named_upto, full)
            if seq.num_computed < seq.num_tokens:
                continue  # prefill goes on next step
            seq.output_count += 1
            self.stats.generation_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = now
                self.stats.prompt_tokens += seq.prompt_len
                self.stats.ttft.observe(now - seq.arrival)
            if seq.output_count >= seq.max_tokens:
                done.append(seq)
            seq._notify()
        for seq in done:
            self.running.remove(seq)
            self._release(seq)
            seq.finished = True
            self.stats.requests_finished += 1
            self.stats.e2e.observe(now - seq.arrival)
            seq._notify()

    def _evicted(self, h: int) -> None:
        self._kv_events.append(kv_events.removed(h))

    def _preempt(self, seq: SimSequence) -> None:
        """Free `seq`'s blocks and queue it first, to recompute what it had."""
        self._release(seq)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _release(self, seq: SimSequence) -> None:
        self.pool.release(seq.held, seq.unnamed)
        seq.held, seq.unnamed, seq.named_upto = [], 0, 0
