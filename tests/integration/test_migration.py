"""Stream migration on real vLLM replicas (CPU): a stream moved mid-way by an admin
drain with `move_streams` ends exactly as an uninterrupted run, stop strings
included, and a chat without a limit runs to the end of the context. Its engine is
paused first (vLLM's `/pause`, requests kept) at its 30th token, the engine stepped
15 ms at a time until then so that the pause lands mid-way however loaded the
machine.
Streams that may not move fail as they always did, each reason counted, when their
replica is killed. (A greedy stream whose replica is killed mid-way:
tests/integration/test_serve.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psutil
import pytest

from tests.integration.conftest import MODEL_NAME, Deployment, replica_metric, replica_slowed
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

PROMPT = "Once upon a time, in a land far away,"


def streamed(d: Deployment, body: dict[str, Any], on_chunk: Callable[[int], None] | None = None,
             *, chat: bool = False) -> dict[str, Any]:
    """One greedy completion stream (or chat, PROMPT its user message): each chunk's
    text, the end, usage, migrations."""
    out: dict[str, Any] = {"pieces": [], "finish": None, "stop": None, "usage": None,
                           "seams": [], "done": False}
    prompt = ({"messages": [{"role": "user", "content": PROMPT}]} if chat
              else {"prompt": PROMPT})
    payload = {"model": MODEL_NAME, **prompt, "temperature": 0, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}} | body
    route = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.Client(timeout=120) as h, h.stream("POST", d.base_url + route,
                                                  json=payload) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            out["usage"] = chunk.get("usage") or out["usage"]
            out["seams"] = chunk.get("dpserve", {}).get("migrations", out["seams"])
            for c in chunk["choices"]:
                out["pieces"].append((c["delta"].get("content") or "") if chat else c["text"])
                if c["finish_reason"]:
                    out["finish"], out["stop"] = c["finish_reason"], c.get("stop_reason")
            if chunk["choices"]:
                n += 1
                if on_chunk is not None:
                    on_chunk(n)
    return out


def admin(d: Deployment, replica: str, action: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{d.base_url}/admin/replicas/{replica}/{action}", json=body, timeout=30)
    r.raise_for_status()
    return dict(r.json())


def describe(d: Deployment, replica: str) -> dict[str, Any]:
    listing = httpx.get(d.base_url + "/admin/replicas", timeout=10).json()["replicas"]
    return dict(next(r for r in listing if r["id"] == replica))


def state(d: Deployment, replica: str) -> str:
    return str(describe(d, replica)["state"])


class MidStreamPause:
    """Pauses r0's engine once, with its requests kept (what SIGSTOP or a hung GPU
    looks like to the router), after it has generated `after_tokens` tokens of the
    stream, then brings r1 back and runs `then`.

    Deterministic on a machine however loaded: r0's engine processes are stopped
    (SIGSTOP) before the stream starts and let run in 15 ms steps (`step`), its API
    server answering all along, until its token counter shows `after_tokens` (a step
    makes 2 to 30 tokens here; more when this process is not scheduled for a while,
    rarely all of a stream, see TRIES). `/pause`
    is sent while the engine is stopped, then the engine is let go: it takes the pause
    within a step or two, hundreds of tokens before the stream could end. (Timing the
    pause against a stream running free failed 8 tries in a row beside other load.)
    `caught` says whether the stream was still running on the engine when it paused."""

    def __init__(self, d: Deployment, then: Callable[[], None], after_tokens: int) -> None:
        self._d, self._then, self._after = d, then, after_tokens
        self.r0 = describe(d, "r0")["url"]
        api_pid, _ = d.replicas()["r0"]
        self._engine = engine_processes(api_pid)
        self._port = int(self.r0.rsplit(":", 1)[1])
        self._start = replica_metric(self._port, GENERATED)
        self.caught: bool | None = None

    def __enter__(self) -> MidStreamPause:
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *_: object) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        """Every engine process: stopped workers first, continued core first."""
        for pid in (self._engine if sig == signal.SIGCONT else reversed(self._engine)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def step(self, stop: threading.Event) -> None:
        """Let the engine run 15 ms at a time until it has generated enough, then pause
        it (`stop`: the test ended first)."""
        with contextlib.suppress(OSError):  # where allowed: a step overruns less
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
        while not stop.is_set():
            self._signal(signal.SIGCONT)
            time.sleep(0.015)
            self._signal(signal.SIGSTOP)
            if replica_metric(self._port, GENERATED) >= self._start + self._after:
                break
        else:
            return
        pausing = threading.Thread(target=self._pause, daemon=True)
        pausing.start()  # queued at the stopped engine: taken before its next steps
        time.sleep(0.05)
        self._signal(signal.SIGCONT)
        pausing.join(timeout=60)
        self.caught = replica_metric(self._port, "vllm:num_requests_running") >= 1
        admin(self._d, "r1", "undrain")
        self._then()

    def _pause(self) -> None:
        httpx.post(self.r0 + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()


def engine_processes(api_pid: int) -> list[int]:
    """The pids of the processes an API server started to run its engine (vLLM names
    them `VLLM::EngineCore` and `VLLM::Worker`): the core alone stopped, its worker
    ran a whole stream on."""
    found = []
    for child in psutil.Process(api_pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.name().startswith("VLLM::"):
                found.append(int(child.pid))
    assert found, f"no engine process under the API server {api_pid}"
    return found


GENERATED = "vllm:generation_tokens_total"


@contextmanager
def paused_mid_stream(d: Deployment, then: Callable[[], None] = lambda: None,
                      after_tokens: int = 30) -> Iterator[MidStreamPause]:
    """The stream started in the block runs on r0 (r1 drained) and is paused mid-way
    (`MidStreamPause`). Undone on leaving; a failure in the stepper fails the test."""
    failed: list[BaseException] = []
    stop = threading.Event()
    admin(d, "r1", "drain")

    def run() -> None:
        try:
            pause.step(stop)
        except BaseException as e:  # re-raised in the test's thread
            failed.append(e)

    with MidStreamPause(d, then, after_tokens) as pause:
        stepper = threading.Thread(target=run, daemon=True)
        stepper.start()
        try:
            yield pause
        finally:
            stop.set()
            stepper.join(timeout=60)
    httpx.post(pause.r0 + "/resume", timeout=30)
    admin(d, "r1", "undrain")
    admin(d, "r0", "undrain")
    if failed:
        raise failed[0]


TRIES = 4
"""Tries of a stream paused mid-way. A step overruns when this process is not
scheduled (a loaded machine: 15 ms steps measured up to 320 ms), and once in a while
one lets the whole stream run: 2 of 12 streams beside a type checker and two test
runs, none of 3 alone."""


def last_new(text: str, start: int) -> tuple[int, str]:
    """The latest text of 12 to 40 characters at or after `start` not seen before it:
    a stop string with one place to stop, as late as the greedy text allows (the tiny
    model repeats itself)."""
    for at in range(len(text) - 12, start - 1, -1):
        for size in range(12, 41):
            piece = text[at:at + size]
            if len(piece) == size and text.find(piece) == at:
                return at, piece
    raise AssertionError(f"nothing new after {start} in {text!r}")


def test_a_stream_with_a_stop_string_moved_by_a_drain_stops_where_it_would_have(deployment):
    # A stop string from well into the greedy text, 12 or more characters long: vLLM
    # holds back 11 or more characters of text, which the move must deliver; the stop
    # string completes on the replica the stream moved to, where the router checks it.
    plain = streamed(deployment, {"max_tokens": 900})
    text = "".join(plain["pieces"])
    at, stop = last_new(text, len("".join(plain["pieces"][:100])))
    body = {"max_tokens": 900, "stop": [stop]}
    reference = streamed(deployment, body)
    assert "".join(reference["pieces"]) == text[:at] and reference["stop"] == stop

    for _ in range(TRIES):
        moved: list[dict[str, Any]] = []
        with paused_mid_stream(deployment, then=lambda: moved.append(  # noqa: B023
                admin(deployment, "r0", "drain", move_streams=True))) as pause:
            got = streamed(deployment, body)
        wait_for_sync(lambda: state(deployment, "r0") == state(deployment, "r1") == "ready",
                      "both replicas back in rotation", within_s=60)
        if pause.caught or got["seams"]:  # a stream that moved was caught, whatever
            break                         # the engine's gauge said when it paused
    else:
        pytest.fail(f"the stream ended before its engine was paused, {TRIES} times")
    assert moved and moved[0]["moved_streams"] == 1, moved
    assert [(s["from"], s["to"], s["reason"]) for s in got["seams"]] == [
        ("r0", "r1", "drained")]
    assert "".join(got["pieces"]) == text[:at] and got["done"]
    assert (got["finish"], got["stop"]) == ("stop", stop)
    assert got["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]


def test_a_chat_without_a_limit_moved_by_a_drain_runs_to_the_end_of_the_context(deployment):
    """A chat without `max_tokens` runs to the context's end (1024 tokens); so must its
    continuation, a completion, whose own default would have stopped it 16 tokens on."""
    reference = streamed(deployment, {}, chat=True)
    context = reference["usage"]["prompt_tokens"] + reference["usage"]["completion_tokens"]
    assert context == 1024 and reference["finish"] == "length"
    for _ in range(TRIES):
        with paused_mid_stream(deployment, then=lambda: admin(
                deployment, "r0", "drain", move_streams=True)) as pause:
            got = streamed(deployment, {}, chat=True)
        wait_for_sync(lambda: state(deployment, "r0") == state(deployment, "r1") == "ready",
                      "both replicas back in rotation", within_s=60)
        if pause.caught or got["seams"]:  # a stream that moved was caught, whatever
            break                         # the engine's gauge said when it paused
    else:
        pytest.fail(f"the stream ended before its engine was paused, {TRIES} times")
    assert [(s["from"], s["to"], s["reason"]) for s in got["seams"]] == [
        ("r0", "r1", "drained")]
    assert "".join(got["pieces"]) == "".join(reference["pieces"]) and got["done"]
    assert got["finish"] == "length"
    assert got["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]


def test_a_stream_whose_engine_stalls_moves_after_the_idle_timeout_and_ends_exactly(
        deployment):
    """r0's engine paused mid-stream (requests kept, sockets open: what SIGSTOP or a hung
    GPU looks like from the router): after 20 s without a chunk the stream goes on on r1,
    token for token what it would have been."""
    body = {"max_tokens": 900}
    reference = streamed(deployment, body)
    for _ in range(TRIES):
        with paused_mid_stream(deployment) as pause:
            got = streamed(deployment, body)
        if pause.caught or got["seams"]:  # a stream that moved was caught, whatever
            break                         # the engine's gauge said when it paused
    else:
        pytest.fail(f"the stream ended before its engine was paused, {TRIES} times")
    assert [(s["from"], s["to"], s["reason"]) for s in got["seams"]] == [
        ("r0", "r1", "stalled")]
    assert "".join(got["pieces"]) == "".join(reference["pieces"]) and got["done"]
    assert got["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"] == 900
    wait_for_sync(lambda: state(deployment, "r0") == state(deployment, "r1") == "ready",
                  "both replicas in rotation", within_s=60)


REFUSED = {
    "n": {"n": 2, "temperature": 0.8},
    "logprobs": {"logprobs": 1},
    "penalties": {"presence_penalty": 0.5},
    "echo": {"echo": True},
    "seed": {"seed": 7, "temperature": 0.8},
    "bad_words": {"bad_words": ["the"]},
    "several_prompts": {"prompt": ["Once upon a time", "In a land far away"]},
}
"""A stream vLLM serves but the router may not continue as the same request, by the
reason the router counts (dpserve.router.migration.eligibility)."""


def refusals(d: Deployment) -> dict[str, float]:
    text = httpx.get(d.base_url + "/metrics", timeout=10).text
    prefix = 'dpserve_migration_refusals_total{reason="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_streams_that_cannot_move_fail_cleanly_when_their_replica_dies(deployment):
    """One stream per reason, all on r1, which is killed while every one runs (r1 slowed
    till then): each ends with an error event and `[DONE]` (as before migration
    existed) and its reason is counted; none hangs. r1 is restarted by the supervisor,
    and both replicas are ready again, before the test ends, whatever it found."""
    before = refusals(deployment)
    pid, _ = deployment.replicas()["r1"]
    started = {reason: threading.Event() for reason in REFUSED}
    ended: dict[str, tuple[int, list[str]]] = {}
    served_by: dict[str, str | None] = {}

    def payload(reason: str, max_tokens: int) -> dict[str, Any]:
        return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "temperature": 0} | REFUSED[reason]

    # Each kind of request once, first: what the engine does on a feature's first use
    # (seconds, on a busy machine) would otherwise let the streams started before it
    # end before the last one starts, and the kill would catch none of them.
    for reason in REFUSED:
        with httpx.Client(timeout=120) as h:
            assert h.post(deployment.base_url + "/v1/completions",
                          json=payload(reason, 1) | {"stream": False}).status_code == 200

    def run(reason: str) -> None:
        events: list[str] = []
        try:
            with httpx.Client(timeout=120) as h, h.stream(  # near the 1024-token context
                    "POST", deployment.base_url + "/v1/completions",
                    json=payload(reason, 1000)) as r:
                served_by[reason] = r.headers.get("x-dpserve-replica")
                if r.status_code != 200:
                    events.append(r.read().decode())
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started[reason].set()
            ended[reason] = (r.status_code, events[-2:])
        finally:
            started[reason].set()  # an answer that is no stream fails the test below

    admin(deployment, "r0", "drain")  # every stream on r1
    threads = [threading.Thread(target=run, args=(reason,), daemon=True) for reason in REFUSED]
    killed = False
    try:
        # Slowed, so that no stream ends while the others start (a loaded machine can let
        # the client read a first chunk seconds late: CI saw every stream end first).
        with replica_slowed(pid, stop_s=0.3, run_s=0.02):  # 15 parts in 16
            for t in threads:
                t.start()
            for reason, event in started.items():
                assert event.wait(60), f"the {reason} stream did not start"
            os.killpg(pid, signal.SIGKILL)  # the replica's processes, at once (stopped or
            killed = True                   # not): r0's undrain (a health check) waits after
        admin(deployment, "r0", "undrain")
        for t in threads:
            t.join(timeout=60)
        assert served_by == dict.fromkeys(REFUSED, "r1"), served_by
        for reason in REFUSED:
            assert reason in ended, f"the {reason} stream did not end"
            status, (last, done) = ended[reason]
            assert status == 200 and done == "[DONE]", (reason, ended[reason])
            event = json.loads(last)
            assert "stream interrupted" in event.get("error", {}).get("message", ""), (
                f"the {reason} stream did not end with the kill", last)
        after = refusals(deployment)
        assert {r: after.get(r, 0) - before.get(r, 0) for r in REFUSED} == dict.fromkeys(
            REFUSED, 1)
    finally:
        admin(deployment, "r0", "undrain")
        # Whatever failed above, the next tests get both replicas back.
        wait_for_sync(lambda: (not killed or deployment.replicas()["r1"][0] != pid)
                      and state(deployment, "r1") == "ready"
                      and state(deployment, "r0") == "ready",
                      "both replicas ready (r1 restarted)", within_s=300, every_s=1.0)
