"""The checkpoint format: complete or invisible, never overwritten, verifiable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from dpserve import checkpoint as ckpt
from tests.waiting import wait_for_sync

REPO = Path(__file__).resolve().parents[1]


def files(**contents: str) -> Callable[[Path], None]:
    """A write_files callback; `sub__name` writes `sub/name`."""
    def write(d: Path) -> None:
        for name, text in contents.items():
            path = d.joinpath(*name.split("__"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return write


def save(out: Path, step: int, **kw: object) -> Path:
    return ckpt.write_checkpoint(out, step, files(**{"config.json": "{}", "w.bin": f"w{step}"}),
                                 base_model="base", loss=1.5, world_size=2, **kw)  # type: ignore[arg-type]


def save_state(out: Path, step: int) -> Path:
    return ckpt.write_train_state(out, step, files(**{"trainer.pt": f"s{step}"}))


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# -- writing -------------------------------------------------------------------------------


def test_step_names_have_six_digits_and_grow_past_a_million():
    assert ckpt.step_name(120) == "step-000120"
    assert ckpt.step_name(1_234_567) == "step-1234567"
    with pytest.raises(ValueError):
        ckpt.step_name(-1)


def test_a_saved_checkpoint_verifies_and_describes_itself(tmp_path):
    out = tmp_path / "out"
    path = ckpt.write_checkpoint(
        out, 120, files(**{"config.json": "{}", "tok__vocab.txt": "a b", "w.bin": "w"}),
        base_model="org/base", loss=1.5, world_size=2, extra={"lr": 0.1, "tokens": 42})
    assert path == out / "step-000120"
    meta = ckpt.verify_checkpoint(path)
    assert meta == ckpt.read_meta(path)
    assert (meta.format_version, meta.step, meta.base_model, meta.loss, meta.world_size) == (
        ckpt.FORMAT_VERSION, 120, "org/base", 1.5, 2)
    assert meta.files == {rel: ckpt.sha256_file(path / rel)
                          for rel in ("config.json", "tok/vocab.txt", "w.bin")}
    assert meta.extra == {"lr": 0.1, "tokens": 42}
    created = datetime.fromisoformat(meta.created_at)
    assert created.utcoffset() is not None and created.utcoffset().total_seconds() == 0
    assert abs((datetime.now(UTC) - created).total_seconds()) < 60
    assert ckpt.CheckpointMeta.from_json(meta.to_json()) == meta
    assert names(out) == ["step-000120"]  # no temporary directory left


def test_checkpoint_files_are_world_readable_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        path = ckpt.write_checkpoint(tmp_path / "new" / "out", 1,
                                     files(**{"w.bin": "w", "tok__vocab.txt": "v"}),
                                     base_model="b", loss=None, world_size=1)
        state = save_state(tmp_path / "new" / "out", 1)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in [path, state, *path.rglob("*"), *state.rglob("*"),
                       tmp_path / "new", tmp_path / "new" / "out"]}
    assert {rel: oct(m) for rel, m in modes.items() if m not in (0o644, 0o755)} == {}
    assert modes["new/out/step-000001/w.bin"] == 0o644
    assert modes["new/out/step-000001/tok"] == 0o755


def test_nothing_named_like_a_checkpoint_exists_while_files_are_written(tmp_path):
    seen = []

    def write(d: Path) -> None:
        (d / "w.bin").write_text("x")
        seen.append((names(tmp_path), names(d)))

    ckpt.write_checkpoint(tmp_path, 1, write, base_model="b", loss=None, world_size=1)
    (outside, inside), = seen
    assert not any(name.startswith("step-") for name in outside)
    assert [n.startswith(".step-000001.tmp-") for n in outside] == [True]
    assert inside == ["w.bin"]  # no dpserve.json yet
    assert ckpt.list_checkpoints(tmp_path) == [(1, tmp_path / "step-000001")]


def test_metadata_is_written_after_every_file_is_fsynced_and_the_rename_is_made_durable(
        tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ckpt.write_checkpoint(tmp_path, 1, files(**{"config.json": "{}", "sub__w.bin": "w"}),
                          base_model="b", loss=None, world_size=1)
    *in_tmp, last = synced
    assert last == str(tmp_path)  # the rename itself is durable
    tmp = Path(in_tmp[0]).parent
    assert tmp.name.startswith(".step-000001.tmp-")
    order = [Path(p).relative_to(tmp).as_posix() for p in in_tmp]
    meta_at = order.index("dpserve.json")
    assert set(order[:meta_at]) == {"config.json", "sub/w.bin"}
    assert set(order[meta_at + 1:]) == {"sub", "."}  # directories last, the temp dir itself too


def test_a_checkpoint_is_never_overwritten(tmp_path):
    save(tmp_path, 5)
    before = ckpt.read_meta(tmp_path / "step-000005")
    (tmp_path / "step-000006").mkdir()  # even an empty directory of that name is kept
    called = []
    for step in (5, 6):
        with pytest.raises(ckpt.CheckpointError, match=f"step-00000{step} already exists"):
            ckpt.write_checkpoint(tmp_path, step, called.append, base_model="b", loss=None,
                                  world_size=1)
    assert called == []  # refused before the (long) write
    assert ckpt.read_meta(tmp_path / "step-000005") == before
    assert names(tmp_path) == ["step-000005", "step-000006"]


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failing_writer_leaves_nothing_behind(tmp_path, error):
    def write(d: Path) -> None:
        (d / "sub").mkdir()
        (d / "sub" / "w.bin").write_text("partial")
        raise error

    with pytest.raises(type(error)):
        ckpt.write_checkpoint(tmp_path, 3, write, base_model="b", loss=None, world_size=1)
    assert names(tmp_path) == []


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: (d / "link").symlink_to("/etc/hostname"), "symbolic links are not allowed"),
    (lambda d: os.mkfifo(d / "pipe"), "only regular files"),
    (lambda d: (d / "dpserve.json").write_text("{}"), "must not create dpserve.json"),
])
def test_what_a_checkpoint_cannot_hold_is_refused(tmp_path, make, message):
    with pytest.raises(ckpt.CheckpointError, match=message):
        ckpt.write_checkpoint(tmp_path, 1, make, base_model="b", loss=None, world_size=1)
    assert names(tmp_path) == []


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    called = []
    with pytest.raises(ValueError, match="JSON-serialisable"):
        ckpt.write_checkpoint(tmp_path, 1, called.append, base_model="b", loss=None,
                              world_size=1, extra={"when": datetime.now(UTC)})
    with pytest.raises(ValueError, match="world_size"):
        ckpt.write_checkpoint(tmp_path, 1, called.append, base_model="b", loss=None,
                              world_size=0)
    assert called == []


# A writer that stops at a given stage of the save and waits there to be killed.
_KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from dpserve import checkpoint as ckpt

out, ready, stage = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def stall(*args):
    ready.write_text(stage)
    time.sleep(600)

def write(d):
    (d / "model.safetensors").write_bytes(b"x" * 100_000)
    if stage == "writing files":
        stall()

if stage == "about to rename":
    os.rename = stall
ckpt.write_checkpoint(out, 7, write, base_model="b", loss=None, world_size=1)
"""


