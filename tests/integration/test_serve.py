"""`dpserve serve` end to end: real vLLM replicas (CPU) behind the router, the
official `openai` client in front. The deployment starts once per session."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from dpserve.rollout.deployed import weights_for
from tests.integration.conftest import MODEL_NAME, Deployment, replica_metric
from tests.procs import processes_in_group
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm


def client(d: Deployment) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.base_url + "/v1", api_key="unused", max_retries=0)


def test_completion_through_the_openai_client(deployment, tiny_model):
    raw = client(deployment).completions.with_raw_response.create(
        model=MODEL_NAME, prompt="The river ran", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True},
    )
    c = raw.parse()
    assert c.model == MODEL_NAME
    assert c.usage.completion_tokens == 8
    assert c.choices[0].text
    # the weights that answered, in the header and where the answer has a field for it
    version = weights_for(str(tiny_model)).version
    assert c.system_fingerprint == raw.headers["x-dpserve-weight-version"] == version


def test_greedy_completions_agree_across_replicas(deployment):
    """Every replica holds the same full model: same prompt, same greedy answer."""
    answers = {}
    with httpx.Client(timeout=60) as h:
        for _ in range(8):
            r = h.post(deployment.base_url + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "A quiet morning", "max_tokens": 6,
                "temperature": 0})
            answers.setdefault(r.headers["x-dpserve-replica"], set()).add(
                r.json()["choices"][0]["text"])
    assert all(len(texts) == 1 for texts in answers.values())
    assert len({t for texts in answers.values() for t in texts}) == 1


def test_streaming_chat_arrives_in_chunks_with_usage(deployment):
    stream = client(deployment).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=64, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    # Streamed, not one buffered blob. (vLLM merges the tokens its server has not sent
    # yet into one delta: on two busy cores all of 12 once came as one; 64 leave room.)
    assert len(content) >= 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 64


def test_models_lists_the_served_model(deployment):
    assert [m.id for m in client(deployment).models.list().data] == [MODEL_NAME]


def test_unknown_model_is_a_404_from_the_router(deployment):
    with pytest.raises(openai.NotFoundError) as exc:
        client(deployment).completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert "no-such-model" in str(exc.value)


def test_tokenize_and_detokenize_are_forwarded(deployment):
    with httpx.Client(base_url=deployment.base_url, timeout=30) as h:
        tokens = h.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello world"}).json()
        text = h.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens["tokens"]})
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert "hello world" in text.json()["prompt"]


async def test_concurrent_requests_spread_over_both_replicas(deployment):
    async with openai.AsyncOpenAI(base_url=deployment.base_url + "/v1", api_key="unused",
                                  max_retries=0) as c:
        responses = await asyncio.gather(*(
            c.completions.with_raw_response.create(
                model=MODEL_NAME, prompt=f"Story {i}", max_tokens=16,
                extra_body={"ignore_eos": True})
            for i in range(6)
        ))
    served_by = [r.headers["x-dpserve-replica"] for r in responses]
    assert set(served_by) == {"r0", "r1"}


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/collective_rpc"), ("POST", "/pause"), ("POST", "/resume"),
    ("POST", "/sleep"), ("POST", "/reset_prefix_cache"), ("POST", "/update_weight_version"),
    ("GET", "/is_paused"), ("GET", "/server_info"),
])
def test_vllm_dev_endpoints_are_not_reachable_through_the_router(deployment, method, path):
    routed = httpx.request(method, deployment.base_url + path, timeout=10,
                           json={"method": "get_model_config"} if method == "POST" else None)
    assert routed.status_code == 404
    assert routed.json()["error"]["code"] == 404


def test_dev_mode_is_on_behind_the_router(deployment):
    """The dev endpoints exist on the replicas (hot-loading needs them): only the
    router's allow-list keeps them from clients."""
    _, port = deployment.replicas()["r0"]
    direct = httpx.get(f"http://127.0.0.1:{port}/is_paused", timeout=10)
    assert direct.status_code == 200
    assert direct.json() == {"is_paused": False}
    assert httpx.get(deployment.base_url + "/is_paused", timeout=10).status_code == 404


