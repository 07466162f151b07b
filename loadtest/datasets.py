"""Prompts to send: synthetic (`random`), a JSONL file, or a ShareGPT JSON file.

Every workload is a pure function of its settings and seed: the same seed and
tokenizer give the same prompts, in the same order. Construction and filtering
follow vLLM's benchmark datasets (`vllm/benchmarks/datasets/datasets.py`,
version 0.32) so that results can be compared with `vllm bench serve`:

- **random**: per request an input length drawn uniformly from
  ``[floor(L*(1-r)), ceil(L*(1+r))]`` with ``L = input_len - special tokens
  the tokenizer adds``, an output length from ``[max(1, floor(O*(1-r))),
  max(1, ceil(O*(1+r)))]``, and a vocabulary offset; the prompt is a shared
  random prefix of ``prefix_len`` tokens followed by consecutive non-special
  token ids from the offset, decoded to text and re-encoded (up to 10 rounds,
  padding with random ids or truncating) until it is the wanted number of
  tokens. Numbers come from ``numpy.random.default_rng(seed)``.
- **jsonl**: one object per line with a ``"prompt"`` string and an optional
  ``"output_tokens"`` integer; shuffled by the seed (unless ``shuffle=False``).
- **sharegpt**: entries with at least two ``conversations`` turns, shuffled by
  the seed; the first turn is the prompt and the second's token count is the
  output length; pairs with fewer than 4 prompt or output tokens, a prompt
  over 1024 tokens or a total over 2048 are skipped (the output check is off
  when the output length is fixed).

When a file holds fewer usable prompts than asked for, prompts are drawn again
from it at random (seeded) until there are enough, as vLLM does.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from loadtest.errors import DatasetError

DEFAULT_JSONL_OUTPUT_LEN = 256
"""Output tokens of a JSONL prompt without ``output_tokens`` (vLLM's ``--custom-output-len``)."""

_REFIT_ROUNDS = 10


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    prompt_len: int
    """Prompt tokens counted on the client; 0 when not counted. The server's
    ``usage.prompt_tokens`` replaces it in the results when reported."""
    output_len: int
    """Output tokens asked for (``max_tokens``)."""


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the datasets use."""

    vocab_size: int
    all_special_ids: list[int]

    def num_special_tokens_to_add(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def __call__(self, text: str) -> Any: ...


def load_tokenizer(path: Path) -> Tokenizer:
    """The model's own tokenizer, from a local directory (no download)."""
    if not Path(path).is_dir():
        raise DatasetError(f"--tokenizer {path}: not a directory with tokenizer files")
    from transformers import AutoTokenizer  # heavy; only when a tokenizer is needed

    try:
        return cast(Tokenizer, AutoTokenizer.from_pretrained(str(path), local_files_only=True))
    except (OSError, ValueError) as exc:
        raise DatasetError(f"--tokenizer {path}: cannot load a tokenizer: {exc}") from None


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Tokens of ``text`` as the server would count a prompt (special tokens included)."""
    return len(tokenizer(text).input_ids)


# --- random ---------------------------------------------------------------------------------


def random_prompts(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> list[Prompt]:
    """Synthetic prompts of known token lengths (see the module docstring)."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    real_input_len = max(0, input_len - int(tokenizer.num_special_tokens_to_add()))
    in_low = math.floor(real_input_len * (1 - range_ratio))
    in_high = math.ceil(real_input_len * (1 + range_ratio))
    out_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if prefix_len + in_low < 1:
        raise DatasetError(
            f"--random-input-len {input_len} is too small: with the tokenizer's special tokens"
            f" and range ratio {range_ratio} a prompt could have no tokens")
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)

    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.all_special_ids)
    prefix: list[int] = []
    if prefix_len > 0:
        prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
        _, prefix = _fit_to_length(tokenizer, prefix, prefix_len, rng)

    prompts = []
    for i in range(num_prompts):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)]
        target = prefix_len + int(input_lens[i])
        text, ids = _fit_to_length(tokenizer, prefix + inner.tolist(), target, rng)
        prompts.append(Prompt(text, len(ids), int(output_lens[i])))
    return prompts


def _fit_to_length(
    tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator
) -> tuple[str, list[int]]:
    """Decode ``ids`` and re-encode, padding or truncating, until the text is ``target``
    tokens long (a decode-encode round trip need not keep the count). After the last
    round the text may still be off by a few tokens; the returned ids are its encoding."""
    for round_ in range(_REFIT_ROUNDS + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if round_ == _REFIT_ROUNDS or len(ids) == target:
            break
        if len(ids) < target:
            ids.extend(rng.integers(0, tokenizer.vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
    return text, ids


# --- files ----------------------------------------------------------------------------------


def jsonl_prompts(
    path: Path,
    *,
    num_prompts: int,
    output_len: int | None = None,
    tokenizer: Tokenizer | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> list[Prompt]:
    """Prompts from a JSONL file. ``output_len`` overrides each line's ``output_tokens``;
    without either, a prompt asks for 256 tokens. Prompt tokens are counted only with a
    tokenizer (the server's usage count is used in the results either way)."""
    rows = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DatasetError(f'{path}:{lineno}: expected an object with a "prompt" string')
        wanted = row.get("output_tokens", DEFAULT_JSONL_OUTPUT_LEN)
        if output_len is None and (not isinstance(wanted, int) or wanted < 1):
            raise DatasetError(f"{path}:{lineno}: output_tokens must be a positive integer")
        rows.append((row["prompt"], output_len or wanted))
    if shuffle:
        random.Random(seed).shuffle(rows)
    prompts = [Prompt(text, count_tokens(tokenizer, text) if tokenizer else 0, out)
               for text, out in rows[:num_prompts]]
    return _oversample(prompts, num_prompts, seed, path)


def sharegpt_prompts(
    path: Path,
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    output_len: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> list[Prompt]:
    """Prompts from a ShareGPT-format JSON file, filtered as vLLM's benchmark does."""
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations")
    entries = [e for e in data
               if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2]
    if shuffle:
        random.Random(seed).shuffle(entries)
    prompts: list[Prompt] = []
    for entry in entries:
        if len(prompts) >= num_prompts:
            break
        prompt, completion = (_turn_text(turn) for turn in entry["conversations"][:2])
        if prompt is None or completion is None:
            continue
        prompt_len = count_tokens(tokenizer, prompt)
        wanted = count_tokens(tokenizer, completion) if output_len is None else output_len
        if _is_valid_pair(prompt_len, wanted, check_output=output_len is None):
            prompts.append(Prompt(prompt, prompt_len, wanted))
    return _oversample(prompts, num_prompts, seed, path)


def _turn_text(turn: object) -> str | None:
    text = turn.get("value") if isinstance(turn, dict) else None
    return text if isinstance(text, str) else None


def _is_valid_pair(prompt_len: int, output_len: int, *, check_output: bool) -> bool:
    return not (prompt_len < 4 or (check_output and output_len < 4)
                or prompt_len > 1024 or prompt_len + output_len > 2048)


def _oversample(prompts: list[Prompt], num_prompts: int, seed: int, path: Path) -> list[Prompt]:
    if not prompts:
        raise DatasetError(f"{path}: no usable prompts")
    if len(prompts) < num_prompts:
        rng = random.Random(seed)
        prompts += [rng.choice(prompts) for _ in range(num_prompts - len(prompts))]
    return prompts


def _read_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"{path}: {exc.strerror or exc}") from None


def cycle(prompts: Sequence[Prompt], n: int) -> list[Prompt]:
    """``n`` prompts, going round ``prompts`` again when there are fewer."""
    return [prompts[i % len(prompts)] for i in range(n)]
