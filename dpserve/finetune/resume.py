"""What `dpserve finetune --resume` takes from the run it continues, and what it refuses.

A resume continues the run whose newest checkpoint with training state is in OUTPUT.
The settings that shape that run (strategy, LoRA shape, global batch, learning-rate
schedule, weight decay, clipping, sequence length, seed) are taken from the checkpoint
when they are not given again (a flag, DPSERVE_<NAME> or the config file), and the
launcher says which it took. A given value that differs from the run's is refused,
naming each, unless --resume-changes; another strategy or LoRA shape always is (the
state would not load, or would train something else).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import Any

from dpserve import checkpoint as ckpt
from dpserve.config import ConfigError
from dpserve.finetune.config import SHAPING, FinetuneConfig, build_finetune_config, shaping


class ResumeError(RuntimeError):
    """The resume cannot start; the message names the setting and what to do."""


@dataclasses.dataclass(frozen=True)
class Taken:
    """The settings a resume took from its run: `cfg` with them, and each as `--flag value`."""

    cfg: FinetuneConfig
    checkpoint: Path | None
    settings: tuple[str, ...] = ()


def take_run_settings(cfg: FinetuneConfig, given: Collection[str], world_size: int) -> Taken:
    """`cfg` with every setting of the resumed run that `given` does not name. The global
    batch is kept by the micro-batch or accumulation not given, where it divides."""
    latest = ckpt.latest_checkpoint(Path(cfg.output), with_train_state=True)
    if latest is None:
        return Taken(cfg, None)
    extra = ckpt.read_meta(latest).extra
    take: dict[str, Any] = {}
    if "strategy" not in given and "strategy" in extra:
        take["strategy"] = str(extra["strategy"])
    if extra.get("kind") == "lora" and "lora_rank" not in given:
        take["lora_rank"] = extra.get("lora_rank")
        if "lora_alpha" not in given:
            take["lora_alpha"] = extra.get("lora_alpha")
        targets = extra.get("lora_targets")
        if "lora_targets" not in given and isinstance(targets, list):
            take["lora_targets"] = ",".join(str(t) for t in targets)
    run = extra.get("run")
    if isinstance(run, dict):
        take.update(_run_shaping(run, cfg, given, world_size))
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    changed = {k: v for k, v in take.items() if k in names and getattr(cfg, k) != v}
    if not changed:
        return Taken(cfg, latest)
    said = tuple(f"--{k.replace('_', '-')} {v}" for k, v in changed.items() if v is not None)
    try:  # typed and validated as if given: the file is the user's, not necessarily ours
        taken = build_finetune_config({**dataclasses.asdict(cfg), **changed}, env={})
    except ConfigError as exc:
        raise ResumeError(f"resume: {latest} records a setting that is not valid ({exc}); "
                          "give it on the command line") from None
    return Taken(taken, latest, said)


def _run_shaping(run: dict[str, Any], cfg: FinetuneConfig, given: Collection[str],
                 world_size: int) -> dict[str, Any]:
    """The run's shaping settings not given. Its global batch is kept by whichever of
    micro-batch and accumulation is not given, where it divides (the split may change
    with the ranks; the product is the run's)."""
    take = {k: run[k] for k in SHAPING if k in run and k != "global_batch" and k not in given}
    if "max_steps" in given or "epochs" in given:  # one ends the run: given, it decides
        take.pop("max_steps", None)
        take.pop("epochs", None)
    batch, micro = run.get("global_batch"), run.get("micro_batch_size")
    if not isinstance(batch, int):
        return take
    micro_given, accum_given = "micro_batch_size" in given, "grad_accum" in given
    if not micro_given and not accum_given:
        micro = micro if isinstance(micro, int) and micro >= 1 else cfg.micro_batch_size
        if batch % (micro * world_size) == 0:
            take.update(micro_batch_size=micro, grad_accum=batch // (micro * world_size))
    elif micro_given and not accum_given:
        if batch % (cfg.micro_batch_size * world_size) == 0:
            take["grad_accum"] = batch // (cfg.micro_batch_size * world_size)
    elif accum_given and not micro_given:
        if batch % (cfg.grad_accum * world_size) == 0:
            take["micro_batch_size"] = batch // (cfg.grad_accum * world_size)
    return take


def check(cfg: FinetuneConfig, world_size: int) -> None:
    """ResumeError unless `cfg` continues the run's own kind of training state: the same
    strategy (an fsdp state is sharded per rank, a ddp one is whole), LoRA or not with
    the same shape, and the same optimisation (or --resume-changes)."""
    latest = ckpt.latest_checkpoint(Path(cfg.output), with_train_state=True)
    if latest is None:
        return
    meta = ckpt.read_meta(latest)
    extra = meta.extra
    saved = str(extra.get("strategy", "ddp"))
    if saved != cfg.strategy:
        raise ResumeError(f"strategy: {latest} was trained with --strategy {saved}; "
                          f"resume it with --strategy {saved}, or choose a new --output")
    was_lora = extra.get("kind") == "lora"
    if was_lora != (cfg.lora_rank is not None):
        what = "a LoRA adapter" if was_lora else "every weight"
        raise ResumeError(f"lora_rank: {latest} trained {what}; resume it the same way "
                          "(with or without --lora-rank), or choose a new --output")
    if was_lora:
        from dpserve.finetune.lora import LoraError, check_resumable

        try:
            check_resumable(meta, cfg)
        except LoraError as exc:
            raise ResumeError(str(exc)) from None
    _check_shaping(latest, extra.get("run"), cfg, world_size)


def _check_shaping(latest: Path, saved: object, cfg: FinetuneConfig, world_size: int) -> None:
    """Refuse a resume whose settings would change the run's optimisation (a smaller
    global batch, another schedule) unless --resume-changes says so; say what changed
    either way. Checkpoints written before the settings were saved are not checked."""
    if not isinstance(saved, dict):
        return
    now = shaping(cfg, world_size)
    changed = {k: (saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]}
    if not changed:
        return

    def flag(name: str) -> str:
        if name == "global_batch":
            return ("global batch (--micro-batch-size x --grad-accum x ranks: "
                    f"{cfg.micro_batch_size} x {cfg.grad_accum} x {world_size} now)")
        return "--" + name.replace("_", "-")

    listed = "; ".join(f"{flag(k)} {was} in the run, {new} now"
                       for k, (was, new) in changed.items())
    if not cfg.resume_changes:
        raise ResumeError(
            f"resume: {latest} was trained with other settings: {listed}. Leave them out "
            "to continue the run as it was, or pass --resume-changes to continue with "
            "these")
    print(f"dpserve finetune: resuming {latest} with changed settings (--resume-changes): "
          f"{listed}", flush=True)
