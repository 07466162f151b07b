"""One deploy at a time across routers: a lock file with an expiry on shared storage.

Several router pods front the same engines on Kubernetes; each can run a
deploy, and two rollouts pausing and reloading the same engines at once would
fight. Each router's `Rollout` already allows one deploy per process; this lock
extends that to every router that names the same file (`--deploy-lock`), kept
on the volume they share anyway: the checkpoint volume.

The model is a lease:

- **take**: create the file exclusively (`O_CREAT | O_EXCL`, atomic on local
  file systems and on NFSv3+), holding JSON `{holder, deploy, expires_at}`;
- **renew**: the holder rewrites `expires_at` (now + `ttl_s`) every `ttl_s / 3`
  while its deploy runs, replacing the file atomically;
- **release**: the holder deletes it when its deploy ends, however it ends;
- **take over**: a file whose `expires_at` has passed belongs to a router that
  died mid-deploy. It is renamed away (only one contender's rename succeeds)
  and the exclusive create is tried again.

It assumes the routers' wall clocks agree to well within `ttl_s` (NTP), and
that a holder which cannot renew for `ttl_s` has stopped deploying. A file
that cannot be parsed (its writer died mid-write) expires `ttl_s` after it was
last modified. Blocking file I/O: call it from a thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TAKE_OVER_TRIES = 3


class LockHeld(Exception):
    """Another router holds the lock; the message names it and until when."""


class LockLost(Exception):
    """The lock no longer names this holder (it expired and was taken over)."""


@dataclass(frozen=True)
class LockInfo:
    holder: str
    deploy: str
    expires_at: float


class DeployLock:
    def __init__(self, path: str | os.PathLike[str], *, ttl_s: float = 60.0,
                 holder: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.ttl_s = ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._clock = clock
        self._deploy: str | None = None

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    def read(self) -> LockInfo | None:
        """Who holds the lock (expired or not); None if nobody."""
        try:
            text = self.path.read_text()
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
            return LockInfo(str(data["holder"]), str(data["deploy"]), float(data["expires_at"]))
        except (ValueError, KeyError, TypeError):
            return LockInfo("unknown (unreadable lock file)", "unknown", mtime + self.ttl_s)

    def acquire(self, deploy_id: str) -> None:
        """Take the lock for `deploy_id`, or raise LockHeld."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(_TAKE_OVER_TRIES):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.read()
                if info is None:
                    continue  # released between our create and our read
                if info.expires_at > self._clock():
                    raise LockHeld(
                        f"deploy {info.deploy} holds the deploy lock {self.path} "
                        f"(router {info.holder}, for {info.expires_at - self._clock():.0f} s "
                        "more unless renewed); one deploy at a time") from None
                self._take_over()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self._content(deploy_id))
                f.flush()
                os.fsync(f.fileno())
            self._deploy = deploy_id
            return
        raise LockHeld(f"the deploy lock {self.path} is being contended; try again")

    def renew(self) -> None:
        """Push the expiry `ttl_s` ahead; LockLost if another holder has it now."""
        info = self.read()
        if self._deploy is None or info is None or info.holder != self.holder:
            raise LockLost(f"the deploy lock {self.path} is no longer held by this router")
        tmp = self.path.with_name(f"{self.path.name}.{self.holder.replace(':', '-')}.tmp")
        tmp.write_text(self._content(self._deploy))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Give the lock up if this router holds it; never removes another's."""
        info = self.read()
        if info is not None and info.holder == self.holder:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._deploy = None

    def _content(self, deploy_id: str) -> str:
        return json.dumps({"holder": self.holder, "deploy": deploy_id,
                           "expires_at": self._clock() + self.ttl_s})

    def _take_over(self) -> None:
        stale = self.path.with_name(f"{self.path.name}.stale-{secrets.token_hex(4)}")
        try:
            os.rename(self.path, stale)  # one contender wins; the others find no file
        except FileNotFoundError:
            return
        stale.unlink(missing_ok=True)