@pytest.mark.parametrize("stage", ["writing files", "about to rename"])
def test_a_save_killed_midway_never_looks_complete(tmp_path, stage):
    out, ready = tmp_path / "out", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out), str(ready), stage],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        def stalled() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            return ready.exists()

        wait_for_sync(stalled, f"the writer to stall while {stage}")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    leftover, = out.iterdir()
    assert leftover.name.startswith(".step-000007.tmp-")
    assert (leftover / "dpserve.json").exists() == (stage == "about to rename")
    assert ckpt.list_checkpoints(out) == []
    assert ckpt.latest_checkpoint(out) is None
    save(out, 8)
    assert ckpt.prune_checkpoints(out, keep_last=1) == [leftover]
    assert names(out) == ["step-000008"]


# -- verifying -----------------------------------------------------------------------------


def _meta_with(**fields: object) -> Callable[[Path], None]:
    def rewrite(p: Path) -> None:
        data = json.loads((p / "dpserve.json").read_text())
        (p / "dpserve.json").write_text(json.dumps({**data, **fields}))
    return rewrite


@pytest.mark.parametrize(("damage", "message"), [
    (lambda p: (p / "w.bin").write_text("w6"), "w.bin does not match its sha256"),
    (lambda p: (p / "w.bin").unlink(), "w.bin is listed but missing"),
    (lambda p: (p / "extra.bin").write_text("?"), "extra.bin is not listed"),
    (lambda p: (p / "tok").mkdir() or (p / "tok" / "x").write_text("?"),
     "tok/x is not listed"),
    (lambda p: (p / "link").symlink_to(p / "w.bin"), "link: symbolic links"),
    (lambda p: (p / "dpserve.json").write_text("{not json"), "cannot read dpserve.json"),
    (lambda p: (p / "dpserve.json").unlink(), "no dpserve.json, so not a complete checkpoint"),
    (lambda p: (p / "dpserve.json").write_text("[]"), "must hold a JSON object"),
    (lambda p: (p / "dpserve.json").write_text(json.dumps({"step": 5})),
     "lacks 'format_version'"),
    (_meta_with(format_version=2), "field 'format_version' is 2"),
    (_meta_with(step="5"), "field 'step' has the wrong type"),
    (_meta_with(world_size=True), "field 'world_size' has the wrong type"),
    (_meta_with(loss="low"), "field 'loss' has the wrong type"),
    (_meta_with(created_at="yesterday"), "field 'created_at' is not ISO 8601"),
    (_meta_with(files={"../w.bin": "0" * 64}), "field 'files' lists a bad path '../w.bin'"),
    (_meta_with(files={"w.bin": "abc"}), "field 'files' has a bad sha256 for w.bin"),
    (_meta_with(step=6), "says step 6, so the directory should be named step-000006"),
])
def test_verify_names_what_is_wrong(tmp_path, damage, message):
    path = save(tmp_path, 5)
    damage(path)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(path)
    assert str(path) in str(exc.value)
    assert message in str(exc.value)


