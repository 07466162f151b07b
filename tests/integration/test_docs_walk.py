"""The docs walked as a new user walks them: every `<!-- docs: run -->` block, README
first, each doc in its order, in one directory, with one fleet of real vLLM replicas
(how: tests/docs/walk.py). Each command must exit 0 (or the status its `# exits N`
comment shows), and what a block is shown to print (its `<!-- docs: output -->`, or a
console transcript's output lines) must be printed, numbers, digests and `…` free.
The walk stops at the first block that fails, naming it: what follows may depend on
it. With DPSERVE_DOCS_WALK_OUTPUT=DIR, what each block printed is kept there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpserve.demo import wait_ready
from dpserve.replicas.launcher import free_port
from tests.docs.blocks import Block, matches
from tests.docs.walk import Step, fleet_log, shown_output, steps, walk_blocks, with_port
from tests.integration.conftest import READY_DEADLINE_S, offline_env
from tests.procs import processes_in_group
from tests.waiting import wait_for_sync

WALK_BUDGET_S = 2400.0
"""The whole walk: measured 15 min on the 2-core CI machine, busy."""
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(WALK_BUDGET_S + 300)]
RECORD = "DPSERVE_DOCS_WALK_OUTPUT"
"""A directory to write what each block printed to (`README.md-85.txt`), if set."""
ROOT = Path(__file__).resolve().parents[2]


class Fleet:
    """The walk's `dpserve serve`, started by the first block that shows it."""

    def __init__(self, command: str, where: Path, env: dict[str, str], port: int) -> None:
        self.command = command
        shown = fleet_log(command)
        self.log_path = where / shown if shown else where.parent / "walk-serve.log"
        with (where.parent / "walk-serve.log").open("ab") as log:
            self.proc = subprocess.Popen(  # its own group: every process it starts is in it
                ["bash", "-c", f"exec {with_port(command, port)}"], cwd=where, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(f"http://127.0.0.1:{port}", self.proc, READY_DEADLINE_S)
        except BaseException:
            self.stop()
            raise RuntimeError(f"the walk's fleet did not start:\n{self.log()}") from None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-5000:]
        except FileNotFoundError:
            return f"(no {self.log_path})"

    def stop(self) -> list[int]:
        """SIGTERM, as a reader's ctrl+c; the processes of its group still alive after."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return [self.proc.pid]
        try:
            wait_for_sync(lambda: not processes_in_group(self.proc.pid),
                          "every process of the fleet to exit", within_s=30)
        except AssertionError:
            left = processes_in_group(self.proc.pid)
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            return left
        return []


def scratch(tmp: Path, tiny_model: Path) -> Path:
    """The reader's checkout: what `make install` and `make model` made (so `make demo`
    finds both done), and the code."""
    where = tmp / "walk"
    (where / "build").mkdir(parents=True)
    (where / "build" / "tiny-llama").symlink_to(tiny_model)
    (where / ".venv").symlink_to(Path(sys.prefix))
    for name in ("dpserve", "loadtest", "benchmarks", "Makefile", "pyproject.toml", "scripts"):
        (where / name).symlink_to(ROOT / name)
    return where


def run_step(step: Step, block: Block, where: Path, env: dict[str, str], port: int,
             deadline: float) -> str:
    """Run a block's commands; past the walk's deadline they are killed, naming it."""
    script = with_port(step.text, port)
    started = time.monotonic()
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=where,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - started))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{block.where} was still running {time.monotonic() - started:.0f} s "
                    f"later, past the walk's {WALK_BUDGET_S:.0f} s: killed\n{script}\n"
                    f"--- output (end) ---\n{(stdout + stderr)[-3000:]}")
    printed = stdout + "\n" + stderr
    assert proc.returncode == 0, (
        f"{block.where} exited {proc.returncode} after {time.monotonic() - started:.0f} s:"
        f"\n{script}\n--- output (end) ---\n{printed[-3000:]}")
    return printed


def test_the_docs_walked_in_order_in_one_directory_with_one_fleet(tiny_model: Path,
                                                                   tmp_path: Path):
    deadline = time.monotonic() + WALK_BUDGET_S
    where = scratch(tmp_path, tiny_model)
    port = free_port()
    env = {**offline_env(), "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "DPSERVE_PORT": str(port), "DPSERVE_ROUTER_URL": f"http://127.0.0.1:{port}"}
    fleet: Fleet | None = None
    walked: list[str] = []
    record = Path(os.environ[RECORD]) if os.environ.get(RECORD) else None
    if record is not None:
        record.mkdir(parents=True, exist_ok=True)
    try:
        for block in walk_blocks():
            printed = ""
            for step in steps(block):
                if step.kind == "shell":
                    printed += run_step(step, block, where, env, port, deadline)
                elif fleet is None:
                    fleet = Fleet(step.text, where, env, port)
                else:
                    assert step.text == fleet.command, (
                        f"{block.where} starts another fleet than the walk's: the port is "
                        f"taken.\n  running: {fleet.command}\n  shown:   {step.text}")
            if record is not None:  # to paste into the docs, re-recording them
                (record / f"{block.doc.replace('/', '_')}-{block.line}.txt").write_text(printed)
            shown = shown_output(block)
            if shown is not None:
                missing = matches(shown, printed)
                assert not missing, (f"{block.where}: the docs show lines it did not print:\n"
                                     + "\n".join(missing) + "\n--- it printed ---\n"
                                     + printed[-3000:])
            walked.append(block.where)
    finally:
        left = fleet.stop() if fleet is not None else []
    assert len(walked) >= 8, walked
    assert not left, f"processes of the walk's fleet left running: {left}\n{fleet and fleet.log()}"