def test_client_disconnect_aborts_the_generation_on_the_replica(deployment):
    ports = [port for _, port in deployment.replicas().values()]

    def total(name: str) -> float:
        return sum(replica_metric(p, name) for p in ports)

    def leave_after_the_first_token() -> tuple[float, float]:
        """(seconds to the first token, tokens generated in all)."""
        generated_before = total("vllm:generation_tokens_total")
        start = time.monotonic()
        with httpx.Client(timeout=60) as h, h.stream(
            "POST", deployment.base_url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Long story", "max_tokens": 900,
                  "ignore_eos": True, "stream": True},
        ) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
            first_token_s = time.monotonic() - start
        # Once nothing runs any more, count what was made. (A scrape while it runs would
        # race the tiny model: 900 tokens take 1-3 s here.)
        wait_for_sync(lambda: total("vllm:num_requests_running") == 0,
                      "the replica's running-request count to fall back to 0", within_s=30)
        return first_token_s, total("vllm:generation_tokens_total") - generated_before

    # The client leaves after its first token: vLLM must abort the generation, making far
    # fewer than the 900 tokens asked for. On CPU, vLLM now and then sends its first event
    # only once the whole generation is done (seen: first token after 1.4 s, 900 made),
    # which no client or router can abort; so up to three tries, one of which must abort.
    tries = []
    for _ in range(3):
        tries.append(leave_after_the_first_token())
        if 1 <= tries[-1][1] < 900:
            break
    assert 1 <= tries[-1][1] < 900, (
        f"the generation ran on after the client left: (first token s, tokens) {tries}")
    # The router counts the request as abandoned by its client (not as served).
    wait_for_sync(lambda: 'dpserve_client_disconnects_total{route="/v1/completions"}'
                  in httpx.get(deployment.base_url + "/metrics").text,
                  "the router to count the client's disconnect", within_s=15)


def test_router_metrics_describe_the_replicas(deployment):
    text = httpx.get(deployment.base_url + "/metrics").text
    for rid in ("r0", "r1"):
        assert f'dpserve_replica_state{{replica="{rid}",state="ready"}} 1.0' in text
        assert f'dpserve_replica_in_flight_requests{{replica="{rid}"}}' in text
    assert "dpserve_request_duration_seconds_bucket" in text
    assert "vllm:" not in text  # never re-exported under vLLM's names


def test_loadtest_measures_the_deployment(deployment, tiny_model, tmp_path):
    from loadtest.cli import main as loadtest

    out = tmp_path / "loadtest.json"
    code = loadtest(["run", "--base-url", deployment.base_url, "--model", MODEL_NAME,
                     "--tokenizer", str(tiny_model), "--random-input-len", "16",
                     "--random-output-len", "32", "--num-prompts", "8", "--max-concurrency", "4",
                     "--num-warmups", "2", "--result-json", str(out), "--disable-tqdm"])
    metrics = json.loads(out.read_text())["metrics"]
    assert code == 0
    assert (metrics["completed"], metrics["failed"]) == (8, 0)
    assert metrics["total_output_tokens"] == 8 * 32  # ignore_eos: every answer is full length
    assert 0 < metrics["ttft_ms"]["median"] <= metrics["e2el_ms"]["median"]
    # Every answer has a TPOT. Its size is not asserted: on two busy cores vLLM and the
    # router now and then deliver a whole answer in one read (TPOT 0 for it; seen for most
    # of a run once); tests/loadtest checks the numbers against a server of known timing.
    assert metrics["tpot_ms"]["count"] == 8 and metrics["tpot_ms"]["mean"] >= 0
    assert metrics["output_throughput"] > 0
    # The router names the replica of every answer: both served a share.
    per_replica = metrics["per_replica"]
    assert set(per_replica) == {"r0", "r1"}
    assert sum(r["completed"] for r in per_replica.values()) == 8


class BackgroundLoad:
    """Non-streaming completions from a few threads until stopped (bounded in count)."""

    def __init__(self, base_url: str, workers: int = 3, max_each: int = 200) -> None:
        self.base_url = base_url
        self.results: list[tuple[int, str]] = []  # (status, replica or error text)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, max_each), daemon=True)
                         for i in range(workers)]

    def __enter__(self) -> BackgroundLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self, worker: int, max_each: int) -> None:
        with httpx.Client(timeout=120) as h:
            for i in range(max_each):
                if self._stop.is_set():
                    return
                r = h.post(self.base_url + "/v1/completions", json={
                    "model": MODEL_NAME, "prompt": f"load {worker}.{i}", "max_tokens": 8})
                self.results.append((r.status_code, r.headers.get("x-dpserve-replica", r.text)))

    def served_by(self, replica: str) -> int:
        return sum(1 for status, who in self.results if status == 200 and who == replica)

    def failures(self) -> list[tuple[int, str]]:
        return [(status, who) for status, who in self.results if status != 200]


def replica_state(d: Deployment, replica: str) -> str:
    listing = httpx.get(d.base_url + "/admin/replicas", timeout=10).json()["replicas"]
    return next(r["state"] for r in listing if r["id"] == replica)


