"""What rank 0 shows while training: progress lines, the loss curve as CSV and PNG."""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path


class Progress:
    """One line every `every` steps: step, loss, LR, tokens/s, samples/s, the time per
    step split into compute and time blocked in collectives, ETA; a summary at the end."""

    def __init__(self, *, enabled: bool, total: int, start: int) -> None:
        self.enabled = enabled
        self.total = total
        self._t0 = time.perf_counter()
        self._start = start
        # (seconds, tokens, samples, seconds blocked in collectives)
        self._window: list[tuple[float, float, float, float]] = []
        self._steps = 0
        self._step_seconds = 0.0
        self._comm_seconds = 0.0
        self._samples = 0.0

    def update(self, step: int, loss: float, lr: float, *, tokens: float, samples: int,
               seconds: float, comm: float, every: int) -> None:
        self._window.append((seconds, tokens, samples, comm))
        self._steps += 1
        self._step_seconds += seconds
        self._comm_seconds += comm
        self._samples += samples
        if not self.enabled or (step % every and step != self.total):
            return
        secs = sum(w[0] for w in self._window) or 1e-9
        tok_s = sum(w[1] for w in self._window) / secs
        smp_s = sum(w[2] for w in self._window) / secs
        n = len(self._window)
        comm_ms = 1000 * sum(w[3] for w in self._window) / n
        compute_ms = 1000 * secs / n - comm_ms
        self._window.clear()
        done = step - self._start
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / done * (self.total - step) if done else math.nan
        print(f"step {step:>6}/{self.total}  loss {loss:.4f}  lr {lr:.3e}  "
              f"{tok_s:,.0f} tok/s  {smp_s:,.1f} samples/s  "
              f"step {compute_ms:,.0f}+{comm_ms:,.0f} ms (compute+comm)  eta {fmt_duration(eta)}",
              flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self, *, comm_itemised: bool = True) -> None:
        """The training loop's summary: its time (from the first step: the model and
        data are loaded by then; `dpserve finetune` prints the whole run's wall time),
        samples/s, and where the step time went."""
        if not self.enabled:
            return
        line = f"training loop done in {fmt_duration(time.perf_counter() - self._t0)}"
        if self._steps:
            secs = self._step_seconds or 1e-9
            share = 100 * self._comm_seconds / secs
            line += (f"; {self._steps} steps, {self._samples / secs:,.1f} samples/s, "
                     f"{1000 * (secs - self._comm_seconds) / self._steps:,.0f} ms compute + "
                     f"{1000 * self._comm_seconds / self._steps:,.0f} ms blocked in "
                     f"collectives per step ({share:.0f}% comm)")
            if not comm_itemised:
                line += " (gradient collectives not timed on CUDA under fsdp)"
        print(line, file=sys.stdout, flush=True)


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


class LossLog:
    """`loss.csv` (step, loss, lr, eval_loss, step_s, comm_s: the step's wall time and
    the part of it blocked in collectives); a resumed run keeps the rows up to its start."""

    FIELDS = ("step", "loss", "lr", "eval_loss", "step_s", "comm_s")

    def __init__(self, path: Path, *, keep_until: int) -> None:
        self.path = path
        kept: list[dict[str, str]] = []
        if keep_until > 0 and path.exists():
            with path.open(newline="") as f:
                kept = [r for r in csv.DictReader(f) if int(r["step"]) <= keep_until]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, self.FIELDS)
            writer.writeheader()
            writer.writerows(kept)

    def append(self, step: int, loss: float, lr: float, eval_loss: float | None,
               step_s: float, comm_s: float) -> None:
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([step, f"{loss:.6f}", f"{lr:.6e}",
                                    "" if eval_loss is None else f"{eval_loss:.6f}",
                                    f"{step_s:.6f}", f"{comm_s:.6f}"])

    def plot(self, png: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")  # no display on training nodes
        import matplotlib.pyplot as plt

        with self.path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows],
                label="train loss")
        evals = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
        if evals:
            ax.plot(*zip(*evals, strict=True), marker="o", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(png, dpi=100)
        plt.close(fig)
