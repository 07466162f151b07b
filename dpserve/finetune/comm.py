"""How long a rank is blocked in collectives, per step.

"Blocked" is wall time the training thread waits on communication, the number an
operator compares with compute time (a rank that waits half of every step wastes
half the hardware). It is measured without changing what is communicated:

- explicit collectives of the loop (loss-token count, step loss, stop flag): timed
  around the call;
- ddp/zero1 gradient all-reduce: a DDP comm hook stamps each bucket's launch and
  completion; the backward's tail (last completion after the last launch) is the part
  no compute hides, counted as blocked; the buckets' own durations are reported as
  `busy` (they overlap the backward);
- fsdp all-gather and reduce-scatter: FSDP2's custom-collective seam wraps the default
  ones; a synchronous call is timed, an asynchronous one is timed at its `wait()`.

On CUDA the collectives run on streams and return before they finish, so wall time
would show launch cost only: there the fsdp collectives are not itemised and the
summary says so (use `torch.profiler` for a kernel timeline).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# The defaults FSDP2 uses; `set_custom_all_gather/reduce_scatter` take subclasses of them.
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)


@dataclass
class CommTimer:
    """Seconds blocked in collectives since the last `take()`, and the buckets' busy time."""

    blocked: float = 0.0
    busy: float = 0.0
    _launches: list[float] = field(default_factory=list)
    _completions: list[float] = field(default_factory=list)

    @contextmanager
    def blocking(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.blocked += time.perf_counter() - t0

    def take(self) -> tuple[float, float]:
        """(blocked, busy) seconds of the step just finished; resets the counters."""
        if self._launches and self._completions:
            self.blocked += max(0.0, max(self._completions) - max(self._launches))
        out = (self.blocked, self.busy)
        self.blocked = self.busy = 0.0
        self._launches.clear()
        self._completions.clear()
        return out

    # -- DDP ---------------------------------------------------------------------------

    def ddp_hook(self, state: object, bucket: Any) -> torch.futures.Future[Any]:
        """DDP's default all-reduce (average), stamped at launch and completion."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        start = time.perf_counter()
        self._launches.append(start)
        fut = allreduce_hook(None, bucket)  # type: ignore[arg-type]

        def done(f: torch.futures.Future[Any]) -> Any:
            end = time.perf_counter()
            self._completions.append(end)
            self.busy += end - start
            return f.value()

        return fut.then(done)

    # -- FSDP2 -------------------------------------------------------------------------

    def install_fsdp(self, module: torch.nn.Module) -> bool:
        """Time the all-gathers and reduce-scatters of every FSDP module under `module`.
        False (nothing installed) on CUDA, where wall time would measure launches."""
        from torch.distributed.fsdp import FSDPModule

        if any(p.is_cuda for p in module.parameters()):
            return False
        gather, scatter = _TimedAllGather(self), _TimedReduceScatter(self)
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_all_gather(gather)
                sub.set_custom_reduce_scatter(scatter)
        return True


class _TimedWork(dist.Work):
    """An asynchronous collective whose `wait()` is counted as blocked time."""

    def __init__(self, inner: dist.Work, timer: CommTimer) -> None:
        super().__init__()
        self._inner, self._timer = inner, timer

    def wait(self, timeout: Any = None) -> bool:
        with self._timer.blocking():
            return bool(self._inner.wait() if timeout is None else self._inner.wait(timeout))

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())


class _TimedAllGather(DefaultAllGather):
    def __init__(self, timer: CommTimer) -> None:
        self._timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if async_op:
            work = super().__call__(output_tensor, input_tensor, group, async_op=True)
            return _TimedWork(work, self._timer) if work is not None else None
        with self._timer.blocking():
            return super().__call__(output_tensor, input_tensor, group, async_op=False)


class _TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, timer: CommTimer) -> None:
        self._timer = timer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> dist.Work:
        with self._timer.blocking():
            work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
            if async_op and work is not None:
                work.wait()
        return work