def test_a_checkpoint_copied_under_another_steps_name_does_not_verify(tmp_path):
    path = save(tmp_path, 5)
    copy = path.rename(tmp_path / "step-000009")
    with pytest.raises(ckpt.CheckpointError, match="says step 5"):
        ckpt.verify_checkpoint(copy)
    assert ckpt.list_checkpoints(tmp_path) == []


def test_metadata_loss_may_be_an_integer_or_absent(tmp_path):
    path = ckpt.write_checkpoint(tmp_path, 1, files(w="w"), base_model="b", loss=2,
                                 world_size=1)
    assert ckpt.read_meta(path).loss == 2.0 and isinstance(ckpt.read_meta(path).loss, float)
    path = ckpt.write_checkpoint(tmp_path, 2, files(w="w"), base_model="b", loss=None,
                                 world_size=1)
    assert ckpt.read_meta(path).loss is None


# -- listing -------------------------------------------------------------------------------


def test_listing_finds_complete_checkpoints_in_step_order(tmp_path):
    for step in (30, 4, 1_000_000, 200):
        save(tmp_path, step)
    (tmp_path / "step-000050").mkdir()  # no metadata: not a checkpoint
    (tmp_path / ".step-000060.tmp-abc").mkdir()  # a save in progress
    (tmp_path / "step-000070").write_text("a file")
    (tmp_path / "step-0000030").symlink_to(tmp_path / "step-000030")
    (tmp_path / "step-000080").symlink_to(tmp_path / "step-000200")
    (tmp_path / "notes").mkdir()
    (tmp_path / "loss.csv").write_text("step\n")
    assert ckpt.list_checkpoints(tmp_path) == [
        (s, tmp_path / ckpt.step_name(s)) for s in (4, 30, 200, 1_000_000)]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-1000000"


def test_an_empty_or_missing_output_has_no_checkpoints(tmp_path):
    assert ckpt.list_checkpoints(tmp_path) == []
    assert ckpt.list_checkpoints(tmp_path / "missing") == []
    assert ckpt.latest_checkpoint(tmp_path / "missing", with_train_state=True) is None


def test_listing_does_not_hash(tmp_path, monkeypatch):
    save(tmp_path, 1)
    (tmp_path / "step-000001" / "w.bin").write_text("tampered")
    monkeypatch.setattr(ckpt, "sha256_file", None)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]


# -- training state ------------------------------------------------------------------------


