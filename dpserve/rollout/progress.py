"""The record of one deploy, as `GET /admin/deploy/{id}` shows it, and its options.

A deploy goes `validating → rolling → succeeded`, or `→ rolling_back →
rolled_back | failed` when a step fails (`failed`: the rollback could not put
every replica back either), or straight to `refused` when the checkpoint does
not pass validation (no replica was touched). Each replica goes through
`pending → precheck → draining → reloading → canary → done`, or ends `skipped` (already
serving the version), `restarting` (the supervisor starts it on the deployed
weights), `failed`, or `rolled_back`.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from dpserve.rollout.validate import Refused

log = logging.getLogger("dpserve.rollout")

DEFAULT_CANARY_PROMPT = "The quick brown fox"

MAX_EVENTS = 200
MAX_WAIT_S = 86_400.0
"""Longest accepted wait (drain, readiness) of one deploy: a day."""
GATE_METRICS = ("exact_match", "mean_logprob")
INCONCLUSIVE = ("rollback", "promote")
NUMBERS: tuple[tuple[str, type, float, float, bool], ...] = (
    ("batch", int, 1, 10_000, False),
    ("drain_wait_s", float, 0.0, MAX_WAIT_S, False),
    ("ready_timeout_s", float, 0.0, MAX_WAIT_S, False),
    ("gate_min_score", float, -1e6, 1e6, False),
    ("gate_margin", float, 0.0, 1e6, False),
    ("gate_repeats", int, 1, 10, False),
    ("canary_weight", float, 0.0, 100.0, True),
    ("canary_duration_s", float, 0.0, MAX_WAIT_S, True),
    ("canary_max_error_rate_delta", float, 0.0, 1.0, False),
    ("canary_max_ttft_ratio", float, 1.0, 1e6, False),
    ("canary_ttft_slack_ms", float, 0.0, 1e6, False),
    ("canary_min_requests", int, 1, 1_000_000, False),
    ("canary_max_duration_s", float, 0.0, MAX_WAIT_S, True),
    ("canary_confidence", float, 0.5, 1.0, True),
)
"""Numeric fields of a deploy: type, bounds, whether the bounds are excluded. Every
value must be finite: they become timeouts, loop counts and thresholds."""
NO_MIXED_DRAIN_S = 600.0
"""`no_mixed_versions` without `drain_wait_s`: how long a drained replica's requests
may take to finish before the deploy gives up on it."""
DEPLOY_FIELDS = ("checkpoint", "batch", "canary_prompt", "drain_wait_s", "ready_timeout_s",
                 "name", "drop_adapters", "no_mixed_versions", "eval_data", "gate_metric",
                 "gate_min_score", "gate_vs_current", "gate_margin", "gate_repeats",
                 "canary_weight",
                 "canary_duration_s", "canary_max_error_rate_delta", "canary_max_ttft_ratio",
                 "canary_ttft_slack_ms", "canary_min_requests", "canary_max_duration_s",
                 "canary_confidence", "canary_inconclusive")
"""Fields a `POST /admin/deploy` body may hold."""


@dataclass(frozen=True, kw_only=True)
class DeployOptions:
    batch: int = 1
    """Replicas reloaded at once; always fewer than all of them."""
    canary_prompt: str = DEFAULT_CANARY_PROMPT
    """Prompt of the greedy request each reloaded replica must answer sanely."""
    drain_wait_s: float = 0.0
    """Wait up to this long for a drained replica's in-flight requests to end before
    pausing it (0: pause at once; frozen requests resume on the new weights)."""
    ready_timeout_s: float = 900.0
    """How long to wait for a replica that is not ready at its turn (router-only mode)."""
    drop_adapters: bool = False
    """A full checkpoint while LoRA adapters serve: stop serving them first (they were
    trained on the weights being replaced). Without it such a deploy is refused."""
    no_mixed_versions: bool = False
    """Pause a replica only once its requests have ended (`drain_wait_s`, or
    NO_MIXED_DRAIN_S, at most), so that no response begins on the old weights and ends
    on the new; a replica still busy by then fails the deploy (rolled back)."""

    eval_data: str | None = None
    """An eval file (fine-tuning JSONL) scored on the first updated replica, out of
    rotation, and on one still on the current version (`rollout.quality`)."""
    gate_metric: str = "exact_match"
    gate_min_score: float | None = None
    """Roll back unless the new version scores at least this (the gate's metric)."""
    gate_vs_current: bool = False
    """Roll back if the new version scores surely below the current one by more than
    `gate_margin` and the spread of repeated runs (`rollout.gate_verdict`)."""
    gate_margin: float = 0.0
    gate_repeats: int = 2
    """Runs of the eval set on each version."""

    def check_fleet(self, replicas: int, *, adapter: bool) -> None:
        """Refused(400) for options a fleet of `replicas` cannot honour."""
        if replicas > 1 and self.batch >= replicas:
            raise Refused(400, f"batch must leave a replica serving: at most {replicas - 1} "
                               f"of {replicas}", param="batch")
        if replicas < 2 and self.canary_weight is not None and not adapter:
            raise Refused(400, "canary traffic compares the updated replica with the others: "
                               "a single replica has none to compare with",
                          param="canary_weight")
        if replicas < 2 and self.no_mixed_versions and not adapter:
            raise Refused(400, "no_mixed_versions needs a second replica to serve while one "
                               "drains; a lone replica's requests in flight resume on the new "
                               "weights", param="no_mixed_versions")

    canary_weight: float | None = None
    """Percent of new requests sent to the first updated replica, once it serves, for
    `canary_duration_s`, while it is compared with a baseline replica
    (`router.canary_verdict`): a look every quarter of the duration, the window closing
    at the first sure verdict."""
    canary_duration_s: float = 60.0
    canary_max_duration_s: float | None = None
    """While the verdict is unsure the window goes on up to this long (default: twice
    `canary_duration_s`); unsure then is `inconclusive`."""
    canary_max_error_rate_delta: float = 0.02
    canary_max_ttft_ratio: float = 1.5
    canary_ttft_slack_ms: float = 20.0
    """TTFT within this many ms of the baseline's is never a regression, whatever the
    ratio."""
    canary_min_requests: int = 30
    """Answers each side needs before any verdict."""
    canary_confidence: float = 0.95
    """The chance, over a whole window, that a canary on one side of a threshold is not
    judged on the other."""
    canary_inconclusive: str = "rollback"
    """What a window that ends unsure does: `rollback` or `promote`."""

    @property
    def drain_deadline_s(self) -> float:
        """How long a drained replica's requests may run before it is paused."""
        return self.drain_wait_s or (NO_MIXED_DRAIN_S if self.no_mixed_versions else 0.0)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> DeployOptions:
        """Options from a request body; Refused(400) naming a bad field. Numbers must be
        finite and within bounds: they become timeouts and loop counts."""
        values: dict[str, Any] = {}
        for name, kind, low, high, exclusive in NUMBERS:
            value = body.get(name)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value)
                    or (kind is int and not float(value).is_integer())
                    or not low <= value <= high or (exclusive and value in (low, high))):
                bounds = f"({low:g}, {high:g})" if exclusive else f"{low:g}..{high:g}"
                raise Refused(400, f"{name} must be a{'n integer' if kind is int else ' number'}"
                                   f" in {bounds}, got {value!r}", param=name)
            values[name] = kind(value)
        prompt = body.get("canary_prompt")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > 4096:
                raise Refused(400, "canary_prompt must be a non-empty string of at most "
                                   "4096 characters", param="canary_prompt")
            values["canary_prompt"] = prompt
        means = body.get("canary_inconclusive")
        if means is not None:
            if means not in INCONCLUSIVE:
                raise Refused(400, "canary_inconclusive must be rollback or promote",
                              param="canary_inconclusive")
            values["canary_inconclusive"] = means
        for flag in ("drop_adapters", "no_mixed_versions", "gate_vs_current"):
            value = body.get(flag)
            if value is not None:
                if not isinstance(value, bool):
                    raise Refused(400, f"{flag} must be true or false", param=flag)
                values[flag] = value
        if "canary_weight" not in values and any(k.startswith("canary_") for k in values):
            raise Refused(400, "canary options need canary_weight (--canary-weight)",
                          param="canary_weight")
        metric = body.get("gate_metric")
        if metric is not None:
            if metric not in GATE_METRICS:
                raise Refused(400, f"gate_metric must be one of {', '.join(GATE_METRICS)}",
                              param="gate_metric")
            values["gate_metric"] = metric
        path = body.get("eval_data")
        if path is not None:
            if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096:
                raise Refused(400, "eval_data must be an absolute path", param="eval_data")
            values["eval_data"] = path
        gating = ("gate_min_score" in values or values.get("gate_vs_current")
                  or "gate_margin" in values or "gate_metric" in values
                  or "gate_repeats" in values)
        if gating and "eval_data" not in values:
            raise Refused(400, "the quality gate needs an eval set: give eval_data (--eval)",
                          param="eval_data")
        return cls(**values)


