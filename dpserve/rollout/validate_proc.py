"""A full checkpoint's snapshot and checks, run in a child process of the router.

Taking a snapshot hashes every byte of the checkpoint and the checks read every
tensor again (NaN and infinity): seconds to minutes for a 7-70B model. In a
thread of the router they would share its GIL with the event loop that relays
every request, and each loses: measured on 2 CPU replicas under closed-loop load,
the thread took 0.02-1.6 s for the tiny model (26 ms alone) while the loop waited
on it in 5 ms slices. A child process has a GIL of its own, can be killed when the
deploy is cancelled, and leaves nothing behind in the router.

Protocol: the parent writes one JSON line per check on the child's stdin (`Job`), the
child answers one JSON line on stdout: `{"snapshot": PATH, "meta": {...}}`,
`{"refused": {"status", "message", "param"}}` or `{"crashed": MESSAGE}`. A child that
ends without an answer (a signal, the OOM killer) is a `ValidationCrashed` carrying
the end of its stderr.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpserve.checkpoint import CheckpointError, CheckpointMeta
from dpserve.config.settings import without_settings
from dpserve.rollout.snapshot import OutsideRoot, SnapshotStore
from dpserve.rollout.validate import (
    Refused,
    fingerprint,
    named_as,
    refused,
    validate_checkpoint,
)

STDERR_TAIL = 2000
"""Characters of a crashed child's stderr kept in the error."""
STDERR_LINES = 50
EXIT_GRACE_S = 1.0
"""How long a child whose output ended may take to exit before it is killed."""
MAX_ANSWER_BYTES = 1024 * 1024


class ValidationCrashed(Exception):
    """The child ended without an answer."""


@dataclass(frozen=True)
class Job:
    checkpoint: str
    """The checkpoint directory (relative: to the router's working directory)."""
    within: str
    """The checkpoint root it must lie inside."""
    base: str
    """The served model's directory: the checkpoint must match it."""
    store: str
    """The snapshot store's root."""


def check_full_checkpoint(job: Job) -> tuple[Path, CheckpointMeta]:
    """Snapshot `job.checkpoint` into the store, then check the snapshot against the
    served model: what passes is what the engines will load, byte for byte. Refused
    (403 outside the root, 409 conflicting with the served model, 422 unsound)."""
    base = Path(job.base)
    if not base.is_dir():
        raise Refused(409, f"the served model {job.base} is not a local directory, so a "
                           "checkpoint cannot be checked against it")
    served = fingerprint(base)
    snapshot, meta = take_snapshot(SnapshotStore(Path(job.store)), Path(job.checkpoint),
                                   within=Path(job.within))
    with named_as(snapshot, Path(job.checkpoint)):
        return snapshot, validate_checkpoint(snapshot, served, meta)


def take_snapshot(store: SnapshotStore, ckpt_dir: Path, *,
                  within: Path) -> tuple[Path, CheckpointMeta]:
    """Copy `ckpt_dir` (inside `within`) into `store`, checking its manifest and every
    file's sha256 on the way. Refused (403 outside the root, 422 unsound) otherwise."""
    try:
        return store.take(ckpt_dir, within=within)
    except OutsideRoot as exc:
        raise refused(403, f"{exc} (set --checkpoint-root to deploy from elsewhere)"
                      ) from None
    except (CheckpointError, OSError) as exc:
        raise refused(422, str(exc)) from None


class Checker:
    """A child process that runs `check_full_checkpoint` for each job it is sent, one at
    a time. Started by `start` (or the first check) and kept: spawning it and importing
    numpy costs ~0.45 s of CPU, which on a host whose cores the engines keep busy
    stretched each deploy's checks from 0.03 to 3-13 s. A child that crashed or whose
    check was cancelled is killed and reaped, and the next check starts a new one.
    `aclose` ends it."""

    def __init__(self, *, command: Sequence[str] = ()) -> None:
        self._command = tuple(command) or (sys.executable, "-m", __name__)
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._reading: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        if self._proc is None or self._proc.returncode is not None:
            await self._reap()
            self._stderr.clear()
            self._proc = await asyncio.create_subprocess_exec(
                *self._command, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=without_settings(os.environ), limit=MAX_ANSWER_BYTES)
            self._reading = asyncio.create_task(self._keep_stderr(self._proc))

    async def check(self, job: Job) -> tuple[Path, CheckpointMeta]:
        """Refused as the child refused; ValidationCrashed if it gave no answer."""
        async with self._lock:
            await self.start()
            proc = self._proc
            assert proc is not None and proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(asdict(job)).encode() + b"\n")
                await proc.stdin.drain()
                line = await proc.stdout.readline()
            except (BrokenPipeError, ConnectionResetError):
                line = b""  # it died before reading the job: a crash, below
            except BaseException:  # cancelled: killed, and a fresh child next time
                await self._reap()
                raise
            try:
                answer = json.loads(line)
                if "refused" in answer:
                    r = answer["refused"]
                    raise Refused(int(r["status"]), str(r["message"]), param=r["param"])
                if "crashed" in answer:
                    raise ValidationCrashed(str(answer["crashed"]))
                return Path(answer["snapshot"]), CheckpointMeta.from_json(answer["meta"])
            except (ValueError, KeyError, TypeError, CheckpointError):
                await self._reap(grace_s=EXIT_GRACE_S)  # its output ended: it is exiting
                tail = "".join(self._stderr).strip()[-STDERR_TAIL:]
                raise ValidationCrashed(f"the checking process exited with {proc.returncode}"
                                        + (f": {tail}" if tail else "")) from None

    async def aclose(self) -> None:
        """End the child: at the end of its input it exits; killed if it has not in 2 s."""
        if self._proc is not None and self._proc.returncode is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        await self._reap(grace_s=2.0)

    async def _reap(self, *, grace_s: float = 0.0) -> None:
        """Kill the child unless it exits within `grace_s`, and wait for it. The grace
        keeps its own exit status: a kill would reap it first (`Popen.send_signal`
        polls), and asyncio would then report 255."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if grace_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), grace_s)
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        if self._reading is not None:
            await self._reading
            self._reading = None

    async def _keep_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            self._stderr.append(line.decode("utf-8", "replace"))


def _answer(job: dict[str, Any]) -> dict[str, Any]:
    try:
        snapshot, meta = check_full_checkpoint(Job(**job))
    except Refused as exc:
        return {"refused": {"status": exc.status, "message": exc.message,
                            "param": exc.param}}
    except Exception as exc:  # reported, and the child serves the next job
        traceback.print_exc()
        return {"crashed": f"the check crashed: {exc!r}"}
    return {"snapshot": str(snapshot), "meta": meta.to_json()}


def main() -> None:
    """One answer line on stdout per job line on stdin, until stdin ends. Anything
    else that writes to stdout (a library's print) goes to stderr instead."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    for line in sys.stdin:
        answers.write(json.dumps(_answer(json.loads(line))) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
