"""The docs' `<!-- docs: run -->` blocks, run as written (tests/docs/blocks.py says how:
a scratch directory whose `build/tiny-llama`, `.venv`, `dpserve`, `loadtest` and
`benchmarks` are the repository's, so the docs' relative paths resolve). Each command
must exit 0; a failure shows the block and the end of what it printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block, all_blocks, matches

RUN = [b for b in all_blocks() if b.kind == "run"]
BLOCK_TIMEOUT_S = 600


def scratch(tmp: Path, tiny_model: Path) -> Path:
    (tmp / "build").mkdir()
    (tmp / "build" / "tiny-llama").symlink_to(tiny_model)
    (tmp / ".venv").symlink_to(Path(sys.prefix))
    for name in ("dpserve", "loadtest", "benchmarks"):
        (tmp / name).symlink_to(ROOT / name)
    return tmp


def test_some_blocks_are_run():
    assert len(RUN) >= 4


@pytest.mark.parametrize("block", RUN, ids=lambda b: b.where)
def test_a_run_block_runs_as_written(block: Block, tiny_model: Path, tmp_path: Path):
    assert "&" not in block.script().replace("&&", ""), (
        f"{block.where}: a run block may not leave a process in the background")
    where = scratch(tmp_path, tiny_model)
    env = {**os.environ, "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.script()], cwd=where,
                          env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                          start_new_session=True)
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}:\n{block.script()}\n--- output (end) ---\n"
        f"{(done.stdout + done.stderr)[-3000:]}")
    if block.output is not None:  # what the docs say it prints
        missing = matches(block.output, done.stdout + "\n" + done.stderr)
        assert not missing, (f"{block.where}: the docs show lines it did not print:\n"
                             + "\n".join(missing) + "\n--- it printed ---\n"
                             + (done.stdout + done.stderr)[-3000:])
