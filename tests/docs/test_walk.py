"""How the walk (tests/docs/walk.py) reads the docs: the order covers every doc, a
block splits around the line that starts the fleet, nothing else may run in the
background, and the docs' port is the one thing substituted."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import Block, blocks
from tests.docs.walk import Step, fleet_log, shown_output, steps, walk_blocks, with_port


def block(text: str, language: str = "bash") -> Block:
    return Block("docs/x.md", 3, language, "run", "", text)


def test_the_walk_covers_every_doc_in_its_order_and_runs_blocks_of_the_main_pages():
    walked = walk_blocks()
    docs = [b.doc for b in walked]
    assert docs[0] in ("README.md", "docs/workflows.md")
    assert docs == sorted(docs, key=docs.index)  # each doc's blocks together
    assert {"docs/workflows.md", "docs/finetuning.md"} <= set(docs)
    assert len(walked) >= 8


def test_a_block_splits_around_the_line_that_starts_the_fleet():
    found = steps(block(
        ".venv/bin/dpserve finetune --model m \\\n    --output runs/a\n"
        ".venv/bin/dpserve serve --model m --replicas 2 \\\n    -- --enforce-eager &\n"
        "curl -s localhost:8000/v1/models   # the served names\n"
        ".venv/bin/dpserve status\n"))
    assert found == [  # a continuation line joined, its indent kept
        Step("shell", ".venv/bin/dpserve finetune --model m  --output runs/a"),
        Step("fleet", ".venv/bin/dpserve serve --model m --replicas 2  -- --enforce-eager"),
        Step("shell", "curl -s localhost:8000/v1/models\n.venv/bin/dpserve status")]


def test_a_console_transcript_runs_its_commands_only():
    found = steps(block("$ dpserve status\nreplica  state\nr0  ready\n$ ls runs\n", "console"))
    assert found == [Step("shell", "dpserve status\nls runs")]


@pytest.mark.parametrize("text", ["python -m loadtest run --x 1 &",
                                  "sleep 100 & dpserve status",
                                  "dpserve serve --model m & sleep 1"])
def test_nothing_but_the_fleet_may_run_in_the_background(text):
    with pytest.raises(ValueError, match=r"only `dpserve serve \.\.\. &`"):
        steps(block(text))


def test_and_and_and_redirections_are_not_the_background():
    assert steps(block("mkdir -p runs && ls runs 2>&1 | tail &> x")) == [
        Step("shell", "mkdir -p runs && ls runs 2>&1 | tail &> x")]


def test_the_fleet_may_log_to_a_file():
    (fleet,) = steps(block("dpserve serve --model m > runs/serve.log 2>&1 &"))
    assert fleet == Step("fleet", "dpserve serve --model m > runs/serve.log 2>&1")
    assert fleet_log(fleet.text) == "runs/serve.log"
    assert fleet_log("dpserve serve --model m") is None


def test_the_docs_port_is_replaced_where_it_is_an_address_or_a_flag():
    text = ("curl localhost:8000/v1 --router http://127.0.0.1:8000 --port 8000 "
            "--max-tokens 8000 --num-prompts 80000 :80001")
    assert with_port(text, 41234) == (
        "curl localhost:41234/v1 --router http://127.0.0.1:41234 --port 41234 "
        "--max-tokens 8000 --num-prompts 80000 :80001")


def test_an_unplaced_doc_fails_the_walk(tmp_path: Path, monkeypatch):
    import tests.docs.walk as walk
    monkeypatch.setattr(walk, "ORDER", walk.ORDER[:-1])
    with pytest.raises(ValueError, match="must place every doc once"):
        walk.walk_blocks()


def test_every_run_block_of_the_docs_splits_into_steps():
    for b in walk_blocks():
        assert steps(b), b.where
    assert blocks  # the parser the walk shares with tests/docs/test_commands.py


def test_a_command_shown_failing_must_fail_with_its_status(tmp_path: Path):
    def run(text: str) -> subprocess.CompletedProcess[str]:
        (step,) = steps(block(text))
        return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step.text], cwd=tmp_path,
                              capture_output=True, text=True, timeout=30)
    assert run("false   # exits 1\necho after").stdout == "after\n"
    refused = run("true   # exits 1\necho after")
    assert refused.returncode == 98 and "exited 0 where the docs show 1" in refused.stderr
    assert run("(exit 3)   # exits 1").returncode == 98
    assert run("false\necho after").returncode == 1  # no comment: 0 is expected


def test_a_transcript_shows_what_its_commands_print():
    shown = shown_output(block("$ dpserve deploy x \\\n    --router y\ndeploy 1: x\n"
                               "$ dpserve status\nr0  ready\n", "console"))
    assert shown == "deploy 1: x\nr0  ready"
    assert shown_output(block("echo hi")) is None
