"""The DDP training loop; run one process per GPU (or CPU slice) under torchrun.

    torchrun --nproc-per-node 2 -m dpserve.finetune.train --model M --data D --output O

`dpserve finetune` launches exactly this through torch's elastic launcher.
Each rank holds the full model; DistributedDataParallel all-reduces gradients.

Loss normalisation: the loss of a step is the sum of token losses over every
micro-batch of every rank divided by the number of loss tokens in the whole
step (counted with one all-reduce up front). So a step's gradient is the same
whatever the world size, micro-batch size or accumulation — the property the
equivalence tests check — and padding never reweights examples.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import signal
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from dpserve import checkpoint as ckpt
from dpserve.config import ConfigError
from dpserve.finetune.config import FinetuneConfig, add_arguments, build_finetune_config
from dpserve.finetune.data import DataError, ExampleDataset, collate, load_dataset
from dpserve.finetune.progress import LossLog, Progress
from dpserve.finetune.weights import copy_tokenizer_files, save_weights


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_distributed(threads_per_rank: int | None) -> Dist:
    """Join the process group torchrun described in the environment (or run alone)."""
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    if "MASTER_ADDR" not in os.environ:  # plain `python -m`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return Dist(rank, local_rank, world_size, device)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lr_at(step: int, cfg: FinetuneConfig, max_steps: int) -> float:
    """Multiplier of the peak LR: linear warm-up, then cosine down to min_lr_ratio."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StopFlag:
    """Set by SIGTERM/SIGINT; ranks agree on it with an all-reduce at step boundaries."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, d: Dist, also: bool = False) -> bool:
        """True on every rank if any rank wants to stop. A sync point: all ranks call it."""
        flag = torch.tensor([1 if (self.requested or also) else 0], device=d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def micro_batches(
    loader: DataLoader[Any], sampler: DistributedSampler[Any], start_epoch: int, skip: int
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Endless (epoch, batch) stream; the first `skip` batches of `start_epoch` are
    skipped so that a resumed run sees exactly the data it would have seen."""
    epoch = start_epoch
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if epoch == start_epoch and i < skip:
                continue
            yield epoch, batch
        epoch += 1


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum of next-token cross-entropy over the labelled tokens, in fp32."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def loss_tokens(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"][:, 1:] != -100).sum())


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader[Any], d: Dist, autocast: Any) -> float:
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=d.device)
    for batch in loader:
        batch = {k: v.to(d.device) for k, v in batch.items()}
        with autocast():
            total[0] += token_loss_sum(model, batch).double()
        total[1] += loss_tokens(batch)
    dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def train(cfg: FinetuneConfig, d: Dist) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one tqdm bar per rank per load/save otherwise
    output = Path(cfg.output)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id)
    examples, stats = load_dataset(Path(cfg.data), tokenizer, max_seq_len=cfg.max_seq_len)
    dataset = ExampleDataset(examples)
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=cfg.seed,
        drop_last=True)
    collate_fn = partial(collate, pad_id=pad_id)
    loader = DataLoader(dataset, batch_size=cfg.micro_batch_size, sampler=sampler,
                        collate_fn=collate_fn, drop_last=True)
    batches_per_epoch = len(loader)
    steps_per_epoch = batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise DataError(
            f"{cfg.data}: {len(dataset)} usable examples make no full step of "
            f"{cfg.micro_batch_size * d.world_size * cfg.grad_accum} (micro-batch x world "
            f"size x accumulation); add data or lower the batch")
    max_steps = cfg.max_steps or max(1, math.ceil((cfg.epochs or 1.0) * steps_per_epoch))

    eval_loader = None
    if cfg.eval_data is not None:
        eval_examples, _ = load_dataset(Path(cfg.eval_data), tokenizer,
                                        max_seq_len=cfg.max_seq_len)
        # Every example exactly once over all ranks (a DistributedSampler would pad
        # with repeats); ranks may get unequal counts, only the final sums are reduced.
        eval_set = Subset(ExampleDataset(eval_examples),
                          range(d.rank, len(eval_examples), d.world_size))
        eval_loader = DataLoader(eval_set, batch_size=cfg.micro_batch_size,
                                 collate_fn=collate_fn)

    start_step, resume_from = 0, None
    # After a failure the elastic agent restarts the workers: they continue, not restart.
    if cfg.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume_from = ckpt.latest_checkpoint(output, with_train_state=True)
    model_source = str(resume_from) if resume_from is not None else cfg.model
    base_dtype = _config_dtype(cfg.model)
    # fp32 master weights; bf16 autocast on GPU for the matmuls.
    model = AutoModelForCausalLM.from_pretrained(model_source, dtype=torch.float32)
    torch.nn.Module.to(model, d.device)  # in place (transformers types its `to` too narrowly)
    ddp = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, cfg, max_steps))
    if resume_from is not None:
        start_step = _load_train_state(output, resume_from, cfg.model, model, optimizer,
                                       scheduler, d)

    autocast = (partial(torch.autocast, "cuda", dtype=torch.bfloat16)
                if d.device.type == "cuda" else contextlib.nullcontext)
    consumed = start_step * cfg.grad_accum
    stream = micro_batches(loader, sampler, consumed // batches_per_epoch,
                           consumed % batches_per_epoch)
    global_batch = cfg.micro_batch_size * d.world_size * cfg.grad_accum
    stop = StopFlag()
    log = LossLog(output / "loss.csv", keep_until=start_step) if d.master else None
    progress = Progress(enabled=d.master, total=max_steps, start=start_step)
    if d.master:
        print(f"finetune: {len(dataset)} examples ({stats.loss_tokens} loss tokens, "
              f"{stats.skipped_empty} skipped, {stats.truncated} truncated); world size "
              f"{d.world_size} on {d.device.type}; global batch {global_batch} = micro-batch "
              f"{cfg.micro_batch_size} x world {d.world_size} x accumulation {cfg.grad_accum}; "
              f"{steps_per_epoch} steps/epoch; steps {start_step}->{max_steps}"
              + (f" (resumed from {resume_from.name})" if resume_from else ""), flush=True)

    step, last_loss, run_steps = start_step, float("nan"), 0
    epoch = consumed // batches_per_epoch
    last_saved = start_step if resume_from is not None else -1
    while step < max_steps:
        t0 = time.perf_counter()
        micro = []
        for _ in range(cfg.grad_accum):
            epoch, batch = next(stream)
            micro.append({k: v.to(d.device) for k, v in batch.items()})
        # Loss tokens in the whole step, over all ranks: the normaliser (a sync point).
        counts = torch.tensor([sum(loss_tokens(b) for b in micro),
                               sum(int(b["attention_mask"].sum()) for b in micro)],
                              dtype=torch.float64, device=d.device)
        dist.all_reduce(counts)
        n_loss_tokens, n_tokens = counts.tolist()
        step_loss = torch.zeros((), dtype=torch.float64, device=d.device)
        for i, batch in enumerate(micro):
            # DDP averages gradients over ranks; scaling by world_size makes that a sum.
            sync = contextlib.nullcontext() if i == len(micro) - 1 else ddp.no_sync()
            with sync, autocast():
                loss_sum = token_loss_sum(ddp, batch)
            (loss_sum * d.world_size / max(n_loss_tokens, 1)).backward()
            step_loss += loss_sum.detach().double()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        last_loss = float(step_loss) / max(n_loss_tokens, 1)
        step += 1
        run_steps += 1
        lr = float(scheduler.get_last_lr()[0])
        progress.update(step, last_loss, lr, tokens=n_tokens, samples=global_batch,
                        seconds=time.perf_counter() - t0, every=cfg.log_every)

        eval_loss = None
        if eval_loader is not None and (step % cfg.eval_every == 0 or step == max_steps):
            eval_loss = evaluate(ddp, eval_loader, d, autocast)
            progress.note(f"step {step}: eval loss {eval_loss:.4f}")
        if log is not None:
            log.append(step, last_loss, lr, eval_loss)

        stopping = stop.agreed(d, also=cfg.stop_after_steps is not None
                               and run_steps >= cfg.stop_after_steps)
        periodic = cfg.save_every > 0 and step % cfg.save_every == 0
        if periodic or stopping or step == max_steps:
            _save(cfg, d, output, step, epoch, model, optimizer, scheduler, last_loss,
                  base_dtype, tokenizer)
            last_saved = step
        if stopping:
            progress.note(f"stopping at step {step} (checkpoint saved); continue with --resume")
            break
    if last_saved != step:  # nothing new was trained (resumed at the end)
        progress.note(f"nothing to train: already at step {step} of {max_steps}")
    progress.close()
    if log is not None:
        log.plot(output / "loss.png")
    return 0


def _config_dtype(model: str) -> torch.dtype:
    """The dtype the base model is stored in; checkpoints are written the same way."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(model), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def _save(cfg: FinetuneConfig, d: Dist, output: Path, step: int, epoch: int,
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


def _load_train_state(output: Path, ckpt_dir: Path, cfg_model: str, model: torch.nn.Module,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpserve.finetune.train")
    add_arguments(parser, launcher=False)
    ns = parser.parse_args(argv)
    try:
        cfg = build_finetune_config(ns)
    except ConfigError as exc:
        print(f"finetune: invalid configuration: {exc}", file=sys.stderr)
        return 2
    d = setup_distributed(cfg.threads_per_rank)
    try:
        return train(cfg, d)
    except (DataError, ckpt.CheckpointError) as exc:
        if d.master:
            print(f"finetune: {exc}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
