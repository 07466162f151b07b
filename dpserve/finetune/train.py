"""The data-parallel training loop; run one process per GPU (or CPU slice) under torchrun.

    torchrun --nproc-per-node 2 -m dpserve.finetune.train --model M --data D --output O

`dpserve finetune` launches exactly this through torch's elastic launcher. How the
ranks share the model (`--strategy ddp|zero1|fsdp`, LoRA or every weight) lives in
`strategy.py`; this loop is the same for all of them.

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
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dpserve import checkpoint as ckpt
from dpserve.config import ConfigError
from dpserve.finetune.config import FinetuneConfig, add_arguments, build_finetune_config
from dpserve.finetune.data import DataError, RankData, load_rank_data
from dpserve.finetune.dist import Dist, setup_distributed
from dpserve.finetune.memory import MemoryProbe
from dpserve.finetune.progress import LossLog, Progress
from dpserve.finetune.sharding import Strategy
from dpserve.finetune.state import load_train_state, save
from dpserve.finetune.strategy import Parallel, wrap


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


def autocast_for(cfg: FinetuneConfig, d: Dist) -> Callable[[], Any]:
    """What the loop enters around each forward and backward: bf16 autocast on a GPU
    (fp32 master weights, bf16 matmuls), nothing on CPU (bf16 matmuls are slow there)
    nor under fsdp, whose mixed-precision policy already computes in bf16 (autocast
    would cast twice)."""
    if d.device.type == "cuda" and Strategy.named(cfg.strategy).uses_autocast:
        return partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


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
    """Set up, then step until `max_steps` (or a stop), saving as configured; read it
    top to bottom: data, model, the loop (step, log, evaluate, save)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one tqdm bar per rank per load/save otherwise
    output = Path(cfg.output)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    data = load_rank_data(cfg, d, tokenizer)
    t = _build_trainee(cfg, d, output, data.max_steps)
    autocast = autocast_for(cfg, d)
    consumed = t.start_step * cfg.grad_accum
    stream = micro_batches(data.loader, data.sampler, consumed // data.batches_per_epoch,
                           consumed % data.batches_per_epoch)
    global_batch = cfg.micro_batch_size * d.world_size * cfg.grad_accum
    stop = StopFlag()
    fingerprint = None  # of the base a LoRA adapter belongs to: hashed once, by rank 0
    if cfg.lora_rank is not None and d.master:
        fingerprint = ckpt.base_fingerprint(cfg.model)
    log = LossLog(output / "loss.csv", keep_until=t.start_step) if d.master else None
    progress = Progress(enabled=d.master, total=data.max_steps, start=t.start_step)
    if d.master:
        _announce(cfg, d, data, t, global_batch)

    step, last_loss, run_steps = t.start_step, float("nan"), 0
    planned = min(data.max_steps - t.start_step, cfg.stop_after_steps or data.max_steps)
    probe = MemoryProbe(cfg, d, output, planned)  # what --plan estimates, measured
    epoch = consumed // data.batches_per_epoch
    while step < data.max_steps:
        t0 = time.perf_counter()
        micro = []
        for _ in range(cfg.grad_accum):
            epoch, batch = next(stream)
            micro.append({k: v.to(d.device) for k, v in batch.items()})
        last_loss, n_tokens = _step(cfg, d, t, micro, autocast, probe)
        step += 1
        run_steps += 1
        probe.step_done()
        lr = float(t.scheduler.get_last_lr()[0])
        seconds = time.perf_counter() - t0
        blocked, _ = t.par.comm.take()
        progress.update(step, last_loss, lr, tokens=n_tokens, samples=global_batch,
                        seconds=seconds, comm=blocked, every=cfg.log_every)

        eval_loss = None
        if data.eval_loader is not None and (step % cfg.eval_every == 0
                                             or step == data.max_steps):
            eval_loss = evaluate(t.par.forward, data.eval_loader, d, autocast)
            progress.note(f"step {step}: eval loss {eval_loss:.4f}")
        if log is not None:
            log.append(step, last_loss, lr, eval_loss, seconds, blocked)

        stopping = stop.agreed(d, also=cfg.stop_after_steps is not None
                               and run_steps >= cfg.stop_after_steps)
        periodic = cfg.save_every > 0 and step % cfg.save_every == 0
        if periodic or stopping or step == data.max_steps:
            save(cfg, d, output, step, epoch, t.par, t.scheduler, last_loss, t.base_dtype,
                 tokenizer, fingerprint)
        if stopping:
            progress.note(f"stopping at step {step} (checkpoint saved); continue with --resume")
            break
    if run_steps == 0:  # resumed at the end: nothing was left to train
        progress.note(f"nothing to train: already at step {step} of {data.max_steps}")
    progress.close(comm_itemised=t.par.comm_itemised)
    if log is not None:
        log.plot(output / "loss.png")
    return 0


@dataclass
class _Trainee:
    """The model being trained, sharded or replicated, its schedule, and where a resume
    picked up."""

    par: Parallel
    scheduler: Any
    start_step: int
    resumed_from: Path | None
    base_dtype: torch.dtype


