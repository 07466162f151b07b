"""The snapshot store: the engines load exactly the bytes that were validated.

A checkpoint lives where others can write: the fine-tune job writes it, and on a
shared volume every pod may run as the same user. Hashing it, then telling the
engines to read its path, leaves a window in which the files can change (and a
restarted engine reads the path again, much later). So a deploy first copies the
checkpoint into a store that only the router writes, checking every file's
sha256 against the checkpoint's `dpserve.json` on the bytes it writes; every
later check (shapes, tokenizer, finiteness) and every load reads that copy.

Reading the source is defensive: the directory must resolve inside the
checkpoint root; it is then opened component by component without following
symbolic links, so a path swapped after the check cannot lead elsewhere; files
are opened without following links or blocking on FIFOs, and must be regular.

Layout::

    STORE/step-000120-3f2a9c1b4d5e6f70/    a snapshot: files 0444, directories 0555,
                                           named by the step and the manifest's sha256
    STORE/.step-000120-....tmp-XXXX/       a copy in progress (renamed when complete)

A complete snapshot of the same manifest is reused, not copied again. Where the
filesystem can (XFS, btrfs), a file is cloned (FICLONE) rather than copied: the
clone shares no future writes with its source, and is still hashed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from dpserve.checkpoint import (
    META_FILE,
    CheckpointError,
    CheckpointMeta,
    open_regular,
    parse_meta,
    read_meta_bytes,
    step_name,
)
from dpserve.fsutil import children, fsync_path

FICLONE = 0x40049409
"""ioctl(2) request that makes a file share another's blocks, copy-on-write (Linux)."""
_CHUNK = 8 * 1024 * 1024
MAX_ENTRIES = 10_000
"""A checkpoint holds tens of files; more than this is refused before any copy."""
MAX_DEPTH = 8
STALE_TMP_S = 3600.0
"""A copy in progress older than this was abandoned (its router died): prune removes it."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class OutsideRoot(CheckpointError):
    """The checkpoint path does not resolve inside the checkpoint root."""


class SnapshotStore:
    """Snapshots of deployed checkpoints under `root` (created if missing)."""

    def __init__(self, root: Path, *, keep: int = 1) -> None:
        self.root = Path(root)
        self.keep = keep
        """Newest snapshots kept by `prune` besides those named in use."""

    def take(self, ckpt_dir: Path, *, within: Path) -> tuple[Path, CheckpointMeta]:
        """Snapshot `ckpt_dir`, which must lie inside `within`; return the snapshot's
        path and metadata. OutsideRoot, or CheckpointError naming the file at fault."""
        resolved = Path(os.path.realpath(ckpt_dir))
        root = Path(os.path.realpath(within))
        if resolved == root or not resolved.is_relative_to(root):
            raise OutsideRoot(f"{ckpt_dir} is not inside the checkpoint root {root}")
        src = open_dir_under(root, resolved.relative_to(root).parts, where=resolved)
        try:
            raw = read_meta_bytes(resolved, dir_fd=src)
            meta = parse_meta(raw, resolved)
            if resolved.name != step_name(meta.step):
                raise CheckpointError(f"{resolved}: {META_FILE} says step {meta.step}, so the "
                                      f"directory should be named {step_name(meta.step)}")
            name = f"{step_name(meta.step)}-{hashlib.sha256(raw).hexdigest()[:16]}"
            final = self.root / name
            if final.is_dir() and not final.is_symlink():
                return final, meta  # the same manifest, copied and checked before
            files = _listing(src, resolved)
            for missing in sorted(set(meta.files) - files):
                raise CheckpointError(f"{resolved}: {missing} is listed but missing")
            for extra in sorted(files - set(meta.files) - {META_FILE}):
                raise CheckpointError(f"{resolved}: {extra} is not listed in {META_FILE}")
            self._copy(src, resolved, meta, raw, final)
        finally:
            os.close(src)
        return final, meta

    def prune(self, in_use: Collection[str | Path]) -> list[Path]:
        """Delete snapshots that are neither in `in_use` (paths; a symlink is followed)
        nor among the `keep` newest, and copies abandoned for an hour. Returns them."""
        keep = {os.path.realpath(p) for p in in_use}
        snapshots, stale = [], []
        now = time.time()
        for entry in children(self.root):
            info = entry.lstat()
            if not stat.S_ISDIR(info.st_mode):
                continue
            if entry.name.startswith("."):
                if now - info.st_mtime > STALE_TMP_S:
                    stale.append(entry)
            else:
                snapshots.append((info.st_mtime, entry))
        snapshots.sort(reverse=True)
        doomed = [p for i, (_, p) in enumerate(snapshots)
                  if i >= self.keep and os.path.realpath(p) not in keep]
        for path in doomed + stale:
            _remove_tree(path)
        return doomed + stale

    def _copy(self, src: int, where: Path, meta: CheckpointMeta, raw: bytes,
              final: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=self.root))
        try:
            for rel, digest in sorted(meta.files.items()):
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if _copy_file(src, rel, dest, where=where) != digest:
                    raise CheckpointError(f"{where}: {rel} does not match its sha256 in "
                                          f"{META_FILE} (changed while it was copied?)")
            (tmp / META_FILE).write_bytes(raw)
            _seal(tmp)
            os.rename(tmp, final)
            fsync_path(self.root)
        except BaseException:
            _remove_tree(tmp)
            raise


def open_dir_under(root: Path, parts: tuple[str, ...], *, where: Path) -> int:
    """A descriptor of `root/parts...`, reached without following any symbolic link below
    `root`: a component swapped for a link since the path was resolved is refused."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise CheckpointError(f"{where}: not a plain directory ({part} changed "
                                          "or is not a directory)") from None
                if exc.errno == errno.ENOENT:
                    raise CheckpointError(f"{where}: no such directory on the router's "
                                          "machine") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _listing(dir_fd: int, where: Path) -> set[str]:
    """Relative paths of every file under `dir_fd`; CheckpointError for a symbolic link,
    special file, too deep a tree or too many entries."""
    found: set[str] = set()
    for rel in _walk(dir_fd, "", where, depth=0, seen=[0]):
        found.add(rel)
    return found


