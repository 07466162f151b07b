"""What tokenizing a prompt as vLLM does costs the router, and whether it stalls the
event loop: `dpserve/router/kv/tokens.py` on the tiny model's tokenizer.

    python -m benchmarks.routing.tokenize [--model build/tiny-llama] [--requests 64]

Two tables. **Cost per request** at 128, 2k and 8k prompt tokens, completions and chat
(8 messages): calling the tokenizer as vLLM does (`tokenizer(text)`, after
`apply_chat_template` for chat: the baseline), the encoder inline (what the loop would
pay if it tokenized itself), the part that stays on the loop (checking the body, the
cache key), one request through `PromptTokenizer` (worker thread and back, cache off),
and a cache hit. **The loop's longest stall** while `--requests` 8k-token chat prompts
are tokenized at once: a probe task sleeps 1 ms over and over and records how late it
wakes. Arms: inline on the loop, `PromptTokenizer` with 1 and 2 worker threads, and a
process pool of 1 and 2 running the same encoder; the idle loop first, for the
machine's own noise. Wall time per request says what each arm's throughput is.

Measured on 2 idle cores: an 8k-token prompt costs 4.0 ms (completions) to 4.2 ms
(chat) of a worker's time, 0.65x of vLLM's own call, and 2-26 us of the loop's; with
one worker thread the loop's p99 stall stayed at ~1.1 ms, its longest 2-8 ms, against
274-334 ms when a burst of 64 was tokenized on the loop itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from dpserve.router.kv.hf import HfPromptEncoder
from dpserve.router.kv.prompt import Budget
from dpserve.router.kv.tokens import PromptLimits, PromptTokenizer

CHAT = "/v1/chat/completions"
GIL_SWITCH_S = 0.001
"""The interpreter's switch interval in the arm `1 thread, 1 ms GIL` (Python's default is
5 ms: a thread holding the GIL keeps it that long before the loop may run)."""
COMPLETIONS = "/v1/completions"
SIZES = (128, 2048, 8192)
WORDS = ("the router reads each prompt as its engine will, so that a replica which "
         "already holds the prompt's leading blocks in its cache gets the request; "
         "tokens cost time, and a stalled loop costs every stream it serves. ").split()


def text_of(tokenizer: Any, tokens: int, salt: int) -> str:
    """About `tokens` tokens of English-like text, different for each `salt`."""
    words = [f"#{salt}"]
    while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < tokens:
        words += WORDS[len(words) % len(WORDS):] + WORDS[:len(words) % len(WORDS)]
    ids = tokenizer(" ".join(words), add_special_tokens=False)["input_ids"][:tokens]
    return str(tokenizer.decode(ids))


def body_of(tokenizer: Any, route: str, tokens: int, salt: int) -> dict[str, Any]:
    if route == COMPLETIONS:
        return {"prompt": text_of(tokenizer, tokens, salt)}
    parts = [text_of(tokenizer, max(1, tokens // 8), salt * 8 + i) for i in range(8)]
    return {"messages": [{"role": ("user", "assistant")[i % 2], "content": p}
                         for i, p in enumerate(parts)]}


def per_call_us(fn: Callable[[], object], budget_s: float = 0.3) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        fn()
        calls += 1
    return elapsed / calls * 1e6


async def per_await_us(make: Callable[[int], Awaitable[object]], budget_s: float = 0.3) -> float:
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        await make(calls)
        calls += 1
    return elapsed / calls * 1e6


def vllm_call(tokenizer: Any, route: str, body: dict[str, Any]) -> list[int]:
    """The baseline: what vLLM's renderer calls (`tokenizer(...)`, truncation aside)."""
    if route == COMPLETIONS:
        return list(tokenizer(body["prompt"], add_special_tokens=True)["input_ids"])
    text = tokenizer.apply_chat_template(body["messages"], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def inline(encoder: HfPromptEncoder, route: str, body: dict[str, Any]) -> object:
    job = encoder.prepare(route, body, Budget(1 << 22, 1 << 17))
    assert job is not None
    return job.run()


async def cost_row(route: str, n: int, tokenizer: Any, encoder: HfPromptEncoder,
                   fresh: PromptTokenizer, cached: PromptTokenizer) -> None:
    bodies = [body_of(tokenizer, route, n, salt) for salt in range(16)]
    body = bodies[0]
    assert inline(encoder, route, body) == tuple(vllm_call(tokenizer, route, body))
    baseline = per_call_us(lambda: vllm_call(tokenizer, route, body))
    ours = per_call_us(lambda: inline(encoder, route, body))
    on_loop = per_call_us(lambda: encoder.prepare(route, body, Budget(1 << 22, 1 << 17)))
    off_loop = await per_await_us(lambda i: fresh.tokens(route, bodies[i % len(bodies)]))
    await cached.tokens(route, body)
    hit = await per_await_us(lambda i: cached.tokens(route, body))
    name = "cmpl" if route == COMPLETIONS else "chat"
    print(f"{name:<6} {n:>6} {baseline:>8.0f} {ours:>9.0f} {ours / baseline:>6.2f} "
          f"{on_loop:>10.1f} {off_loop:>11.0f} {hit:>7.1f}")


async def cost_table(tokenizer: Any, encoder: HfPromptEncoder) -> None:
    print(f"{'route':<6} {'tokens':>6} {'vllm us':>8} {'inline us':>9} {'ratio':>6} "
          f"{'on loop us':>10} {'off loop us':>11} {'hit us':>7}")
    async with PromptTokenizer(encoder, PromptLimits(cache_tokens=0, workers=1)) as fresh, \
            PromptTokenizer(encoder, PromptLimits(workers=1)) as cached:
        for route in (COMPLETIONS, CHAT):
            for n in SIZES:
                await cost_row(route, n, tokenizer, encoder, fresh, cached)


async def stalls_while(work: Callable[[], Awaitable[Any]]) -> tuple[float, float, float]:
    """(longest stall ms, p99 stall ms, wall s) of the loop while `work` runs."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    start = time.perf_counter()
    results = await work()
    wall = time.perf_counter() - start
    done.set()
    await task
    del results  # freed after the probe stops: freeing 64 lists of 8k ints takes ms
    lags.sort()
    return lags[-1] * 1e3, lags[int(len(lags) * 0.99)] * 1e3, wall


_worker_encoder: HfPromptEncoder | None = None


def _init_worker(model: str) -> None:
    global _worker_encoder
    _worker_encoder = HfPromptEncoder(model)


def _in_worker(route: str, body: dict[str, Any]) -> object:
    assert _worker_encoder is not None
    return inline(_worker_encoder, route, body)


async def arrive(bodies: list[dict[str, Any]], spread: bool,
                 call: Callable[[dict[str, Any]], Awaitable[object]]) -> list[object]:
    """Call for every body: all in one loop turn (a burst), or one per turn (as requests
    read from their sockets one after another)."""
    tasks = []
    for b in bodies:
        tasks.append(asyncio.ensure_future(call(b)))
        if spread:
            await asyncio.sleep(0)
    out = await asyncio.gather(*tasks)
    assert all(out)
    return out


async def stall_table(model: Path, tokenizer: Any, encoder: HfPromptEncoder,
                      requests: int) -> None:
    bodies = [body_of(tokenizer, CHAT, 8192, 1000 + i) for i in range(requests)]
    print(f"\nthe loop while {requests} chat prompts of 8k tokens are tokenized "
          f"({len(os.sched_getaffinity(0))} cores); longest and p99 stall in ms")
    print(f"{'arm':<20} {'burst max':>9} {'burst p99':>9} {'spread max':>10} "
          f"{'spread p99':>10} {'ms/request':>10}")

    async def row(arm: str, call: Callable[[dict[str, Any]], Awaitable[object]]) -> None:
        burst = await stalls_while(lambda: arrive(bodies, False, call))
        spread = await stalls_while(lambda: arrive(bodies, True, call))
        print(f"{arm:<20} {burst[0]:>9.2f} {burst[1]:>9.2f} {spread[0]:>10.2f} "
              f"{spread[1]:>10.2f} {burst[2] / requests * 1e3:>10.2f}")

    idle = await stalls_while(lambda: asyncio.sleep(0.5, [True]))
    print(f"{'idle loop':<20} {idle[0]:>9.2f} {idle[1]:>9.2f}")

    async def on_loop(b: dict[str, Any]) -> object:
        await asyncio.sleep(0)
        return inline(encoder, CHAT, b)

    await row("inline on the loop", on_loop)
    for workers in (1, 2):
        async with PromptTokenizer(encoder, PromptLimits(
                workers=workers, cache_tokens=0, max_pending=requests)) as tok:
            await row(f"{workers} thread(s)", lambda b, t=tok: t.tokens(CHAT, b))
    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)  # what the router sets under kv-aware
    try:
        async with PromptTokenizer(encoder, PromptLimits(
                workers=1, cache_tokens=0, max_pending=requests)) as tok:
            await row("1 thread, 1 ms GIL", lambda b, t=tok: t.tokens(CHAT, b))
    finally:
        sys.setswitchinterval(interval)
    loop = asyncio.get_running_loop()
    for workers in (1, 2):
        with ProcessPoolExecutor(workers, initializer=_init_worker,
                                 initargs=(str(model),)) as pool:
            await asyncio.gather(*(loop.run_in_executor(pool, _in_worker, CHAT, b)
                                   for b in bodies[:workers * 2]))  # started and warm
            await row(f"{workers} process(es)",
                      lambda b, p=pool: loop.run_in_executor(p, _in_worker, CHAT, b))


async def main_async(args: argparse.Namespace) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    encoder = HfPromptEncoder(args.model)
    await cost_table(tokenizer, encoder)
    for _ in range(args.rounds):
        await stall_table(args.model, tokenizer, encoder, args.requests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("build/tiny-llama"),
                        help="a model directory with tokenizer files (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=64,
                        help="8k-token chat prompts tokenized at once (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times to measure the stall table (default: %(default)s)")
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
