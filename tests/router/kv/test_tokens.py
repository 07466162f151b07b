"""The async prompt tokenizer: right ids under concurrency, None instead of exceptions,
bounded work, the cache, and the simulator's tokenizer through the same interface.

Exactness against vLLM is `test_hf.py`'s subject; here the real tokenizer of the tiny
model is used wherever it can show the behaviour, and a fake encoder (a job that waits
for the test's signal) only where the case is a worker kept busy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dpserve.prompt_tokens import open_prompt_tokenizer
from dpserve.router.kv.hf import HfPromptEncoder
from dpserve.router.kv.prompt import Budget, ChatSettings, Job
from dpserve.router.kv.tokens import PromptLimits, PromptTokenizer
from dpserve.sim import protocol
from dpserve.sim.config import SimConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WAIT_S = 10.0


@pytest.fixture(scope="module")
def encoder(tiny_model: Path) -> HfPromptEncoder:
    return HfPromptEncoder(tiny_model)


@pytest.fixture
async def tok(encoder: HfPromptEncoder) -> AsyncIterator[PromptTokenizer]:
    async with PromptTokenizer(encoder, PromptLimits(max_chars=20_000, max_items=1000,
                                                     max_pending=100, workers=2)) as t:
        yield t


def direct(encoder: HfPromptEncoder, route: str, body: dict[str, Any]) -> Any:
    job = encoder.prepare(route, body, Budget(1 << 20, 1 << 17))
    return None if job is None else job.run()


def chat(*texts: str, **extra: Any) -> dict[str, Any]:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(texts)],
            **extra}


async def test_concurrent_requests_each_get_their_own_prompts_ids(tok, encoder):
    bodies = [(COMPLETIONS, {"prompt": f"prompt number {i} " * (i + 1)}) for i in range(40)]
    bodies += [(CHAT, chat(f"question {i}", f"answer {i}", "and?")) for i in range(40)]
    results = await asyncio.gather(*(tok.tokens(route, body) for route, body in bodies))
    assert results == [direct(encoder, route, body) for route, body in bodies]
    assert all(r for r in results)


async def test_a_completion_of_token_ids_is_taken_as_it_is(tok):
    assert await tok.tokens(COMPLETIONS, {"prompt": [5, 6, 7]}) == (5, 6, 7)
    assert await tok.tokens(COMPLETIONS, {"prompt": [5, "6"]}) is None


@pytest.mark.parametrize("body", [
    None, [], "prompt", 3,
    {"prompt": 3}, {"prompt": None}, {"prompt": {"text": "x"}}, {"prompt": ["a", "b"]},
    {"prompt": "x" * 20_001},
    {"prompt": [1] * 20_001},
    {"prompt": "lone surrogate \ud800"},
])
async def test_a_completion_body_it_cannot_read_gives_none(tok, body):
    assert await tok.tokens(COMPLETIONS, body) is None


def deep(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_CHAT = [
    {"messages": "hi"}, {"messages": None}, {"messages": [None]}, {"messages": [[]]},
    {"messages": [{"role": "user", "content": 42}]},
    {"messages": [{"role": ["user"], "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": {"x": 1}}]}]},
    {"messages": [{"role": "user", "content": "x" * 20_001}]},
    {"messages": [{"role": "user", "content": "x" * 15_000}] * 2},
    {"messages": [{"role": "user", "content": "x"}] * 1001},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1001}]},
    chat("x", chat_template_kwargs={"custom": deep(10_000)}),
    chat("x", chat_template_kwargs={"custom": list(range(2000))}),
    chat("x", tools=[{"type": "function", "function": {"name": "f",
                                                       "parameters": {"p": deep(100)}}}]),
    chat("x", documents=[{"text": 3}]), chat("x", reasoning_effort=["high"]),
    chat("x", add_generation_prompt="false"), chat("x", tool_choice={"function": []}),
]


@pytest.mark.parametrize("body", HOSTILE_CHAT, ids=range(len(HOSTILE_CHAT)))
async def test_a_hostile_chat_body_gives_none_without_tokenizing(tok, encoder, body):
    assert encoder.prepare(CHAT, body, Budget(20_000, 1000)) is None  # refused on the loop
    assert await tok.tokens(CHAT, body) is None


async def test_a_prompt_just_under_the_limit_is_tokenized(tok):
    assert await tok.tokens(COMPLETIONS, {"prompt": "x" * 20_000})
    assert await tok.tokens(CHAT, chat("y" * 19_000)) is not None


async def test_a_template_error_gives_none(tiny_model):
    async with open_prompt_tokenizer("vllm", tiny_model, chat=ChatSettings(
            chat_template="{{ raise_exception('refused') }}")) as broken:
        assert await broken.tokens(CHAT, chat("hi")) is None
        assert await broken.tokens(COMPLETIONS, {"prompt": "still fine"})


async def test_other_routes_give_none(tok):
    assert await tok.tokens("/v1/embeddings", {"input": "x"}) is None


# --- bounded work, cache, shutdown (a fake encoder keeps the worker busy) ---------------


def ids(prompt: str) -> tuple[int, ...]:
    """What the fake encoder answers: as many ids as the prompt has characters."""
    return tuple(range(len(prompt)))


class GatedEncoder:
    """Fake: each prompt's job waits for `gate`, records its run and answers ids(prompt)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.runs: list[str] = []
        self.threads: set[int] = set()

    def prepare(self, route: str, body: dict[str, Any], budget: Budget) -> Job | None:
        prompt = body["prompt"]

        def run() -> tuple[int, ...]:
            self.threads.add(threading.get_ident())
            assert self.gate.wait(WAIT_S)
            self.runs.append(prompt)
            return ids(prompt)

        return Job(None if body.get("uncached") else prompt, run)


