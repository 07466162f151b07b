"""A deploy's quality gate: an eval set scored on one replica, through the engine's own
tokenizer and sampler (`dpserve deploy CKPT --eval FILE.jsonl`).

The eval file is fine-tuning data (`dpserve.records`: prompt/completion or
messages; a fine-tune's `--eval-data` works as is). Per example, the expected answer is
the completion, or the last assistant message with the conversation before it as the
prompt (rendered by the engine's chat template, `POST /tokenize` with `messages`):

- **exact_match**: the greedy answer (`temperature` 0, at most the expected answer's
  length + `SLACK_TOKENS` tokens), stripped, equals the expected one, stripped;
- **mean_logprob**: the mean log-probability per token of the expected answer after
  the prompt (`prompt_logprobs`), so that free text, where exact match says little,
  is still scored. Not on engines with LoRA enabled: vLLM 0.32 fails the engine when
  a request asking for prompt log-probabilities is batched with another (measured on
  the CPU build: three at once, or one beside generating requests; vLLM issue #16668),
  and the replica kept on the current version serves traffic while it is scored.
  There the gate scores exact_match alone and refuses `gate_metric: mean_logprob`.

Each version is scored `repeats` times; against the current version the gate compares
per example and fails only when the candidate is surely worse than the margin and the
runs' own spread allow (`gate_verdict`).

The eval file is named by an admin request and read by the router: it must resolve inside
the checkpoint root and is read as a checkpoint's files are (`_read_eval_file`): no
symbolic link, no FIFO or device, at most `MAX_EVAL_BYTES`.

The score of a set is the mean over its examples. A gate passes when the candidate's
score in the gate's metric is at least `min_score`, and (`vs_current`) at least the
current version's minus `margin`. Every call goes to one engine directly (control
plane), a few at a time.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dpserve.checkpoint import CheckpointError
from dpserve.records import DataError, open_error, parse_records, read_regular
from dpserve.rollout.engine_admin import EngineAdminError
from dpserve.rollout.gate_verdict import Comparison, compare
from dpserve.rollout.progress import GATE_METRICS as METRICS
from dpserve.rollout.progress import DeployOptions
from dpserve.rollout.snapshot import open_dir_under
from dpserve.rollout.validate import Refused

__all__ = ["METRICS", "EvalCase", "Gate", "Score", "gate_for", "load_eval", "score"]

MAX_EXAMPLES = 2_000
"""An eval set runs on a replica out of rotation: bounded work."""
MAX_EVAL_BYTES = 64 * 1024 * 1024
"""Largest eval file read. MAX_EXAMPLES examples of 32 KiB each (a long conversation
apiece) fit with room to spare; the router holds the file in memory, at the word of
an admin request, so the size is capped as checkpoint metadata's is."""
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
SLACK_TOKENS = 4
CONCURRENCY = 4
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EvalCase:
    where: str
    """`FILE:LINE`, for messages."""
    expected: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    """The conversation before the expected assistant turn (chat examples)."""


def load_eval(path: Path, *, root: Path) -> list[EvalCase]:
    """The examples of eval file `path`. Refused (403) unless it resolves inside `root`;
    DataError naming `FILE:LINE` for a bad example, or the file for one that cannot be
    an eval set (`_read_eval_file`)."""
    records = parse_records(_read_eval_file(path, root), path)
    if len(records) > MAX_EXAMPLES:
        raise DataError(f"{path}: {len(records)} examples; an eval set may hold at most "
                        f"{MAX_EXAMPLES}")
    cases = []
    for number, record in records:
        where = f"{path}:{number}"
        if "messages" in record:
            messages = record["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            cases.append(EvalCase(where, messages[last]["content"],
                                  messages=[{"role": m["role"], "content": m["content"]}
                                            for m in messages[:last]]))
        else:
            cases.append(EvalCase(where, record["completion"], prompt=record["prompt"]))
    return cases