class DeployState(enum.StrEnum):
    VALIDATING = "validating"
    ROLLING = "rolling"
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    REFUSED = "refused"


FINAL_STATES = frozenset({DeployState.SUCCEEDED, DeployState.ROLLED_BACK, DeployState.FAILED,
                          DeployState.REFUSED})


class Phase(enum.StrEnum):
    PENDING = "pending"
    PRECHECK = "precheck"
    DRAINING = "draining"
    RELOADING = "reloading"
    CANARY = "canary"
    DONE = "done"
    SKIPPED = "skipped"
    RESTARTING = "restarting"
    FAILED = "failed"
    ROLLED_BACK = "rolled_back"


@dataclass
class ReplicaProgress:
    id: str
    phase: Phase = Phase.PENDING
    from_version: str | None = None
    version: str | None = None
    """What the replica serves after this deploy touched it (None: unknown)."""
    seconds: float | None = None
    """Time the replica spent out of rotation (drain to re-admission)."""
    steps: dict[str, float] = field(default_factory=dict)
    """Seconds each hot-load step took (drain, pause, reload, ..., canary)."""
    mixed: int = 0
    """Requests this router had in flight on the replica when it was paused: each
    resumes on the new weights, so its response may mix two versions (at most this
    many: one already generated and still being sent did not)."""
    migrated: int = 0
    """Streams still running at the drain deadline, carried on by other replicas from
    the tokens their clients had."""
    restarted: int = 0
    """Streams that had sent nothing yet at the drain deadline, started over on other
    replicas (each wholly on one version)."""
    note: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "phase": self.phase.value, "from_version": self.from_version,
                "version": self.version, "seconds": self.seconds, "steps": dict(self.steps),
                "mixed_versions": self.mixed, "migrated_streams": self.migrated,
                "restarted_streams": self.restarted, "note": self.note, "error": self.error}