async def until(predicate: Any) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def test_past_max_pending_requests_get_none_at_once_and_the_rest_complete():
    fake = GatedEncoder()
    async with PromptTokenizer(fake, PromptLimits(max_pending=3, workers=1)) as tok:
        waiting = [asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": p}))
                   for p in ("a", "bb", "ccc")]
        await asyncio.sleep(0)
        assert await tok.tokens(COMPLETIONS, {"prompt": "dddd"}) is None
        fake.gate.set()
        assert await asyncio.gather(*waiting) == [ids("a"), ids("bb"), ids("ccc")]
        assert await tok.tokens(COMPLETIONS, {"prompt": "dddd"}) == ids("dddd")


async def test_the_work_runs_off_the_event_loops_thread():
    fake = GatedEncoder()
    fake.gate.set()
    async with PromptTokenizer(fake, PromptLimits(workers=2)) as tok:
        await asyncio.gather(*(tok.tokens(COMPLETIONS, {"prompt": str(i)}) for i in range(8)))
    assert fake.threads and threading.get_ident() not in fake.threads


async def test_a_repeated_prompt_is_answered_from_the_cache_while_the_worker_is_busy():
    fake = GatedEncoder()
    fake.gate.set()
    async with PromptTokenizer(fake, PromptLimits(workers=1)) as tok:
        assert await tok.tokens(COMPLETIONS, {"prompt": "seen"}) == ids("seen")
        fake.gate.clear()
        busy = asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "other"}))
        assert await tok.tokens(COMPLETIONS, {"prompt": "seen"}) == ids("seen")
        fake.gate.set()
        assert await busy == ids("other")
    assert fake.runs == ["seen", "other"]


async def test_identical_prompts_in_flight_share_one_encoding():
    fake = GatedEncoder()
    async with PromptTokenizer(fake, PromptLimits(workers=1)) as tok:
        same = [asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "dup"}))
                for _ in range(5)]
        await asyncio.sleep(0)
        fake.gate.set()
        assert await asyncio.gather(*same) == [ids("dup")] * 5
    assert fake.runs == ["dup"]


async def test_the_cache_forgets_the_least_recently_used_prompts_past_its_tokens():
    fake = GatedEncoder()
    fake.gate.set()
    async with PromptTokenizer(fake, PromptLimits(cache_tokens=4, workers=1)) as tok:
        for p in ("aa", "bb", "aa", "cc", "aa", "bb", "eeeee", "eeeee", "aa"):
            assert await tok.tokens(COMPLETIONS, {"prompt": p}) == ids(p)
    # cc pushed bb out; eeeee, larger than the whole cache, was never kept.
    assert fake.runs == ["aa", "bb", "cc", "bb", "eeeee", "eeeee"]


async def test_a_cancelled_caller_leaves_the_others_their_answer():
    fake = GatedEncoder()
    async with PromptTokenizer(fake, PromptLimits(workers=1)) as tok:
        quitter = asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "shared"}))
        stayer = asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "shared"}))
        await asyncio.sleep(0)
        quitter.cancel()
        fake.gate.set()
        assert await stayer == ids("shared")
        with pytest.raises(asyncio.CancelledError):
            await quitter


async def test_after_close_queued_and_new_requests_get_none():
    fake = GatedEncoder()
    tok = PromptTokenizer(fake, PromptLimits(workers=1))
    running = asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "runs", "uncached": 1}))
    await until(lambda: fake.threads)
    queued = asyncio.create_task(tok.tokens(COMPLETIONS, {"prompt": "queued", "uncached": 1}))
    await asyncio.sleep(0)
    tok.close()
    assert await queued is None
    assert await tok.tokens(COMPLETIONS, {"prompt": "late"}) is None
    fake.gate.set()
    assert await running == ids("runs")


@pytest.mark.parametrize("field", ["max_chars", "max_items", "max_pending", "workers"])
def test_a_limit_below_one_is_refused_by_name(field):
    with pytest.raises(ValueError, match=field):
        PromptLimits(**{field: 0})


def test_a_vllm_tokenizer_needs_the_models_directory():
    with pytest.raises(ValueError, match="model's directory"):
        open_prompt_tokenizer("vllm")


# --- the simulator's engines -----------------------------------------------------------

SIM_BODIES = [
    (COMPLETIONS, {"prompt": "the simulated tokenizer splits words into runs"}),
    (COMPLETIONS, {"prompt": ["one string in a list"]}),
    (COMPLETIONS, {"prompt": [3, 1, 4, 1, 5]}),
    (CHAT, {"messages": [{"role": "system", "content": "be terse"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}),
]


@pytest.mark.parametrize(("route", "body"), SIM_BODIES)
async def test_the_sim_tokenizer_gives_the_ids_a_simulated_engine_computes(route, body):
    kind = "chat" if route == CHAT else "completion"
    engine_sees = protocol.parse(kind, {**body, "max_tokens": 1}, SimConfig()).prompt_ids
    async with open_prompt_tokenizer("sim") as tok:
        assert await tok.tokens(route, body) == tuple(engine_sees)


async def test_the_sim_tokenizer_refuses_what_the_simulator_refuses():
    async with open_prompt_tokenizer("sim", limits=PromptLimits(max_chars=100)) as tok:
        assert await tok.tokens(COMPLETIONS, {"prompt": ["a", "b"]}) is None
        assert await tok.tokens(CHAT, {"messages": []}) is None
        assert await tok.tokens(COMPLETIONS, {"prompt": "x" * 101}) is None
