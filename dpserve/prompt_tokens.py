"""Which prompt tokenizer a router uses, picked by what its engines are.

Here rather than in `dpserve.router` because the simulator's encoder lives with the
simulator, which imports the router (its error envelope): the router itself never
imports the simulator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from dpserve.router.kv.prompt import ChatSettings, PromptEncoder
from dpserve.router.kv.tokens import PromptLimits, PromptTokenizer


def open_prompt_tokenizer(engine: Literal["vllm", "sim"], model_dir: str | Path | None = None,
                          *, chat: ChatSettings | None = None,
                          limits: PromptLimits | None = None) -> PromptTokenizer:
    """A tokenizer that reads prompts as the fleet's engines do: ``"vllm"`` loads the
    Hugging Face tokenizer in `model_dir` (a second or so, and transformers' import:
    call it at start-up, before serving), ``"sim"`` uses the simulator's
    pseudo-tokenizer."""
    encoder: PromptEncoder
    if engine == "vllm":
        if model_dir is None:
            raise ValueError("a vllm prompt tokenizer needs the model's directory")
        from dpserve.router.kv.hf import HfPromptEncoder

        encoder = HfPromptEncoder(model_dir, chat)
    elif engine == "sim":
        from dpserve.sim.prompts import SimPromptEncoder

        encoder = SimPromptEncoder()
    else:
        raise ValueError(f"engine must be 'vllm' or 'sim', got {engine!r}")
    return PromptTokenizer(encoder, limits)


def open_named(source: str) -> PromptTokenizer:
    """`--tokenizer`'s value opened: ``sim`` for the simulator's, else a model directory
    of vLLM replicas."""
    return open_prompt_tokenizer("sim") if source == "sim" else open_prompt_tokenizer(
        "vllm", source)
