"""Start-up and shutdown of `dpserve serve` with real vLLM (CPU, tiny model).

- A replica that cannot load the model fails `serve`, with the replica's log.
- `--enable-lora --lora NAME=DIR`: one replica started with an adapter named on the
  command line; the router lists it with its version and parent, it answers greedily
  as transformers + peft runs it, and the engine's own `vllm:lora_requests_info` (what
  adapter affinity reads) names it as dpserve named it.
- SIGTERM (the same fleet, last) finishes the stream in flight and leaves no process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dpserve.demo import serve_command, wait_ready
from dpserve.replicas.launcher import free_port
from dpserve.router.fleet.engine_metrics import parse_engine_metrics
from tests.finetune_helpers import reference_greedy
from tests.integration.conftest import (
    MODEL_NAME,
    READY_DEADLINE_S,
    Deployment,
    offline_env,
    spawn_deployment,
)
from tests.procs import process_alive, processes_in_group
from tests.rollout.checkpoints import write_adapter
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

NEW_TOKENS = 8


def strong(arrays: dict) -> dict:
    """Scale lora_B up so the adapter visibly changes the greedy answer."""
    return {k: v * 40 if ".lora_B." in k else v for k, v in arrays.items()}


@pytest.fixture(scope="module")
def started(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Deployment, Path, Path]]:
    work = tmp_path_factory.mktemp("lora-at-start")
    adapter, _ = write_adapter(tiny_model, work / "lora", rank=8, tensors=strong)
    d = spawn_deployment(tiny_model, work, replicas=1, checkpoint_root=work, serve_args=(
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
        "--lora", f"boot={adapter}"))
    try:
        wait_ready(d.base_url, d.proc, READY_DEADLINE_S)
        # Ready means a replica serves; the start adapters are deployed right after.
        wait_for_sync(lambda: "boot" in models(d), "the start adapter listed", within_s=120)
        yield d, tiny_model, adapter
    finally:
        d.stop()


def models(d: Deployment) -> dict[str, dict]:
    data = httpx.get(d.base_url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m for m in data}


def test_a_replica_that_cannot_load_the_model_fails_serve_with_its_log(tiny_model, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in tiny_model.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["num_attention_heads"] = 3  # hidden size no longer divides: vLLM refuses it
    (broken / "config.json").write_text(json.dumps(config))

    cmd = serve_command(broken, replicas=1, port=free_port(), served_name=MODEL_NAME,
                        run_dir=tmp_path / "runs")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=offline_env())
    assert done.returncode == 1
    assert "replica r0 failed to start: process exited with code" in done.stderr
    assert "--- last lines of" in done.stderr  # the replica's own log tail follows
    log_dirs = list((tmp_path / "runs").iterdir())
    assert (log_dirs[0] / "replica-r0.log").stat().st_size > 0


def test_a_start_adapter_serves_as_peft_runs_it_and_the_engine_reports_it(started) -> None:
    d, base, adapter = started
    listed = models(d)
    assert listed["boot"]["parent"] == MODEL_NAME
    version = listed["boot"]["dpserve"]["version"]
    assert f"boot@{version}" in listed
    prompt = httpx.post(d.base_url + "/tokenize", json={"model": MODEL_NAME,
                        "prompt": "Tell me about rain."}, timeout=30).json()["tokens"]
    expected = reference_greedy(base, prompt, NEW_TOKENS, adapter=adapter)
    assert expected != reference_greedy(base, prompt, NEW_TOKENS), "the adapter must matter"
    c = openai.OpenAI(base_url=d.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=120)
    raw = c.completions.with_raw_response.create(
        model="boot", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"return_token_ids": True})
    assert raw.headers["x-dpserve-weight-version"] == version
    answer = raw.parse()
    assert answer.model == "boot" and answer.choices[0].token_ids == expected
    assert answer.system_fingerprint == version
    [(_, port)] = d.replicas().values()
    engine = parse_engine_metrics(scrape_while_streaming(d, port, "boot"))
    assert engine.max_loras == 1
    assert engine.lora_running == {f"boot@{version}"}  # as dpserve named it to the engine


def scrape_while_streaming(d: Deployment, port: int, model: str) -> str:
    """The engine's /metrics read while a long stream for `model` is in its batch."""
    body = {"model": model, "prompt": "Tell me about rain.", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", d.base_url + "/v1/completions", json=body, timeout=120) as r:
        events = r.iter_lines()
        assert any(line.startswith("data: ") for line in events)  # generating
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for _ in events:
            pass
    return text


def test_the_status_command_lists_the_start_adapter(started) -> None:
    d, _, _ = started
    status = subprocess.run([sys.executable, "-m", "dpserve", "status", "--router",
                             d.base_url], capture_output=True, text=True, timeout=60,
                            env=offline_env())
    assert status.returncode == 0 and "boot@" in status.stdout, status.stdout + status.stderr


def test_sigterm_finishes_in_flight_requests_and_leaves_no_process(started) -> None:
    """The module's last test: it stops the fleet."""
    d, _, _ = started
    try:
        replica_pid, _ = d.replicas()["r0"]
        assert processes_in_group(replica_pid)  # the API server and its engine core
        first_chunk = threading.Event()
        result: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", d.base_url + "/v1/completions", timeout=120, json={
                "model": MODEL_NAME, "prompt": "Slowly", "max_tokens": 48, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True},
            }) as r:
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        first_chunk.set()
                result["events"] = events

        t = threading.Thread(target=stream)
        t.start()
        assert first_chunk.wait(60)
    finally:
        code = d.stop()
    t.join(60)
    assert code == 0
    events = result["events"]
    assert events[-1] == "[DONE]"  # the in-flight stream finished, it was not cut
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 48
    assert processes_in_group(replica_pid) == []
    assert not process_alive(d.proc.pid)
    with pytest.raises(httpx.ConnectError):
        httpx.get(d.base_url + "/health", timeout=2)
