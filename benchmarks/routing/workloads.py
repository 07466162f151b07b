"""The three workloads of ``quality.py``, written as JSONL prompt files, and the
multi-turn chat of ``kv_study.py`` (`chat`), whose turns wait on the answers before them.

Prompts are spelled with the simulator's tokenizer (``dpserve.sim.tokenizer``):
``decode(ids)`` gives one two-character piece per id, so a prompt built from
``n`` ids is exactly ``n`` tokens to every simulated replica, and two prompts
share exactly the leading blocks whose ids they share. Each line is
``{"prompt", "output_tokens", "prompt_tokens", "user"?}``: loadtest's ``jsonl`` dataset
reads the first two (the file also works with ``python -m loadtest run --dataset jsonl``),
``user`` is the OpenAI field the load step adds to the request body.

Every workload is a pure function of (name, number of prompts, seed, max_model_len),
so every router gets the same requests in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpserve.sim.tokenizer import VOCAB_SIZE, decode, encode, output_ids

WORKLOADS = ("uniform", "heavy-tail", "tenants")

UNIFORM_INPUT, UNIFORM_OUTPUT = 512, 128
HEAVY_INPUT_MEDIAN, HEAVY_INPUT_SIGMA = 256, 1.2
"""Lognormal prompt lengths: median 256, mean ~530, p99 ~4,200 tokens (before the cap)."""
HEAVY_OUTPUT_MEDIAN, HEAVY_OUTPUT_SIGMA = 96, 0.8
"""Lognormal output lengths: median 96, mean ~130, p99 ~510 tokens (after the cap)."""
HEAVY_MAX_OUTPUT = 512
"""Caps the run's drain: the last request can take 512 decode steps (~35 s)."""
TENANTS, TENANT_SYSTEM_TOKENS = 32, 2000
TENANT_QUESTION = (20, 100)
"""Unique question after the system prompt: uniform in [20, 100) tokens."""
TENANT_OUTPUT = (64, 160)
CHAT_SYSTEM = (1000, 2000)
"""Each conversation's own system prompt: uniform in [1000, 2000) tokens."""
CHAT_TURNS = (4, 9)
CHAT_USER = (20, 120)
"""A user message: uniform in [20, 120) tokens."""
CHAT_ANSWER = (64, 256)
CHAT_THINK_S = 8.0
"""Mean of the exponential time between an answer's last token and the next message."""


