"""What rank 0 shows while training: progress lines, the loss curve as CSV and PNG."""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path


class Progress:
    """One line every `every` steps: step, loss, LR, tokens/s, samples/s, ETA."""

    def __init__(self, *, enabled: bool, total: int, start: int) -> None:
        self.enabled = enabled
        self.total = total
        self._t0 = time.perf_counter()
        self._start = start
        self._window: list[tuple[float, float, float]] = []  # (seconds, tokens, samples)

    def update(self, step: int, loss: float, lr: float, *, tokens: float, samples: int,
               seconds: float, every: int) -> None:
        self._window.append((seconds, tokens, samples))
        if not self.enabled or (step % every and step != self.total):
            return
        secs = sum(w[0] for w in self._window) or 1e-9
        tok_s = sum(w[1] for w in self._window) / secs
        smp_s = sum(w[2] for w in self._window) / secs
        self._window.clear()
        done = step - self._start
        elapsed = time.perf_counter() - self._t0
        eta = elapsed / done * (self.total - step) if done else math.nan
        print(f"step {step:>6}/{self.total}  loss {loss:.4f}  lr {lr:.3e}  "
              f"{tok_s:,.0f} tok/s  {smp_s:,.1f} samples/s  eta {_fmt(eta)}", flush=True)

    def note(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(f"done in {_fmt(time.perf_counter() - self._t0)}", file=sys.stdout, flush=True)


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


class LossLog:
    """`loss.csv` (step, loss, lr, eval_loss); a resumed run keeps the rows up to its start."""

    FIELDS = ("step", "loss", "lr", "eval_loss")

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

    def append(self, step: int, loss: float, lr: float, eval_loss: float | None) -> None:
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([step, f"{loss:.6f}", f"{lr:.6e}",
                                    "" if eval_loss is None else f"{eval_loss:.6f}"])

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
