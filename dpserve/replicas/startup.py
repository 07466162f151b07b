"""What a replica's engine is doing while it starts, in dpserve's words, from its log.

vLLM's start-up output is long and reads alarmingly to a new user ("Triton is installed,
but doesn't include CPU backend", deprecation warnings, "Compiling model again due to a
load failure"): lines that are normal. `startup_phase` names the furthest milestone the
engine's latest launch reached instead, and the supervisor's "still starting" note says
that and where the full log is. The milestones are vLLM 0.32's own log lines; one it no
longer prints leaves the phase at the one before (never a wrong later one).
"""

from __future__ import annotations

import os
from pathlib import Path

OUR_HEADER = "===== dpserve:"
"""How the supervisor marks each launch in a replica's log."""

PHASES: tuple[tuple[str, str], ...] = (
    ("non-default args:", "reading the model's configuration"),
    ("Initializing a V1 LLM engine", "starting the engine process"),
    ("Starting to load model", "loading the weights"),
    ("Loading weights took", "measuring memory and sizing the KV cache"),
    ("Starting torch.compile", "compiling the model (minutes on a first start; cached "
                               "after)"),
    ("Capturing CUDA graphs", "capturing CUDA graphs"),
    ("init engine (profile, create kv cache, warmup model) took",
     "starting the API server"),
    ("Starting vLLM server on", "the API server is up; waiting for /health to pass"),
)
"""(a line's marker, the phase it begins), in the order a start goes through them."""
FIRST_PHASE = "starting Python and importing vLLM"


def startup_phase(log_text: str) -> str:
    """The phase of the latest launch in a replica's log text: the last milestone
    whose marker appears after the last launch header."""
    start = log_text.rfind(OUR_HEADER)
    text = log_text if start < 0 else log_text[start:]
    phase, at = FIRST_PHASE, -1
    for marker, name in PHASES:
        found = text.rfind(marker)
        if found > at:
            phase, at = name, found
    return phase


def read_phase(path: Path) -> str:
    """`startup_phase` of the log at `path` (its last 256 KiB); the first phase when
    there is none yet."""
    try:
        return startup_phase(log_end(path, 256 * 1024))
    except OSError:
        return FIRST_PHASE


def log_end(path: Path, size: int = 64 * 1024) -> str:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - size))
        return f.read().decode("utf-8", "replace")
