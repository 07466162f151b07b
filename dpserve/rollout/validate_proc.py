"""A full checkpoint's snapshot and checks, run in a child process of the router.

Taking a snapshot hashes every byte of the checkpoint and the checks read every
tensor again (NaN and infinity): seconds to minutes for a 7-70B model. In a
thread of the router they would share its GIL with the event loop that relays
every request, and each loses: measured on 2 CPU replicas under closed-loop load,
the thread took 0.02-1.6 s for the tiny model (26 ms alone) while the loop waited
on it in 5 ms slices. A child process has a GIL of its own, can be killed when the
deploy is cancelled, and leaves nothing behind in the router.

Protocol: the parent writes one JSON object on the child's stdin (`Job`), the child
answers one JSON object on stdout: `{"snapshot": PATH, "meta": {...}}` or
`{"refused": {"status", "message", "param"}}`. Anything else (a crash, a signal) is a
`ValidationCrashed` carrying the end of the child's stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpserve.checkpoint import CheckpointError, CheckpointMeta
from dpserve.rollout.snapshot import OutsideRoot, SnapshotStore
from dpserve.rollout.validate import Refused, fingerprint, refused, validate_checkpoint
from dpserve.settings import ENV_PREFIX

STDERR_TAIL = 2000
"""Characters of a crashed child's stderr kept in the error."""


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
    try:
        snapshot, meta = SnapshotStore(Path(job.store)).take(Path(job.checkpoint),
                                                              within=Path(job.within))
    except OutsideRoot as exc:
        raise refused(403, f"{exc} (set --checkpoint-root to deploy from elsewhere)"
                      ) from None
    except (CheckpointError, OSError) as exc:
        raise refused(422, str(exc)) from None
    return snapshot, validate_checkpoint(snapshot, served, meta)


async def check_in_child(job: Job, *, command: Sequence[str] = ()
                         ) -> tuple[Path, CheckpointMeta]:
    """`check_full_checkpoint(job)` in a child process (`command`, default this module
    run by the router's interpreter). Refused as the child refused; ValidationCrashed
    if it gave no answer. Cancelled: the child is killed and reaped first."""
    proc = await asyncio.create_subprocess_exec(
        *(command or (sys.executable, "-m", __name__)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=child_environment(os.environ))
    try:
        out, err = await proc.communicate(json.dumps(asdict(job)).encode())
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    try:
        answer = json.loads(out)
        if "refused" in answer:
            r = answer["refused"]
            raise Refused(int(r["status"]), str(r["message"]), param=r["param"])
        return Path(answer["snapshot"]), CheckpointMeta.from_json(answer["meta"])
    except (ValueError, KeyError, TypeError, CheckpointError):
        tail = err.decode("utf-8", "replace")[-STDERR_TAIL:].strip()
        raise ValidationCrashed(f"the checking process exited with {proc.returncode}"
                                + (f": {tail}" if tail else "")) from None


def child_environment(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The router's environment less dpserve's settings: those hold the API and admin
    keys, which a process that reads untrusted files has no use for."""
    return {k: v for k, v in environ.items() if not k.startswith(ENV_PREFIX)}


def _answer(job: dict[str, Any]) -> dict[str, Any]:
    try:
        snapshot, meta = check_full_checkpoint(Job(**job))
    except Refused as exc:
        return {"refused": {"status": exc.status, "message": exc.message,
                            "param": exc.param}}
    return {"snapshot": str(snapshot), "meta": meta.to_json()}


def main() -> None:
    answer = _answer(json.loads(sys.stdin.buffer.read()))
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
