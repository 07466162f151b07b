"""Start-up failure and shutdown of `dpserve serve`, each with a deployment of its own."""

from __future__ import annotations

import json
import subprocess
import threading

import httpx
import pytest

from dpserve.demo import serve_command
from dpserve.replicas.launcher import free_port
from tests.integration.conftest import MODEL_NAME, offline_env, start_deployment
from tests.procs import process_alive, processes_in_group

pytestmark = pytest.mark.vllm


def test_sigterm_finishes_in_flight_requests_and_leaves_no_process(tiny_model, tmp_path):
    d = start_deployment(tiny_model, tmp_path, replicas=1)
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
