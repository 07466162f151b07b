"""Process inspection for the no-orphan checks (Linux /proc)."""

from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def processes_in_group(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and process_alive(int(entry)):
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids
