"""Running `dpserve finetune` from tests (training tests and the serving check)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from dpserve import checkpoint as ckpt

STEPS = 4
"""Optimizer steps of the one-rank reference run (conftest `world_1_batch_8`) and of
the runs compared with it."""


def write_train_data(path: Path, n: int = 48) -> Path:
    """Deterministic JSONL mixing prompt/completion and chat examples of varied length."""
    subjects = ["the river", "a lamp", "the market", "my sister", "the old road", "rain",
                "the baker", "a small boat"]
    with path.open("w") as f:
        for i in range(n):
            s = subjects[i % len(subjects)]
            if i % 3 == 0:
                f.write(json.dumps({"messages": [
                    {"role": "user", "content": f"Tell me about {s}."},
                    {"role": "assistant", "content": f"Here is a note {i} about {s}."}]}) + "\n")
            else:
                f.write(json.dumps({"prompt": f"Write about {s} ({i}):",
                                    "completion": " " + f"{s} was quiet that day. " * (1 + i % 4)})
                        + "\n")
    return path


def finetune_argv(model: Path, data: Path, output: Path, *, nproc: int, **flags: object,
                  ) -> list[str]:
    """`dpserve finetune` with the tests' fixed hyper-parameters plus `flags`."""
    argv = [sys.executable, "-m", "dpserve", "finetune", "--model", str(model), "--data",
            str(data), "--output", str(output), "--nproc-per-node", str(nproc),
            "--threads-per-rank", "1", "--lr", "1e-3", "--warmup-steps", "1", "--seed", "3"]
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def finetune(model: Path, data: Path, output: Path, *, nproc: int, **flags: object,
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(finetune_argv(model, data, output, nproc=nproc, **flags),
                          capture_output=True, text=True, timeout=300)


def trained(model: Path, data: Path, output: Path, *, nproc: int, **flags: object) -> Path:
    """Fine-tune and return the newest checkpoint; fails the test with the run's output."""
    done = finetune(model, data, output, nproc=nproc, **flags)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    latest = ckpt.latest_checkpoint(output)
    assert latest is not None
    return latest


@dataclass(frozen=True)
class StoppedRun:
    """A run stopped part way, with its training state (tests/finetune/conftest.py)."""

    model: Path
    data: Path
    output: Path

    def listing(self) -> list[str]:
        return sorted(str(p.relative_to(self.output)) for p in self.output.rglob("*"))

    def copy(self, to: Path) -> Path:
        shutil.copytree(self.output, to)
        return to


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt_dir / "model.safetensors"))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def plan_matches(model: Path, memory: dict[str, object], *, within: float = 0.05) -> None:
    """A run's OUTPUT/memory.json (rank 0) against `--plan` for the same settings."""
    from dpserve.finetune.plan import Setup, estimate, model_shape
    from dpserve.finetune.sharding import Strategy

    rank0 = memory["ranks"][0]  # type: ignore[index]
    setup = Setup(strategy=Strategy.named(str(memory["strategy"])),
                  world_size=int(memory["world_size"]), micro_batch=1, seq_len=1, gpu=False,
                  reshard_after_forward=bool(memory["reshard_after_forward"]),
                  lora_rank=memory["lora_rank"])  # type: ignore[arg-type]
    planned = estimate(model_shape(str(model), LORA_TARGETS), setup)
    for key, value in (("weights", planned.weights), ("grads", planned.grads),
                       ("optimizer", planned.optimizer)):
        measured = rank0[key]
        assert abs(value - measured) <= within * measured, (key, value, measured)


def reference_greedy(model_dir: Path, prompt_ids: list[int], new_tokens: int, *,
                     adapter: Path | None = None) -> list[int]:
    """Greedy tokens transformers generates after `prompt_ids` (fp32), with the LoRA
    `adapter` applied unmerged by peft when given: what a served model must answer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens,
                             do_sample=False)
    return out[0, len(prompt_ids):].tolist()