def _build_trainee(cfg: FinetuneConfig, d: Dist, output: Path, max_steps: int) -> _Trainee:
    """The model (from the newest checkpoint when resuming) under its strategy, AdamW and
    the schedule, with their state restored when resuming."""
    from transformers import AutoModelForCausalLM

    resumed_from = None
    # After a failure the elastic agent restarts the workers: they continue, not restart.
    if cfg.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resumed_from = ckpt.latest_checkpoint(output, with_train_state=True)
    # ddp/zero1 full fine-tunes resume from the served weights (plus fp32 masters when
    # those are lossy); fsdp restores its fp32 shards and LoRA its adapter over the base.
    sharded_state = Strategy.named(cfg.strategy).saves_sharded_state
    full_weights_saved = not sharded_state and cfg.lora_rank is None
    model_source = (str(resumed_from) if resumed_from is not None and full_weights_saved
                    else cfg.model)
    # fp32 master weights; bf16 autocast (or FSDP's bf16 policy) on GPU for the matmuls.
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_source,
                                                                  dtype=torch.float32)
    torch.nn.Module.to(model, d.device)  # in place (transformers types its `to` too narrowly)
    if cfg.lora_rank is not None:
        from dpserve.finetune import lora

        model = lora.apply_lora(model, cfg)
        if resumed_from is not None and not sharded_state:  # else from its DCP state
            lora.load_adapter_weights(model, resumed_from)
    par = wrap(model, cfg, d)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        par.optimizer, lambda s: lr_at(s, cfg, max_steps))
    start_step = 0
    if resumed_from is not None:
        start_step = load_train_state(output, resumed_from, cfg, par, scheduler, d)
    return _Trainee(par, scheduler, start_step, resumed_from, _config_dtype(cfg.model))


def _step(cfg: FinetuneConfig, d: Dist, t: _Trainee, micro: list[dict[str, torch.Tensor]],
          autocast: Any, probe: MemoryProbe) -> tuple[float, float]:
    """One optimizer step over the micro-batches; (mean loss per loss token, tokens)."""
    par = t.par
    # Loss tokens in the whole step, over all ranks: the normaliser (a sync point).
    counts = torch.tensor([sum(loss_tokens(b) for b in micro),
                           sum(int(b["attention_mask"].sum()) for b in micro)],
                          dtype=torch.float64, device=d.device)
    with par.comm.blocking():
        dist.all_reduce(counts)
    n_loss_tokens, n_tokens = counts.tolist()
    step_loss = torch.zeros((), dtype=torch.float64, device=d.device)
    for i, batch in enumerate(micro):
        # Every strategy averages gradients over ranks; scaling by world_size makes that
        # a sum, normalised by the step's loss tokens.
        with par.accumulating(last=i == len(micro) - 1), probe.micro_batch(i), autocast():
            loss_sum = token_loss_sum(par.forward, batch)
            (loss_sum * d.world_size / max(n_loss_tokens, 1)).backward()
        step_loss += loss_sum.detach().double()
    if cfg.max_grad_norm > 0:
        par.clip_grad_norm(cfg.max_grad_norm)
    par.optimizer.step()
    probe.updated(par.model, par.optimizer)
    par.optimizer.zero_grad(set_to_none=True)
    t.scheduler.step()
    with par.comm.blocking():
        dist.all_reduce(step_loss)
    return float(step_loss) / max(n_loss_tokens, 1), n_tokens


def _announce(cfg: FinetuneConfig, d: Dist, data: RankData, t: _Trainee, global_batch: int
              ) -> None:
    stats = data.stats
    print(f"finetune: {len(data.dataset)} examples ({stats.loss_tokens} loss tokens, "
          f"{stats.skipped_empty} skipped, {stats.truncated} truncated); world size "
          f"{d.world_size} on {d.device.type}, {_describe(cfg)}; global batch {global_batch}"
          f" = micro-batch {cfg.micro_batch_size} x world {d.world_size} x accumulation "
          f"{cfg.grad_accum}; "
          f"{data.steps_per_epoch} steps/epoch; steps {t.start_step}->{data.max_steps}"
          + (f" (resumed from {t.resumed_from.name})" if t.resumed_from else ""), flush=True)


def _describe(cfg: FinetuneConfig) -> str:
    """The strategy in a few words: "fsdp (ZeRO-3), activation checkpointing"."""
    words = [Strategy.named(cfg.strategy).describe(
        reshard_after_forward=cfg.reshard_after_forward)]
    if cfg.lora_rank is not None:
        words.append(f"LoRA rank {cfg.lora_rank} on {cfg.lora_targets}")
    if cfg.activation_checkpointing:
        words.append("activation checkpointing")
    return ", ".join(words)


def _config_dtype(model: str) -> torch.dtype:
    """The dtype the base model is stored in; checkpoints are written the same way."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(model), "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def build_parser() -> argparse.ArgumentParser:
    """The torchrun entry's flags: `dpserve finetune`'s, without the launcher's."""
    parser = argparse.ArgumentParser(
        prog="python -m dpserve.finetune.train",
        description="One rank of a fine-tuning run, under torchrun (`dpserve finetune` "
                    "starts it for you).")
    add_arguments(parser, launcher=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        cfg = build_finetune_config(ns)
    except ConfigError as exc:
        print(f"finetune: invalid configuration: {exc}", file=sys.stderr)
        return 2
    d = setup_distributed(cfg.threads_per_rank)
    try:
        code = train(cfg, d)
    except (DataError, ckpt.CheckpointError) as exc:
        if d.master:
            print(f"finetune: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    # The ranks leave together: one that tears its group down while a peer's transport
    # still talks to it can abort that peer at exit (gloo: "terminate called without an
    # active exception", seen once on rank 1 after a resumed run had saved its last step).
    dist.barrier()
    dist.destroy_process_group()
    return code


def _exit(code: int) -> NoReturn:
    """Leave the worker process without running the interpreter's teardown.

    By then the process group is destroyed, the checkpoint fsynced and renamed, the
    loss curve written. What is left is C++ static destruction, where a library
    thread still joinable aborts the process (std::terminate: "terminate called
    without an active exception", once in six CI runs on a rank that had saved), so
    `dpserve finetune` failed after a successful run. The exit code is the run's."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
