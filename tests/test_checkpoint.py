"""The checkpoint format: complete or invisible, never overwritten, verifiable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpserve import checkpoint as ckpt


def files(**contents: str):
    def write(d: Path) -> None:
        for name, text in contents.items():
            (d / name).write_text(text)
    return write


def save(out: Path, step: int, **kw) -> Path:
    return ckpt.write_checkpoint(out, step, files(**{"config.json": "{}", "w.bin": f"w{step}"}),
                                 base_model="base", loss=1.5, world_size=2, **kw)


def test_a_saved_checkpoint_verifies_and_describes_itself(tmp_path):
    path = save(tmp_path, 120, extra={"lr": 0.1})
    assert path == tmp_path / "step-000120"
    meta = ckpt.verify_checkpoint(path)
    assert (meta.step, meta.base_model, meta.loss, meta.world_size) == (120, "base", 1.5, 2)
    assert meta.files == {"config.json": ckpt.sha256_file(path / "config.json"),
                          "w.bin": ckpt.sha256_file(path / "w.bin")}
    assert meta.extra == {"lr": 0.1}
    assert oct((path / "w.bin").stat().st_mode & 0o777) == "0o644"


def test_nothing_named_like_a_checkpoint_exists_while_files_are_written(tmp_path):
    seen = []

    def write(d: Path) -> None:
        (d / "w.bin").write_text("x")
        seen.append(sorted(p.name for p in tmp_path.iterdir()))

    ckpt.write_checkpoint(tmp_path, 1, write, base_model="b", loss=None, world_size=1)
    assert not any(name.startswith("step-") for name in seen[0])
    assert ckpt.list_checkpoints(tmp_path) == [(1, tmp_path / "step-000001")]


def test_a_checkpoint_is_never_overwritten(tmp_path):
    save(tmp_path, 5)
    with pytest.raises(ckpt.CheckpointError, match="never overwritten"):
        save(tmp_path, 5)


def test_a_failing_writer_leaves_nothing_behind(tmp_path):
    def write(d: Path) -> None:
        (d / "w.bin").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.write_checkpoint(tmp_path, 3, write, base_model="b", loss=None, world_size=1)
    assert list(tmp_path.iterdir()) == []


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from dpserve import checkpoint as ckpt

def write(d):
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    print("writing", flush=True)
    time.sleep(60)

ckpt.write_checkpoint(Path(sys.argv[1]), 7, write, base_model="b", loss=None, world_size=1)
"""


def test_a_save_killed_midway_never_looks_complete(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [p.name.startswith(".step-000007.tmp-") for p in tmp_path.iterdir()] == [True]
    assert ckpt.list_checkpoints(tmp_path) == []
    assert ckpt.latest_checkpoint(tmp_path) is None
    save(tmp_path, 8)
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000008"]


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: (p / "w.bin").write_text("tampered"), "w.bin does not match its sha256"),
    (lambda p: (p / "w.bin").unlink(), "w.bin is listed but missing"),
    (lambda p: (p / "extra.bin").write_text("?"), "extra.bin is not listed"),
    (lambda p: (p / "dpserve.json").write_text("{not json"), "cannot read dpserve.json"),
    (lambda p: (p / "dpserve.json").unlink(), "not a complete checkpoint"),
    (lambda p: (p / "dpserve.json").write_text(json.dumps({"step": 1})), "lacks 'format_version'"),
    (lambda p: p.rename(p.with_name("step-000099")), "says step 5"),
])
def test_verify_names_what_is_wrong(tmp_path, damage, message):
    path = save(tmp_path, 5)
    damage(path)
    target = path if path.exists() else tmp_path / "step-000099"
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(target)
    assert message in str(exc.value)


def test_listing_finds_complete_checkpoints_in_step_order(tmp_path):
    for step in (30, 4, 200):
        save(tmp_path, step)
    (tmp_path / "step-000050").mkdir()  # no metadata: not a checkpoint
    (tmp_path / "notes").mkdir()
    (tmp_path / "loss.csv").write_text("step\n")
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 30, 200]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000200"
    assert ckpt.list_checkpoints(tmp_path / "missing") == []


def test_resume_needs_a_complete_train_state(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    ckpt.write_train_state(tmp_path, 10, files(**{"trainer.pt": "s"}))
    (tmp_path / ckpt.STATE_DIR / "step-000020").mkdir()  # no marker: killed mid-save
    assert ckpt.train_state_dir(tmp_path, 20) is None
    assert ckpt.latest_checkpoint(tmp_path, with_train_state=True) == tmp_path / "step-000010"


def test_prune_keeps_the_newest_and_their_train_state(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step)
        ckpt.write_train_state(tmp_path, step, files(**{"trainer.pt": "s"}))
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert {p.name for p in deleted} == {"step-000001"}
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]
    assert ckpt.train_state_dir(tmp_path, 1) is None
    assert ckpt.train_state_dir(tmp_path, 3) is not None
    with pytest.raises(ValueError):
        ckpt.prune_checkpoints(tmp_path, keep_last=0)


def test_symbolic_links_are_refused(tmp_path):
    def write(d: Path) -> None:
        (d / "link").symlink_to("/etc/hostname")

    with pytest.raises(ckpt.CheckpointError, match="symbolic links"):
        ckpt.write_checkpoint(tmp_path, 1, write, base_model="b", loss=None, world_size=1)
    assert list(tmp_path.iterdir()) == []