def _read_eval_file(path: Path, root: Path) -> bytes:
    """The bytes of `path`, read as a checkpoint's files are (`dpserve.checkpoint.
    open_regular`): the name must not be a symbolic link; resolved once, it must lie
    inside `root` (else Refused 403) and is opened from `root` down without following
    a link at any step (a directory or the file swapped for a link after the check is
    refused: what is read is what was checked), without blocking, and must be a
    regular file of at most MAX_EVAL_BYTES."""
    linked = DataError(f"{path}: a symbolic link; name the eval file itself (links are "
                       "not followed, as in a checkpoint)")
    if path.is_symlink():
        raise linked
    # realpath, not Path.resolve: that raises on a symbolic link loop (a 500, not a 422).
    top, real = Path(os.path.realpath(root)), Path(os.path.realpath(path))
    if not real.is_relative_to(top):
        raise Refused(403, f"{path} is not inside the checkpoint root {root} (set "
                           "--checkpoint-root to read eval sets from elsewhere)",
                      param="eval_data")
    parts = real.relative_to(top).parts
    if not parts:
        raise DataError(f"{path}: a directory, not a regular file")
    try:
        parent = open_dir_under(top, parts[:-1], where=real.parent)
    except CheckpointError as exc:
        raise DataError(str(exc)) from None
    except OSError as exc:
        raise open_error(path, exc) from None
    try:
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise (linked if exc.errno == errno.ELOOP else open_error(path, exc)) from None
    finally:
        os.close(parent)
    return read_regular(fd, path, max_bytes=MAX_EVAL_BYTES)


@dataclass(frozen=True)
class Score:
    exact_match: float
    mean_logprob: float | None
    """None: not measured (engines with LoRA enabled)."""
    examples: int
    hits: tuple[float, ...] = field(default=(), repr=False)
    """Per example, in the eval set's order: 1.0 for an exact match, else 0.0..."""
    logprobs: tuple[float, ...] = field(default=(), repr=False)
    """...and the mean log-probability per token of its expected answer."""

    def metric(self, name: str) -> float | None:
        return self.exact_match if name == "exact_match" else self.mean_logprob

    def per_example(self, name: str) -> tuple[float, ...]:
        return self.hits if name == "exact_match" else self.logprobs

    @classmethod
    def mean(cls, runs: Sequence[Score]) -> Score:
        """The runs of one eval set averaged: what the record shows of repeated runs."""
        n = len(runs)
        logprobs = [r.mean_logprob for r in runs if r.mean_logprob is not None]
        return cls(sum(r.exact_match for r in runs) / n,
                   sum(logprobs) / n if len(logprobs) == n else None, runs[0].examples)

    def to_json(self) -> dict[str, Any]:
        return {"exact_match": round(self.exact_match, 4),
                "mean_logprob": (None if self.mean_logprob is None
                                 else round(self.mean_logprob, 4)),
                "examples": self.examples}

    def describe(self, metric: str) -> str:
        got = self.metric(metric)
        shown = "not measured" if got is None else f"{got:.4g}"
        return f"{metric} {shown} over {self.examples} examples"


@dataclass(frozen=True)
class Gate:
    eval_data: str
    cases: list[EvalCase]
    metric: str = "exact_match"
    min_score: float | None = None
    vs_current: bool = False
    margin: float = 0.0
    repeats: int = 2
    """Runs of the eval set on each version: their spread is the score's own noise."""
    logprobs: bool = True
    """Whether mean_logprob is measured (not on engines with LoRA enabled)."""

    @property
    def gates(self) -> bool:
        """Whether a score can stop the deploy (else the scores are only recorded)."""
        return self.min_score is not None or self.vs_current

    def compare(self, candidate: Sequence[Score], current: Sequence[Score]) -> Comparison:
        return compare([r.per_example(self.metric) for r in candidate],
                       [r.per_example(self.metric) for r in current])

    def verdict(self, candidate: Sequence[Score],
                comparison: Comparison | None) -> str | None:
        """Why the candidate (its runs) fails the gate, or None. Against the current
        version it fails only when surely worse than the margin allows
        (`gate_verdict`)."""
        scored = Score.mean(candidate)
        got = scored.metric(self.metric)
        if self.min_score is not None and got is not None and got < self.min_score:
            return (f"quality gate: {scored.describe(self.metric)}, below the minimum "
                    f"{self.min_score:g}")
        if self.vs_current and comparison is not None and comparison.worse(self.margin):
            return (f"quality gate: {scored.describe(self.metric)}, "
                    f"{comparison.describe()} against the current version: surely more "
                    f"than the margin {self.margin:g} below it")
        return None


