"""Saving and resuming a fine-tune: checkpoints for serving, training state for resume.

Every save publishes the training state first (`train-state/step-N`), then the
served checkpoint (`step-N`, the one that counts). What the training state holds
depends on the strategy:

- ddp / zero1: rank 0 writes `trainer.pt` — the whole AdamW state (zero1
  consolidates its shards on rank 0 first), the schedule, every rank's RNG — and,
  when the served weights are lossy (a bf16 base), the fp32 masters.
- fsdp: every rank writes its own shards of the fp32 weights and AdamW state with
  `torch.distributed.checkpoint` into `dcp/` (safetensors files whose sharding is
  described in their JSON headers), so no rank gathers the optimizer state and a
  resume may use another world size: DCP reshards on load. `trainer.pt` keeps
  the step, schedule and RNG.

A resume reads `trainer.pt` with `weights_only` and DCP's safetensors, never a
pickle, so a file on shared storage can never run code when it is loaded.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpserve import checkpoint as ckpt
from dpserve.finetune.config import FinetuneConfig, shaping
from dpserve.finetune.dist import Dist
from dpserve.finetune.strategy import Parallel, full_tensors, tensor_sizes
from dpserve.finetune.weights import copy_tokenizer_files, plan_files, write_config, write_weights

DCP_DIR = "dcp"


def _dcp_options() -> Any:
    """Frozen parameters (a LoRA run's base) are the base model's: not training state.
    Not strict, so that loading leaves them as they are: every key that is saved is
    loaded (DCP raises on a key the files lack)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=False)

MERGED_DIR = "merged"  # --merge-on-save: full-weight checkpoints of a LoRA run


def save(cfg: FinetuneConfig, d: Dist, output: Path, step: int, epoch: int, par: Parallel,
         scheduler: Any, loss: float, base_dtype: torch.dtype, tokenizer: Any,
         base_fingerprint: str | None = None) -> Path | None:
    """Every rank calls this (it holds collectives); rank 0 publishes. Returns the
    checkpoint on rank 0. `base_fingerprint`: LoRA runs, computed once per run (it
    reads every byte of the base)."""
    rng = _gather_rng(d)
    optimizer_state: Any = None
    sharded = par.strategy.saves_sharded_state
    if par.strategy.consolidates_optimizer:  # a collective: rank 0 gathers the shards
        par.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
    if sharded:
        staged = _stage_sharded_state(output, step, par, d)
    elif d.master:
        optimizer_state = par.optimizer.state_dict()
    lora = cfg.lora_rank is not None
    adapter = None
    if lora:
        from dpserve.finetune import lora as lora_mod

        adapter = lora_mod.full_adapter_state(par.model)  # gathers under fsdp: all ranks
    path = None
    if d.master:
        def write_state(tmp: Path) -> None:
            torch.save({"step": step, "epoch": epoch, "optimizer": optimizer_state,
                        "scheduler": scheduler.state_dict(), "rng": rng,
                        "strategy": par.strategy.name, "config": cfg.to_json()},
                       tmp / "trainer.pt")
            if sharded:
                os.rename(staged, tmp / DCP_DIR)
            elif base_dtype != torch.float32 and not lora:  # the served copy is lossy
                torch.save(par.model.state_dict(), tmp / "master_weights.pt")

        ckpt.write_train_state(output, step, write_state)
    files = plan_files(tensor_sizes(par.model), base_dtype) if not lora else {}
    if d.master:
        def write_model(tmp: Path) -> None:
            if lora:
                lora_mod.save_adapter(par.model, tmp, adapter)
            else:
                write_weights(tmp, files, full_tensors(par.model, master=True), base_dtype,
                              write=True)
                write_config(par.model, tmp, base_dtype)
                copy_tokenizer_files(cfg.model, tmp, tokenizer)

        extra: dict[str, Any] = {"lr": scheduler.get_last_lr()[0], "epoch": epoch,
                                 "strategy": par.strategy.name,
                                 "run": {**shaping(cfg, d.world_size),  # and its split:
                                         "micro_batch_size": cfg.micro_batch_size,
                                         "grad_accum": cfg.grad_accum}}
        if lora:
            extra.update(lora_mod.adapter_meta_extra(cfg, fingerprint=base_fingerprint))
        path = ckpt.write_checkpoint(output, step, write_model, base_model=cfg.model,
                                     loss=loss, world_size=d.world_size, extra=extra)
        ckpt.prune_checkpoints(output, cfg.keep_last)
        print(f"checkpoint {path}", flush=True)
        if lora and cfg.merge_on_save:
            merged = lora_mod.export_merged(path, output / MERGED_DIR,
                                            base_fingerprint_now=base_fingerprint)
            ckpt.prune_checkpoints(output / MERGED_DIR, cfg.keep_last)
            print(f"checkpoint {merged} (merged)", flush=True)
    elif par.strategy.shards_params and not lora:
        # The master's writer gathers each tensor: take part, write nothing.
        write_weights(output, files, full_tensors(par.model, master=False), base_dtype,
                      write=False)
    dist.barrier()
    return path


