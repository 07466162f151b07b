"""Helpers of `benchmarks/gpu/check.sh`: what CI (CPU only) cannot check, on a CUDA GPU.

    python -m benchmarks.gpu.check data DIR [--n 256] [--words 12]
    python -m benchmarks.gpu.check nvml FILE             # one scrape of the NVML collector
    python -m benchmarks.gpu.check precision --model M --out FILE.json
    python -m benchmarks.gpu.check check OUTPUT --base M [--lora]
    python -m benchmarks.gpu.check build-model DIR --hidden 1024 --layers 16 ...
    python -m benchmarks.gpu.check bench OUTPUT... --logs LOG...
    python -m benchmarks.gpu.check finetune ARGS...   # `dpserve finetune` minus the CLI

`precision` wraps the model as the trainer does (`strategy.wrap`, `train.autocast_for`)
for every strategy, with and without LoRA, and records the dtypes one step really runs
in (a layer's weight and output, the logits, the gradients), what autograd saved
(`memory.ActivationMeter`, with the autocast weight copies counted apart) beside
`--plan`'s GPU estimate, and the CUDA allocator's peak. `check` validates a finished
`dpserve finetune` output the way a deploy would (`rollout.validate` /
`validate_adapter`) and checks that its loss fell. Every subcommand prints one JSON
object per result, so the driver's log is the report.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.tools import REPO

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def emit(**fields: Any) -> None:
    print("RESULT " + json.dumps(fields, sort_keys=True, default=str), flush=True)


# -- data -------------------------------------------------------------------------------

def write_data(out: Path, n: int, words: int) -> None:
    """Repetitive prompt/completion and chat examples (a loss that must fall fast)."""
    vocab = ("river lamp market sister road rain baker boat quiet morning evening light "
             "stone window garden letter").split()
    out.mkdir(parents=True, exist_ok=True)
    for name, count, offset in (("train.jsonl", n, 0), ("eval.jsonl", max(8, n // 8), n)):
        with (out / name).open("w") as f:
            for i in range(offset, offset + count):
                text = " ".join(vocab[(i * 5 + j * 3) % len(vocab)] for j in range(words))
                if i % 4 == 0:
                    f.write(json.dumps({"messages": [
                        {"role": "user", "content": f"Note {i % 7}?"},
                        {"role": "assistant", "content": text}]}) + "\n")
                else:
                    f.write(json.dumps({"prompt": f"Note {i % 7}:", "completion": " " + text})
                            + "\n")


# -- NVML -------------------------------------------------------------------------------

def scrape_nvml(out: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dpserve.metrics.gpu import GpuCollector, load_nvml

    collector = GpuCollector.open(load_nvml(), replicas=lambda: {0: "r0"})
    if collector is None:
        emit(check="nvml_scrape", ok=False, why="no NVML GPU")
        return
    try:
        registry = CollectorRegistry()
        registry.register(collector)
        text = generate_latest(registry).decode()
    finally:
        collector.close()
    out.write_text(text)
    errors = [line for line in text.splitlines()
              if line.startswith("dpserve_gpu_scrape_errors_total{") and not line.endswith(" 0.0")]
    emit(check="nvml_scrape", ok=not errors, file=str(out), errors=errors,
         samples=sum(1 for line in text.splitlines() if line.startswith("dpserve_gpu_")))


# -- precision and activations, in process ----------------------------------------------

SHAPES: dict[str, dict[str, int]] = {
    # test_plan.py's shapes, where the CPU formula was fitted
    "gqa": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048},
    "wide_vocab": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
                   "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 32000},
    "narrow_vocab": {"hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512},
}


def _cast_counting_meter() -> Any:
    from dpserve.finetune.memory import ActivationMeter

    class CastCountingMeter(ActivationMeter):
        """`ActivationMeter`, also summing apart the autocast copies of trainable weights
        it counts (a saved non-leaf whose autograd edge is a `ToCopyBackward0` of a
        weight): bf16 copies of parameters, held until the backward."""

        def __init__(self) -> None:
            super().__init__()
            self._casts: dict[int, int] = {}

        @property
        def cast_bytes(self) -> int:
            return sum(self._casts.values())

        def _pack(self, t: Any) -> Any:
            base = t._base if t._base is not None else t
            fn = base.grad_fn
            if fn is not None and type(fn).__name__ == "ToCopyBackward0":
                edge = fn.next_functions[0][0] if fn.next_functions else None
                if edge is not None and hasattr(edge, "variable"):  # AccumulateGrad
                    storage = base.untyped_storage()
                    self._casts.setdefault(storage.data_ptr(), storage.nbytes())
            return super()._pack(t)

    return CastCountingMeter


class _Probe:
    """Forward hooks on one decoder layer's down_proj and on the LM head: the dtype of
    the weight the layer computes with and of its output."""

    def __init__(self, model: Any) -> None:
        import torch

        self.seen: dict[str, str] = {}
        down = [m for n, m in model.named_modules()
                if n.endswith("mlp.down_proj") and isinstance(m, torch.nn.Linear)]
        down_base = [m for n, m in model.named_modules()
                     if n.endswith("mlp.down_proj.base_layer")]
        heads = [m for n, m in model.named_modules() if n.endswith("lm_head")]
        self._handles = []
        for name, module in (("down_proj", (down_base or down)[0]), ("lm_head", heads[0])):
            self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            weight = module.weight
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            self.seen.setdefault(f"{name}_weight", str(local.dtype))
            self.seen.setdefault(f"{name}_input", str(args[0].dtype))
            self.seen.setdefault(f"{name}_output", str(output.dtype))
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _allocated(cuda: bool) -> int:
    import torch

    return int(torch.cuda.memory_allocated()) if cuda else 0


def precision(model_dir: str, out: Path, batch: int, seq: int, *, quick: bool = False) -> None:
    import gc
    import tempfile

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from dpserve.finetune import lora
    from dpserve.finetune.config import FinetuneConfig
    from dpserve.finetune.dist import setup_distributed
    from dpserve.finetune.memory import state_bytes
    from dpserve.finetune.plan import Setup, estimate, model_shape
    from dpserve.finetune.sharding import Strategy
    from dpserve.finetune.strategy import wrap
    from dpserve.finetune.train import autocast_for, token_loss_sum

    CastCountingMeter = _cast_counting_meter()
    d = setup_distributed(None)
    cuda = d.device.type == "cuda"
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-shapes-"))
    models = {"tiny": model_dir}
    for name, shape in SHAPES.items():
        LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False,
                    **shape).save_pretrained(tmp / name)
        models[name] = str(tmp / name)
    cases = [("tiny", s, r, ac) for s, r, ac in (
        ("ddp", None, False), ("zero1", None, False), ("fsdp", None, False),
        ("ddp", 8, False), ("fsdp", 8, False), ("ddp", None, True), ("fsdp", None, True))]
    cases += [(m, s, None, ac) for m in SHAPES for s in ("ddp", "fsdp") for ac in (False, True)]
    if quick:  # a dry run on CPU: the script works, nothing more
        cases = cases[:1] + cases[2:3] + cases[4:5]
    for which, strategy, rank, checkpointing in cases:
        path = models[which]
        cfg = FinetuneConfig(model=path, data="", output="", strategy=strategy,
                             lora_rank=rank, activation_checkpointing=checkpointing)
        torch.manual_seed(0)
        if which == "tiny":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                     dtype=torch.float32)
        model.train()
        torch.nn.Module.to(model, d.device)
        if rank is not None:
            model = lora.apply_lora(model, cfg)
        par = wrap(model, cfg, d)
        autocast = autocast_for(cfg, d)
        probe = _Probe(par.model)
        vocab = AutoConfig.from_pretrained(path).vocab_size
        ids = torch.randint(4, min(500, vocab), (batch, seq), device=d.device)
        data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        _sync(cuda)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        before = _allocated(cuda)
        with CastCountingMeter() as saved, autocast():
            loss = token_loss_sum(par.forward, data)
            after_forward = _allocated(cuda)
            (loss / ids.numel()).backward()
        _sync(cuda)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        trained = [p for p in par.model.parameters() if p.grad is not None]
        grad = trained[0].grad
        grad_dtype = str((grad.to_local() if hasattr(grad, "to_local") else grad).dtype)
        master = next(p for p in par.model.parameters() if p.requires_grad)
        master_dtype = str((master.to_local() if hasattr(master, "to_local")
                            else master).dtype)
        par.optimizer.step()
        held = state_bytes(par.model, par.optimizer)
        probe.remove()
        shape = model_shape(path, LORA_TARGETS)
        plan = estimate(shape, Setup(Strategy.named(strategy), 1, batch, seq, gpu=True,
                                     activation_checkpointing=checkpointing, lora_rank=rank))
        row = {"model": which, "strategy": strategy, "lora_rank": rank,
               "checkpointing": checkpointing, "tokens": batch * seq,
               "loss": loss.item() / ids.numel(), "dtypes": probe.seen,
               "grad_dtype": grad_dtype, "master_dtype": master_dtype,
               "saved": saved.peak_bytes, "saved_weight_casts": saved.cast_bytes,
               "plan_activations": plan.activations, "plan_transient": plan.transient,
               "plan_gathered": plan.gathered, "plan_copies": plan.copies,
               "forward_held": after_forward - before, "step_peak": peak - before,
               "state": held, "plan_state": [plan.weights, plan.grads, plan.optimizer]}
        results.append(row)
        emit(check="precision", **row)
        del par, model, probe, loss, trained, grad, master
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    dist.destroy_process_group()


# -- a finished run ---------------------------------------------------------------------

def losses(output: Path) -> list[float]:
    with (output / "loss.csv").open(newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def check_run(output: Path, base: str, *, lora: bool, name: str) -> None:
    from dpserve import checkpoint as ckpt

    out: dict[str, Any] = {"check": "run", "name": name}
    try:
        curve = losses(output)
        head, tail = statistics.mean(curve[:3]), statistics.mean(curve[-3:])
        out.update(steps=len(curve), loss_first=round(head, 4), loss_last=round(tail, 4),
                   loss_fell=tail < 0.8 * head)
        latest = ckpt.latest_checkpoint(output)
        assert latest is not None, "no checkpoint"
        meta = ckpt.verify_checkpoint(latest)
        out.update(checkpoint=latest.name, strategy=meta.extra.get("strategy"))
        if lora:
            from dpserve.rollout.validate_adapter import validate_adapter

            info = validate_adapter(latest, meta, served_base=Path(base),
                                    served_fingerprint=ckpt.base_fingerprint(base),
                                    max_lora_rank=64)
            out.update(validated="adapter", adapter_rank=info.rank)
            merged = ckpt.latest_checkpoint(output / "merged")
            if merged is not None:
                from dpserve.rollout.validate import fingerprint, validate_checkpoint

                validate_checkpoint(merged, fingerprint(Path(base)))
                out.update(merged_validated=merged.name)
        else:
            from dpserve.rollout.validate import fingerprint, validate_checkpoint

            validate_checkpoint(latest, fingerprint(Path(base)))
            out.update(validated="full")
        memory = output / "memory.json"
        if memory.exists():
            rank0 = json.loads(memory.read_text())["ranks"][0]
            out.update(peak_device_mib=round(rank0.get("peak_device", 0) / 2**20, 1),
                       activations_mib=round(rank0["activations"] / 2**20, 2))
        out["ok"] = bool(out["loss_fell"])
    except Exception as exc:  # the report names what failed; the next run goes on
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:800])
    emit(**out)


# -- a bigger random model and its numbers ----------------------------------------------

def build_model(out: Path, tokenizer_from: Path, *, hidden: int, intermediate: int,
                layers: int, heads: int, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=4096,
                         bos_token_id=1, eos_token_id=2, pad_token_id=3,
                         tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).float()
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copyfile(f, out / f.name)
    params = sum(p.numel() for p in model.parameters())
    emit(check="build_model", path=str(out), params=params)


STEP = re.compile(r"([\d,]+) tok/s")


def bench(outputs: list[Path], logs: list[Path]) -> None:
    rows = []
    for output, log in zip(outputs, logs, strict=True):
        with (output / "loss.csv").open(newline="") as f:
            step_s = [float(r["step_s"]) for r in csv.DictReader(f)]
        rank0 = json.loads((output / "memory.json").read_text())["ranks"][0]
        meta = json.loads((output / "memory.json").read_text())
        tok = [float(m.replace(",", "")) for m in STEP.findall(log.read_text())]
        warm = step_s[2:] or step_s
        rows.append({"run": output.name, "strategy": meta["strategy"],
                     "step_ms_median": round(1000 * statistics.median(warm), 1),
                     "tok_s_last_window": tok[-1] if tok else None,
                     "peak_gpu_mib": round(rank0.get("peak_device", 0) / 2**20),
                     "state_mib": round((rank0["weights"] + rank0["grads"]
                                         + rank0["optimizer"]) / 2**20)})
    base = rows[0]
    for row in rows:
        row["vs_" + base["run"]] = {
            "step_time": round(row["step_ms_median"] / base["step_ms_median"], 2),
            "peak_gpu": round(row["peak_gpu_mib"] / max(1, base["peak_gpu_mib"]), 2)}
        emit(check="bench", **row)


def finetune(argv: list[str]) -> int:
    """`dpserve finetune ARGS` without the CLI module, which imports the serving stack
    (uvicorn, starlette) before it dispatches: the same launcher, for a training machine
    that has only the training dependencies."""
    from dpserve.config import ConfigError
    from dpserve.finetune.config import add_arguments, build_finetune_config
    from dpserve.finetune.launch import run_finetune
    from dpserve.finetune.plan import run_plan

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check finetune")
    add_arguments(p, launcher=True)
    ns = p.parse_args(argv)
    try:
        if ns.plan:
            return run_plan(build_finetune_config(ns, plan_only=True), ns.device_memory_gib,
                            ns.plan_device)
        return run_finetune(build_finetune_config(ns))
    except ConfigError as exc:
        print(f"dpserve finetune: invalid configuration: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["finetune"]:
        return finetune(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("data")
    a.add_argument("dir", type=Path)
    a.add_argument("--n", type=int, default=256)
    a.add_argument("--words", type=int, default=12)
    a = sub.add_parser("nvml")
    a.add_argument("file", type=Path)
    a = sub.add_parser("precision")
    a.add_argument("--model", required=True)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--batch", type=int, default=4)
    a.add_argument("--seq", type=int, default=256)
    a.add_argument("--quick", action="store_true", help="three cases only (CPU dry run)")
    a = sub.add_parser("check")
    a.add_argument("output", type=Path)
    a.add_argument("--base", required=True)
    a.add_argument("--lora", action="store_true")
    a.add_argument("--name")
    a = sub.add_parser("build-model")
    a.add_argument("dir", type=Path)
    a.add_argument("--tokenizer-from", type=Path, default=REPO / "build" / "tiny-llama")
    a.add_argument("--hidden", type=int, default=1024)
    a.add_argument("--intermediate", type=int, default=2816)
    a.add_argument("--layers", type=int, default=16)
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--vocab", type=int, default=32000)
    a = sub.add_parser("bench")
    a.add_argument("outputs", type=Path, nargs="+")
    a.add_argument("--logs", type=Path, nargs="+", required=True)
    ns = p.parse_args(argv)
    if ns.cmd == "data":
        write_data(ns.dir, ns.n, ns.words)
    elif ns.cmd == "nvml":
        scrape_nvml(ns.file)
    elif ns.cmd == "precision":
        precision(ns.model, ns.out, ns.batch, ns.seq, quick=ns.quick)
    elif ns.cmd == "check":
        check_run(ns.output, ns.base, lora=ns.lora, name=ns.name or ns.output.name)
    elif ns.cmd == "build-model":
        build_model(ns.dir, ns.tokenizer_from, hidden=ns.hidden, intermediate=ns.intermediate,
                    layers=ns.layers, heads=ns.heads, vocab=ns.vocab)
    elif ns.cmd == "bench":
        bench(ns.outputs, ns.logs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
