"""`dpserve demo` end to end: real replicas, a real DDP fine-tune, a deploy under load."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dpserve.demo import PASS_ACCURACY
from tests.integration.conftest import offline_env

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(900)
def test_the_demo_fine_tunes_and_deploys_right_answers_without_failing_a_request(
        tiny_model: Path, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "dpserve", "demo", "--model", str(tiny_model),
         "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=840, env=offline_env())
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    (run,) = tmp_path.glob("demo-*")

    answers = json.loads((run / "answers.json").read_text())
    assert answers["accuracy_before"] == 0
    assert answers["accuracy_after"] >= PASS_ACCURACY, answers["after"]
    for before, after in zip(answers["before"], answers["after"], strict=True):
        assert before["question"] == after["question"]
        if after["answer"] == after["expected"]:
            assert before["answer"] != after["answer"]
    version = re.search(r"now serving (step-000300@\w+)", output)
    assert version, output[-6000:]
    for replica in ("r0", "r1"):  # `dpserve status` after the deploy
        assert re.search(rf"^{replica}\s+ready\s+\d+\s+{version[1]}", output, re.M)

    load = json.loads((run / "loadtest.json").read_text())["metrics"]
    assert load["failed"] == 0 and load["completed"] > 0
    assert "succeeded in" in output and "is deployed" in output
    # the load ran before the deploy, throughout it, and was stopped after it
    assert "ended before the deploy" not in output
    ttft = re.search(r"TTFT p50 / p99: \d+ / \d+ ms \((\d+) requests\) before the deploy · "
                     r"\d+ / \d+ ms \((\d+) requests\) during it", output)
    assert ttft and int(ttft[1]) > 0 and int(ttft[2]) > 0, output[-6000:]
    assert "exited with code 0; no process left behind" in output
    assert "demo passed" in output