async def score(client: httpx.AsyncClient, url: str, model: str,
                cases: list[EvalCase], *, logprobs: bool = True) -> Score:
    """Score `cases` on the engine at `url` serving `model`; mean_logprob only with
    `logprobs`. EngineAdminError("eval", ...) on an engine error."""
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(case: EvalCase) -> tuple[bool, float | None]:
        async with slots:
            return await _score_case(client, url.rstrip("/"), model, case, logprobs)

    results = await asyncio.gather(*(one(c) for c in cases))
    measured = [lp for _, lp in results if lp is not None]
    return Score(exact_match=sum(ok for ok, _ in results) / len(results),
                 mean_logprob=sum(measured) / len(results) if logprobs else None,
                 examples=len(results), hits=tuple(float(ok) for ok, _ in results),
                 logprobs=tuple(measured))


async def _score_case(client: httpx.AsyncClient, url: str, model: str,
                      case: EvalCase, logprobs: bool) -> tuple[bool, float | None]:
    if case.messages is not None:
        prompt = await _tokens(client, url, {"model": model, "messages": case.messages,
                                             "add_generation_prompt": True})
    else:
        prompt = await _tokens(client, url, {"model": model, "prompt": case.prompt})
    expected = await _tokens(client, url, {"model": model, "prompt": case.expected,
                                           "add_special_tokens": False})
    greedy = await _post(client, url + "/v1/completions", {
        "model": model, "prompt": prompt, "temperature": 0,
        "max_tokens": len(expected) + SLACK_TOKENS})
    try:
        right = greedy["choices"][0]["text"].strip() == case.expected.strip()
    except (KeyError, IndexError, TypeError, AttributeError):
        raise EngineAdminError("eval", f"{case.where}: unexpected answer from the engine") \
            from None
    if not logprobs:
        return right, None
    scored = await _post(client, url + "/v1/completions", {
        "model": model, "prompt": prompt + expected, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0})
    try:
        entries = scored["choices"][0]["prompt_logprobs"][len(prompt):]
        found = [float(entry[str(token)]["logprob"])
                 for entry, token in zip(entries, expected, strict=True)]
    except (KeyError, IndexError, TypeError, ValueError):
        raise EngineAdminError("eval", f"{case.where}: unexpected answer from the engine") \
            from None
    if not found or not all(math.isfinite(lp) for lp in found):
        raise EngineAdminError("eval", f"{case.where}: non-finite log-probabilities",
                               non_finite=bool(found))
    return right, sum(found) / len(found)


async def _tokens(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[int]:
    answer = await _post(client, url + "/tokenize", body)
    tokens = answer.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EngineAdminError("eval", f"/tokenize answered {str(answer)[:200]}")
    return tokens


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    try:
        resp = await client.post(url, json=body, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise EngineAdminError("eval", f"{type(exc).__name__} from {url}") from None
    try:
        answer = resp.json()
    except ValueError:
        answer = None
    if resp.status_code != 200 or not isinstance(answer, dict):
        raise EngineAdminError("eval", f"HTTP {resp.status_code} from {url}: {resp.text[:200]}")
    return answer


def gate_for(options: DeployOptions, *, root: Path, replicas: int,
             lora: bool = False) -> Gate | None:
    """The gate a deploy's options ask for (None: no eval set), its eval file read and
    checked; Refused (nothing changed) for a file outside `root` (403), one that is not
    a regular file, is a symbolic link or is larger than MAX_EVAL_BYTES (422), a
    malformed one (422, naming `FILE:LINE`), a fleet of one replica (400), or
    mean_logprob asked of engines with LoRA enabled (`lora`, 409). Blocking
    (file I/O), but never on the file's contents: a FIFO or device is refused at once."""
    if options.eval_data is None:
        return None
    if replicas < 2:
        raise Refused(400, "the eval set runs on the first updated replica out of rotation, "
                           "while another serves and, for gate_vs_current, keeps the current "
                           "version to compare with: a single replica cannot do either",
                      param="eval_data")
    if lora and options.gate_metric == "mean_logprob":
        raise Refused(409, "gate_metric mean_logprob needs prompt log-probabilities, which "
                           "engines with LoRA enabled fail on when batched (vLLM 0.32, "
                           "issue #16668): gate on exact_match here", param="gate_metric")
    path = Path(options.eval_data)
    try:
        cases = load_eval(path, root=root)
    except DataError as exc:
        raise Refused(422, f"eval set: {exc}", param="eval_data") from None
    return Gate(eval_data=str(path), cases=cases, metric=options.gate_metric,
                min_score=options.gate_min_score, vs_current=options.gate_vs_current,
                margin=options.gate_margin, repeats=options.gate_repeats, logprobs=not lora)