def _stage_sharded_state(output: Path, step: int, par: Parallel, d: Dist) -> Path:
    """Every rank writes its shards into one staging directory (named like the
    temporary directories `prune_checkpoints` sweeps), which rank 0 then moves into
    the published training state."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    staged = output / ckpt.STATE_DIR / f".{ckpt.step_name(step)}.tmp-dcp"
    if d.master:
        shutil.rmtree(staged, ignore_errors=True)  # left by a save that died
        staged.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(par.model, par.optimizer, options=_dcp_options())
    # Tensors only: the param groups (lr, betas...) are rebuilt from the settings and
    # the schedule; safetensors holds nothing else.
    dcp_save({"model": model_sd, "optim": optim_sd["state"]},
             storage_writer=HuggingFaceStorageWriter(str(staged), save_distributed=True))
    dist.barrier()
    return staged


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


def load_train_state(output: Path, ckpt_dir: Path, cfg: FinetuneConfig, par: Parallel,
                     scheduler: Any, d: Dist) -> int:
    """Restore optimizer, schedule, RNG (and, for fsdp or a lossy base, the fp32
    weights) saved with `ckpt_dir`; returns its step."""
    meta = ckpt.read_meta(ckpt_dir)
    if meta.base_model != cfg.model:
        raise ckpt.CheckpointError(
            f"{ckpt_dir}: trained from {meta.base_model}, not {cfg.model}; "
            "resume with the same --model or use a new --output")
    state_dir = ckpt.train_state_dir(output, meta.step)
    assert state_dir is not None  # latest_checkpoint(with_train_state=True) checked it
    state = load_tensors_only(state_dir / "trainer.pt", d.device)
    saved = state.get("strategy", "ddp")
    if saved != par.strategy.name:  # the launcher checks first; a direct torchrun may not
        raise ckpt.CheckpointError(
            f"{ckpt_dir}: trained with --strategy {saved}; resume with the same strategy")
    if par.strategy.saves_sharded_state:
        _load_sharded_state(state_dir / DCP_DIR, par)
    else:
        masters = state_dir / "master_weights.pt"
        if masters.exists():
            par.model.load_state_dict(load_tensors_only(masters, d.device))
        par.optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    # The param groups' LR is the schedule's at the saved step (ddp's optimizer state
    # carries it; fsdp's holds tensors only, its groups were built at step 0).
    for group, lr in zip(par.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    rng = state["rng"]
    if len(rng) == d.world_size:  # same world: every rank continues its own stream
        torch.set_rng_state(rng[d.rank]["torch"].cpu())
        if "cuda" in rng[d.rank] and d.device.type == "cuda":
            torch.cuda.set_rng_state(rng[d.rank]["cuda"].cpu(), d.device)
    return int(state["step"])


def _load_sharded_state(path: Path, par: Parallel) -> None:
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    model_sd, optim_sd = get_state_dict(par.model, par.optimizer, options=_dcp_options())
    loaded: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
    dcp_load(loaded, storage_reader=HuggingFaceStorageReader(str(path)))
    set_state_dict(par.model, par.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict={"state": loaded["optim"],
                                     "param_groups": optim_sd["param_groups"]},
                   options=_dcp_options())