def _walk(dir_fd: int, prefix: str, where: Path, *, depth: int, seen: list[int]
          ) -> Iterator[str]:
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{where}: directories nested deeper than {MAX_DEPTH}")
    with os.scandir(dir_fd) as entries:
        listed = list(entries)
    for entry in listed:
        seen[0] += 1
        if seen[0] > MAX_ENTRIES:
            raise CheckpointError(f"{where}: more than {MAX_ENTRIES} entries")
        rel = prefix + entry.name
        if entry.is_symlink():
            raise CheckpointError(f"{where / rel}: symbolic links are not allowed in a "
                                  "checkpoint")
        if entry.is_dir(follow_symlinks=False):
            child = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from _walk(child, rel + "/", where, depth=depth + 1, seen=seen)
            finally:
                os.close(child)
        elif entry.is_file(follow_symlinks=False):
            yield rel
        else:
            raise CheckpointError(f"{where / rel}: only regular files belong in a checkpoint")


def _copy_file(src_dir: int, rel: str, dest: Path, *, where: Path) -> str:
    """Copy (or clone) `rel` under `src_dir` to `dest`; the sha256 of what `dest` holds."""
    *dirs, name = rel.split("/")
    parent = os.dup(src_dir)
    try:
        for part in dirs:
            child = os.open(part, _DIR_FLAGS, dir_fd=parent)
            os.close(parent)
            parent = child
        src = open_regular(Path(name), dir_fd=parent)
    except OSError as exc:
        raise CheckpointError(f"{where / rel}: cannot open: {exc.strerror}") from None
    finally:
        os.close(parent)
    digest = hashlib.sha256()
    try:
        out = os.open(dest, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if _clone(out, src):
                os.lseek(out, 0, os.SEEK_SET)
                while chunk := os.read(out, _CHUNK):
                    digest.update(chunk)
            else:
                while chunk := os.read(src, _CHUNK):
                    digest.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view):]
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(src)
    return digest.hexdigest()


def _clone(out: int, src: int) -> bool:
    try:
        fcntl.ioctl(out, FICLONE, src)
    except OSError:
        return False  # not supported here (ext4, tmpfs, across filesystems): copy
    return True


def _seal(root: Path) -> None:
    """Files 0444 and directories 0555, bottom-up, each directory fsynced."""
    dirs = [root]
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            dirs.append(path)
        else:
            path.chmod(0o444)
    for directory in reversed(dirs):
        fsync_path(directory)
        directory.chmod(0o555)


def _remove_tree(path: Path) -> None:
    """rmtree for a sealed tree: give directories their write bit back first."""
    with contextlib.suppress(FileNotFoundError):
        for directory in [path, *(p for p in path.rglob("*") if p.is_dir()
                                  and not p.is_symlink())]:
            with contextlib.suppress(OSError):
                directory.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)
