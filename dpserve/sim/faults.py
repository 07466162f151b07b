"""Ways a simulated replica can misbehave, for testing what a router does about it.

Set one at runtime with `Fleet.set_fault(i, Fault(...))` (or, when the control
endpoint is on, `PUT /sim/fault` with the same fields as JSON); clear it with
`Fleet.clear_fault(i)` (`DELETE /sim/fault`). A fault applies to requests from
the moment it is set; requests already hanging stay hung until the replica stops.

=========  ==========================================================================
mode       what the generation endpoints (`/v1/completions`, `/v1/chat/completions`) do
=========  ==========================================================================
none       serve normally (use with `health_status` for a replica that only fails
           its health checks)
hang       accept the request and never answer (the connection stays open)
stall      streams stop after `stall_after` tokens and stay open without another
           byte; non-streamed requests hang; the engine drops the stalled request
error      answer `status` at once, in OpenAI's error envelope
slow       serve, with every engine step `slowdown` times longer (a throttled GPU)
=========  ==========================================================================

`health_status` is what `/health` answers in every mode (200 unless set).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from dpserve.config import ConfigError

Mode = Literal["none", "hang", "stall", "error", "slow"]
MODES: tuple[str, ...] = ("none", "hang", "stall", "error", "slow")


@dataclass(frozen=True, kw_only=True)
class Fault:
    mode: Mode = "none"
    """One of the modes in the table above."""
    status: int = 500
    """HTTP status of `error` answers."""
    stall_after: int = 1
    """Tokens a stream delivers before `stall` stops it (0: nothing after the headers)."""
    slowdown: float = 4.0
    """Factor on step times under `slow`."""
    health_status: int = 200
    """What `/health` answers while this fault is set."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 400 <= self.status <= 599:
            raise ConfigError(f"status: must be in 400..599, got {self.status!r}")
        if self.stall_after < 0:
            raise ConfigError(f"stall_after: must be >= 0, got {self.stall_after!r}")
        if not self.slowdown > 0:
            raise ConfigError(f"slowdown: must be > 0, got {self.slowdown!r}")
        if not 200 <= self.health_status <= 599:
            raise ConfigError(f"health_status: must be in 200..599, got {self.health_status!r}")

    @classmethod
    def from_json(cls, data: Any) -> Fault:
        """A Fault from a JSON object of its fields; ConfigError if malformed."""
        if not isinstance(data, dict):
            raise ConfigError("a fault must be a JSON object")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown fault field(s): {', '.join(sorted(unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