def test_a_frozen_replica_is_taken_out_and_its_stream_goes_elsewhere(deployment):
    """SIGSTOP keeps r0's sockets open but answers nothing: only timeouts can tell. A
    stream's head comes at once from a live vLLM, so one with no head within the
    router's timeout is sent to another replica."""
    admin = deployment.base_url + "/admin/replicas/"
    pid, _ = deployment.replicas()["r0"]
    httpx.post(admin + "r1/drain", timeout=10).raise_for_status()  # the stream must go to r0
    os.killpg(pid, signal.SIGSTOP)
    stream: dict[str, object] = {}

    def send_stream() -> None:
        with httpx.Client(timeout=120) as h:
            r = h.post(deployment.base_url + "/v1/completions", json={
                "model": MODEL_NAME, "prompt": "frozen", "max_tokens": 8, "stream": True})
            stream.update(status=r.status_code, replica=r.headers.get("x-dpserve-replica"),
                          done=r.text.rstrip().endswith("data: [DONE]"))

    streamer = threading.Thread(target=send_stream, daemon=True)
    try:
        streamer.start()
        wait_for_sync(lambda: replica_state(deployment, "r0") == "down",
                      "the health checks to take r0 out", within_s=30)
        httpx.post(admin + "r1/undrain", timeout=10).raise_for_status()
        with BackgroundLoad(deployment.base_url, workers=2) as load:
            wait_for_sync(lambda: load.served_by("r1") >= 6, "requests to keep flowing to r1",
                          within_s=120)
        streamer.join(timeout=120)
    finally:
        os.killpg(pid, signal.SIGCONT)
        httpx.post(admin + "r1/undrain", timeout=10)
    assert load.failures() == []
    assert stream == {"status": 200, "replica": "r1", "done": True}  # never a hang
    wait_for_sync(lambda: replica_state(deployment, "r0") == "ready", "r0 to come back",
                  within_s=60)


def greedy_stream(d: Deployment, on_chunk: Callable[[int], None] | None = None,
                  ) -> tuple[str, list[dict[str, Any]]]:
    """A long greedy completion streamed through the openai client: its text, and the
    router's migration notes from the final chunk. `on_chunk(n)` after each chunk."""
    text = ""
    seams: list[dict[str, Any]] = []
    stream = client(d).completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=900, temperature=0,
        stream=True)
    for n, chunk in enumerate(stream, 1):
        text += "".join(c.text for c in chunk.choices)
        seams = (chunk.model_extra or {}).get("dpserve", {}).get("migrations", seams)
        if on_chunk is not None:
            on_chunk(n)
    return text, seams


def test_a_killed_replica_under_load_fails_no_request_and_is_restarted(deployment):
    """Runs last in this module: it takes r0 away for the length of a vLLM restart.
    A greedy stream on r0 when it dies goes on on r1 and prints exactly what it
    would have; the non-streaming requests on r0 are retried on r1."""
    old_pid, _ = deployment.replicas()["r0"]
    expected, _ = greedy_stream(deployment)
    admin = deployment.base_url + "/admin/replicas/"
    httpx.post(admin + "r1/drain", timeout=10).raise_for_status()  # load and stream on r0

    def kill_r0_mid_stream(n: int) -> None:
        # Early, and in a long stream: on a loaded machine the client may read seconds
        # behind the router, which must still be relaying when r0 dies.
        if n == 2:
            httpx.post(admin + "r1/undrain", timeout=10).raise_for_status()
            os.killpg(old_pid, signal.SIGKILL)  # the API server and its engine core

    try:
        with BackgroundLoad(deployment.base_url) as load:
            wait_for_sync(lambda: load.served_by("r0") >= 3, "load to reach r0", within_s=120)
            after_kill = len(load.results)
            streamed, seams = greedy_stream(deployment, kill_r0_mid_stream)
            wait_for_sync(lambda: len(load.results) >= after_kill + 9,
                          "requests after the kill", within_s=120)
    finally:
        httpx.post(admin + "r1/undrain", timeout=10)
    # Token for token what it would have been. It moved, unless the router had relayed
    # the whole stream before this client read its second chunk (seen once in CI on a
    # loaded machine); a move on real vLLM is asserted in test_migration.py, where the
    # engine is paused first.
    if seams:
        assert [(s["from"], s["to"], s["reason"]) for s in seams] == [
            ("r0", "r1", "disconnected")], seams
    assert streamed == expected
    assert load.failures() == []  # requests on r0 when it died were retried on r1
    # The router took r0 out, unless the supervisor already has it back: on a slow
    # machine its restart (~40 s) can finish while the load above is still counted.
    state = replica_state(deployment, "r0")
    assert state in ("down", "starting") or (
        state == "ready" and deployment.replicas()["r0"][0] != old_pid), state
    # SIGKILL is delivered at once, but tearing down a 3 GB process takes a moment.
    wait_for_sync(lambda: processes_in_group(old_pid) == [], "r0's processes to be gone",
                  within_s=30)

    def r0_ready() -> bool:
        text = httpx.get(deployment.base_url + "/metrics").text
        return 'dpserve_replica_state{replica="r0",state="ready"} 1.0' in text

    wait_for_sync(r0_ready, "r0 to be restarted and ready again", within_s=300, every_s=1.0)
    new_pid, _ = deployment.replicas()["r0"]
    assert new_pid != old_pid
    metrics = httpx.get(deployment.base_url + "/metrics").text
    assert 'dpserve_replica_restarts_total{replica="r0"} 1.0' in metrics
    r = httpx.post(deployment.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "back again", "max_tokens": 4})
    assert r.status_code == 200
