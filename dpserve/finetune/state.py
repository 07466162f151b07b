"""Saving and resuming a fine-tune: checkpoints for serving, training state for resume.

Rank 0 writes the training state (optimizer, schedule, every rank's RNG) and then
the checkpoint; a resume reads the state back with `weights_only`, so a file on
shared storage can never run code when it is loaded.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpserve import checkpoint as ckpt
from dpserve.finetune.config import FinetuneConfig
from dpserve.finetune.dist import Dist
from dpserve.finetune.weights import copy_tokenizer_files, save_weights


def save(cfg: FinetuneConfig, d: Dist, output: Path, step: int, epoch: int,
          model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
          loss: float, base_dtype: torch.dtype, tokenizer: Any) -> None:
    """Rank 0 writes the training state, then the checkpoint; everyone waits for it."""
    rng = _gather_rng(d)
    if d.master:
        def write_state(tmp: Path) -> None:
            torch.save({"step": step, "epoch": epoch, "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "rng": rng,
                        "config": cfg.to_json()}, tmp / "trainer.pt")
            if base_dtype != torch.float32:  # the served copy is lossy: keep the masters
                torch.save(model.state_dict(), tmp / "master_weights.pt")

        def write_model(tmp: Path) -> None:
            save_weights(model, tmp, base_dtype)
            copy_tokenizer_files(cfg.model, tmp, tokenizer)

        ckpt.write_train_state(output, step, write_state)
        path = ckpt.write_checkpoint(
            output, step, write_model,
            base_model=cfg.model, loss=loss, world_size=d.world_size,
            extra={"lr": scheduler.get_last_lr()[0], "epoch": epoch},
        )
        ckpt.prune_checkpoints(output, cfg.keep_last)
        print(f"checkpoint {path}", flush=True)
    dist.barrier()


def _gather_rng(d: Dist) -> list[dict[str, Any]]:
    state = {"torch": torch.get_rng_state()}
    if d.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(d.device)
    gathered: list[Any] = [None] * d.world_size
    dist.all_gather_object(gathered, state)
    return gathered


def load_tensors_only(path: Path, device: torch.device | str) -> Any:
    """A file written by `torch.save`, unpickled with `weights_only`: tensors, containers
    and plain values only. The training state lies on storage others may write; a full
    unpickle would run whatever code a crafted file names. CheckpointError if it holds
    anything else."""
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol first
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ckpt.CheckpointError(f"{path}: refusing to load it: it holds more than tensors "
                                   f"and plain data ({reason})") from None


def load_train_state(output: Path, ckpt_dir: Path, cfg_model: str, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer, scheduler: Any, d: Dist) -> int:
    meta = ckpt.read_meta(ckpt_dir)
    if meta.base_model != cfg_model:
        raise ckpt.CheckpointError(
            f"{ckpt_dir}: trained from {meta.base_model}, not {cfg_model}; "
            "resume with the same --model or use a new --output")
    state_dir = ckpt.train_state_dir(output, meta.step)
    assert state_dir is not None  # latest_checkpoint(with_train_state=True) checked it
    state = load_tensors_only(state_dir / "trainer.pt", d.device)
    masters = state_dir / "master_weights.pt"
    if masters.exists():
        model.load_state_dict(load_tensors_only(masters, d.device))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    if len(rng) == d.world_size:  # same world: every rank continues its own stream
        torch.set_rng_state(rng[d.rank]["torch"].cpu())
        if "cuda" in rng[d.rank] and d.device.type == "cuda":
            torch.cuda.set_rng_state(rng[d.rank]["cuda"].cpu(), d.device)
    return int(state["step"])