def test_resume_needs_a_complete_train_state(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    state = save_state(tmp_path, 10)
    assert state == tmp_path / ckpt.STATE_DIR / "step-000010"
    assert (state / "trainer.pt").read_text() == "s10"
    assert ckpt.train_state_dir(tmp_path, 10) == state
    (tmp_path / ckpt.STATE_DIR / "step-000020").mkdir()  # no marker: not a saved state
    (tmp_path / ckpt.STATE_DIR / "step-000020" / "trainer.pt").write_text("half")
    assert ckpt.train_state_dir(tmp_path, 20) is None
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000020"
    assert ckpt.latest_checkpoint(tmp_path, with_train_state=True) == tmp_path / "step-000010"


def test_a_train_state_saved_again_replaces_the_old_one_whole(tmp_path):
    save_state(tmp_path, 3)
    ckpt.write_train_state(tmp_path, 3, files(**{"other.pt": "new"}))
    state = ckpt.train_state_dir(tmp_path, 3)
    assert state is not None
    assert names(state) == ["complete", "other.pt"]
    assert names(tmp_path / ckpt.STATE_DIR) == ["step-000003"]


def test_a_train_state_replacement_killed_midway_never_looks_complete_but_half(tmp_path,
                                                                             monkeypatch):
    save_state(tmp_path, 3)

    def killed(path: Path, *args: object, **kw: object) -> None:
        (Path(path) / "trainer.pt").unlink(missing_ok=True)  # got this far
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.write_train_state(tmp_path, 3, files(**{"trainer.pt": "new"}))
    state = ckpt.train_state_dir(tmp_path, 3)
    assert state is None or (state / "trainer.pt").read_text() == "new"


def test_a_failing_train_state_writer_leaves_nothing_behind(tmp_path):
    def write(d: Path) -> None:
        (d / "trainer.pt").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.write_train_state(tmp_path, 3, write)
    assert names(tmp_path / ckpt.STATE_DIR) == []
    assert ckpt.train_state_dir(tmp_path, 3) is None


# -- pruning -------------------------------------------------------------------------------


def test_prune_keeps_the_newest_and_their_train_state(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step)
        save_state(tmp_path, step)
    save_state(tmp_path, 5)  # a state whose checkpoint is not published (yet)
    (tmp_path / "loss.csv").write_text("step\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "step-000000").mkdir()  # not a checkpoint, but not ours to delete either
    deleted = ckpt.prune_checkpoints(tmp_path, keep_last=2)
    state = tmp_path / ckpt.STATE_DIR
    assert sorted(deleted) == sorted([tmp_path / "step-000001", tmp_path / "step-000002",
                                      state / "step-000001", state / "step-000002"])
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [3, 4]
    assert names(state) == ["step-000003", "step-000004", "step-000005"]
    assert names(tmp_path) == ["loss.csv", "notes", "step-000000", "step-000003",
                               "step-000004", "train-state"]
    assert ckpt.prune_checkpoints(tmp_path, keep_last=2) == []


def test_prune_removes_train_states_orphaned_by_an_interrupted_save(tmp_path):
    save_state(tmp_path, 1)  # killed before its checkpoint was published
    save(tmp_path, 2)
    save_state(tmp_path, 2)
    assert ckpt.prune_checkpoints(tmp_path, keep_last=5) == [
        tmp_path / ckpt.STATE_DIR / "step-000001"]


def test_prune_removes_leftover_temporary_directories_everywhere(tmp_path):
    save(tmp_path, 1)
    leftovers = [tmp_path / ".step-000002.tmp-k1", tmp_path / ckpt.STATE_DIR / ".step-000002.tmp-x"]
    for d in leftovers:
        d.mkdir(parents=True)
        (d / "w.bin").write_text("half")
    (tmp_path / ".stepfile.tmp-1").mkdir()  # not our naming scheme
    assert sorted(ckpt.prune_checkpoints(tmp_path, keep_last=1)) == sorted(leftovers)
    assert names(tmp_path) == [".stepfile.tmp-1", "step-000001", "train-state"]


def test_a_prune_interrupted_midway_never_leaves_a_half_deleted_checkpoint(tmp_path,
                                                                         monkeypatch):
    save(tmp_path, 1)
    save(tmp_path, 2)
    real_rmtree = shutil.rmtree

    def killed(path: Path, *args: object, **kw: object) -> None:
        (Path(path) / "w.bin").unlink()  # got this far
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    ckpt.prune_checkpoints(tmp_path, keep_last=1)
    assert names(tmp_path) == ["step-000002"]


def test_prune_keeps_at_least_one(tmp_path):
    save(tmp_path, 1)
    for keep in (0, -1):
        with pytest.raises(ValueError, match="keep_last"):
            ckpt.prune_checkpoints(tmp_path, keep_last=keep)
    assert ckpt.prune_checkpoints(tmp_path, keep_last=1) == []
    assert ckpt.prune_checkpoints(tmp_path / "missing", keep_last=1) == []


def test_the_base_fingerprint_follows_the_bytes_not_the_path(tiny_model, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)
    assert ckpt.base_fingerprint(copy) == ckpt.base_fingerprint(str(tiny_model))
    weights_file = copy / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights_file.write_bytes(bytes(data))
    assert ckpt.base_fingerprint(copy) != ckpt.base_fingerprint(tiny_model)
    assert ckpt.base_fingerprint("org/model") != ckpt.base_fingerprint("org/other")


def test_a_checkpoints_manifest_gives_its_fingerprint_without_reading_the_weights(
        tiny_model, tmp_path, monkeypatch):
    def copy_model(tmp: Path) -> None:
        shutil.copytree(tiny_model, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".*"))
        (tmp / "shards").mkdir()  # not directly in the directory: not part of it
        (tmp / "shards" / "extra.safetensors").write_bytes(b"x")
        (tmp / "b-second.safetensors").write_bytes(b"second shard")

    out = ckpt.write_checkpoint(tmp_path, 3, copy_model, base_model=str(tiny_model),
                                loss=None, world_size=1)
    meta = ckpt.read_meta(out)
    read = ckpt.base_fingerprint(out)
    assert read != ckpt.base_fingerprint(tiny_model)  # the second shard counts
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: pytest.fail(f"read {path}"))
    assert ckpt.fingerprint_of(meta.files) == read
    without_config = {k: v for k, v in meta.files.items() if k != "config.json"}
    assert ckpt.fingerprint_of(without_config) != read