@dataclass(frozen=True, slots=True)
class Request:
    prompt: str
    prompt_tokens: int
    output_tokens: int
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    ids: list[int]
    """The whole prompt, as token ids: the system prompt, every earlier message and
    answer, then the new message."""
    output_tokens: int
    think_s: float
    """From the previous answer's last token to this message (for the first turn, from
    the conversation's start)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    start_s: float
    turns: list[Turn]

    def context_tokens(self) -> int:
        """Tokens of the last prompt and its answer: what the conversation ends up caching."""
        return len(self.turns[-1].ids) + self.turns[-1].output_tokens


def chat(n: int, *, seed: int, start_window_s: float, think_s: float = CHAT_THINK_S
         ) -> list[Conversation]:
    """`n` conversations starting uniformly at random within `start_window_s`, each with
    its own system prompt and 4 to 8 turns. A turn's prompt is the previous prompt, the
    simulated model's answer to it (`output_ids`: the ids the engine generates, whose
    blocks it caches) and a new message, so a turn that lands where the conversation
    was served finds all of it but the new message cached."""
    rng = np.random.default_rng(seed)
    out = []
    for start in np.sort(rng.uniform(0, start_window_s, n)).tolist():
        ids = rng.integers(0, VOCAB_SIZE, size=int(rng.integers(*CHAT_SYSTEM))).tolist()
        turns: list[Turn] = []
        for k in range(int(rng.integers(*CHAT_TURNS))):
            if turns:
                ids = [*ids, *output_ids(ids, 0, turns[-1].output_tokens)]
            ids = [*ids, *rng.integers(0, VOCAB_SIZE, size=int(rng.integers(*CHAT_USER)))
                   .tolist()]
            turns.append(Turn(ids, int(rng.integers(*CHAT_ANSWER)),
                              0.0 if k == 0 else float(rng.exponential(think_s))))
        out.append(Conversation(start, turns))
    return out


def build(name: str, n: int, *, seed: int, max_model_len: int) -> list[Request]:
    """``n`` requests of workload ``name``, in the order they are sent."""
    rng = np.random.default_rng(seed)
    if name == "uniform":
        return [_random_request(rng, UNIFORM_INPUT, UNIFORM_OUTPUT) for _ in range(n)]
    if name == "heavy-tail":
        return [_heavy_request(rng, max_model_len) for _ in range(n)]
    if name == "tenants":
        return _tenant_requests(rng, n)
    raise ValueError(f"unknown workload {name!r}; expected one of {WORKLOADS}")


def write_jsonl(requests: list[Request], path: Path) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            row: dict[str, object] = {"prompt": r.prompt, "output_tokens": r.output_tokens,
                                      "prompt_tokens": r.prompt_tokens}
            if r.user is not None:
                row["user"] = r.user
            f.write(json.dumps(row) + "\n")
    return path


def describe(requests: list[Request]) -> dict[str, float]:
    """Length statistics of a workload, for the report."""
    inp = np.array([r.prompt_tokens for r in requests])
    out = np.array([r.output_tokens for r in requests])
    return {"requests": len(requests),
            "input_mean": float(inp.mean()), "input_p50": float(np.median(inp)),
            "input_p99": float(np.percentile(inp, 99)), "input_max": int(inp.max()),
            "output_mean": float(out.mean()), "output_p50": float(np.median(out)),
            "output_p99": float(np.percentile(out, 99)), "output_max": int(out.max())}


def one_turn(name: str, n: int, *, seed: int, rate: float, max_model_len: int
             ) -> list[Conversation]:
    """Workload `name` (`build`) as one-turn conversations arriving as a Poisson process
    of `rate` per second: for the virtual clock with KV events (`kv_study.py`)."""
    requests = build(name, n, seed=seed, max_model_len=max_model_len)
    starts = np.cumsum(np.random.default_rng(seed + 1).exponential(1.0 / rate, n)).tolist()
    return [Conversation(float(at), [Turn(encode(r.prompt), r.output_tokens, 0.0)])
            for at, r in zip(starts, requests, strict=True)]


def _text(rng: np.random.Generator, tokens: int) -> str:
    return decode(rng.integers(0, VOCAB_SIZE, size=tokens).tolist())


def _random_request(rng: np.random.Generator, input_len: int, output_len: int) -> Request:
    return Request(_text(rng, input_len), input_len, output_len)


def _heavy_request(rng: np.random.Generator, max_model_len: int) -> Request:
    output_len = int(min(HEAVY_MAX_OUTPUT, max(1, round(
        rng.lognormal(np.log(HEAVY_OUTPUT_MEDIAN), HEAVY_OUTPUT_SIGMA)))))
    input_cap = max_model_len - output_len
    input_len = int(min(input_cap, max(8, round(
        rng.lognormal(np.log(HEAVY_INPUT_MEDIAN), HEAVY_INPUT_SIGMA)))))
    return _random_request(rng, input_len, output_len)


def _tenant_requests(rng: np.random.Generator, n: int) -> list[Request]:
    """Tenant k's requests share its system prompt; arrivals interleave the tenants.

    The order is a seeded shuffle of round-robin turns, so every tenant sends
    about n/32 requests spread over the whole run rather than in bursts.
    """
    systems = [_text(rng, TENANT_SYSTEM_TOKENS) for _ in range(TENANTS)]
    turns = np.resize(np.arange(TENANTS), n)
    rng.shuffle(turns)
    out = []
    for k in turns.tolist():
        q = int(rng.integers(*TENANT_QUESTION))
        prompt = systems[k] + " " + _text(rng, q)
        out.append(Request(prompt, TENANT_SYSTEM_TOKENS + q, int(rng.integers(*TENANT_OUTPUT)),
                           user=f"tenant-{k}"))
    return out