@dataclass
class DeployProgress:
    id: str
    checkpoint: str
    options: dict[str, Any]
    state: DeployState = DeployState.VALIDATING
    version: str | None = None
    previous_version: str | None = None
    snapshot: str | None = None
    """What the engines load: the checkpoint's copy in the snapshot store."""
    adapter: str | None = None
    """The adapter name a LoRA deploy serves the checkpoint as (None: full weights)."""
    error: str | None = None
    canary: dict[str, Any] | None = None
    """Canary traffic (`--canary-weight`), updated as it runs: the canary's, its
    baseline's and the other replicas' requests, errors and TTFT, what the canary is
    judged `against`, then passed and reason."""
    quality: dict[str, Any] | None = None
    """The eval set's scores (`--eval`): candidate, current, passed, reason."""
    replicas: list[ReplicaProgress] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    _t0: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.state in FINAL_STATES

    def replica(self, replica_id: str) -> ReplicaProgress:
        return next(r for r in self.replicas if r.id == replica_id)

    def event(self, message: str, *, level: int = logging.INFO) -> None:
        """Note a step, in the record (bounded) and in the router's log."""
        log.log(level, "deploy %s: %s", self.id, message)
        if len(self.events) < MAX_EVENTS:
            self.events.append(f"{time.monotonic() - self._t0:7.2f}s {message}")

    def finish(self, state: DeployState, error: str | None = None) -> None:
        self.state = state
        if error is not None:
            self.error = error
        self.finished_at = time.time()
        self.event(f"{state.value}" + (f": {error}" if error else ""),
                   level=logging.INFO if state is DeployState.SUCCEEDED else logging.WARNING)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "checkpoint": self.checkpoint, "state": self.state.value,
            "done": self.done, "version": self.version,
            "previous_version": self.previous_version, "snapshot": self.snapshot,
            "adapter": self.adapter,
            "error": self.error,
            "options": self.options, "started_at": self.started_at,
            "finished_at": self.finished_at,
            "replicas": [r.to_json() for r in self.replicas], "events": list(self.events),
            "mixed_versions": sum(r.mixed for r in self.replicas), "quality": self.quality,
            "canary": self.canary,
        }
