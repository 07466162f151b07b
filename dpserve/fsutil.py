"""File operations that must survive a crash or a hostile neighbour.

Used by the checkpoint writer and the snapshot store: publish a directory only
once it is complete (fill a temporary sibling, fsync, rename), write a file
durably, create and remove directories so that an interrupted operation never
leaves something that looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def publish(parent: Path, final: Path, fill: Callable[[Path], None], *, replace: bool) -> None:
    """Fill a temporary directory in `parent`, make it durable and rename it to `final`;
    FileExistsError if `final` exists (unless `replace`: it is moved aside, removed after)."""
    make_dirs(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    aside = None
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; a vLLM under another user must read it
        fill(tmp)
        for directory in [*reversed(dirs_under(tmp)), tmp]:
            fsync_path(directory)
        if os.path.lexists(final):
            if not replace:  # appeared while we wrote: rename would replace an empty dir
                raise FileExistsError(errno.EEXIST, "already exists", str(final))
            aside = parent / f".{final.name}.tmp-old-{secrets.token_hex(4)}"
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def write_durably(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    path.chmod(0o644)  # O_CREAT's mode is filtered by the umask


def make_dirs(path: Path) -> None:
    """mkdir -p, with the directories it creates world-readable and durable."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        directory.chmod(0o755)
        fsync_path(directory.parent)


def remove_dir(path: Path) -> None:
    """Rename to a temporary name (atomic: it stops counting), then delete."""
    aside = path.with_name(f".{path.name}.tmp-del-{secrets.token_hex(4)}")
    os.rename(path, aside)
    fsync_path(path.parent)
    shutil.rmtree(aside)


def children(root: Path) -> list[Path]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(root.iterdir())
    return []


def is_real_dir(path: Path) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISDIR(path.lstat().st_mode)
    return False


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dirs_under(root: Path) -> list[Path]:
    """Every directory below `root` (not following links), deepest last."""
    return sorted(p for p in root.rglob("*") if stat.S_ISDIR(p.lstat().st_mode))
