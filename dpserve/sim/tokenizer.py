"""The simulator's pseudo-tokenizer: cheap, deterministic, no model files.

Rule: **a token is a run of 1 to 4 non-whitespace characters**; whitespace only
separates tokens. A word of up to 4 characters is one token, "tokenizer" is
three (`toke`, `nize`, `r`), so English text comes out at roughly 1.5 tokens per
word, close to a BPE tokenizer's count. Each piece gets an id in
``[0, VOCAB_SIZE)``: a piece of exactly two characters of ``[A-Za-z0-9_-]`` is
its own id (the vocabulary spells every id), any other piece is its CRC-32
modulo the vocabulary size. Ids are the same in every process and on every run,
so prompt lengths and prefix-cache block hashes are reproducible.

`decode` spells each id as its two characters, space-separated, so
``encode(decode(ids)) == ids`` for any ids, and generated text re-encodes to
exactly ``completion_tokens`` tokens. `SimTokenizer` has the Hugging Face
methods that dpserve's load generator uses to build prompts of exact lengths.

Speed matters: prompts are tokenized on the event loop that times the engines,
so a 4,000-token prompt must cost well under a millisecond (about 0.3 ms here).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
_SPELLING = [a + b for a in _ALPHABET for b in _ALPHABET]
_ID = {piece: i for i, piece in enumerate(_SPELLING)}
_PIECE = re.compile(r"\S{1,4}")
VOCAB_SIZE = len(_SPELLING)
"""4,096 ids: every two-character spelling over the 64-character alphabet."""


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens are added)."""
    pieces = _pieces(text)
    ids = list(map(_ID.get, pieces))
    if None in ids:
        ids = [zlib.crc32(p.encode()) % VOCAB_SIZE if i is None else i
               for i, p in zip(ids, pieces, strict=True)]
    return ids  # type: ignore[return-value]


def count(text: str) -> int:
    """Number of tokens of `text`."""
    return len(_pieces(text))


def spell(token_id: int) -> str:
    """The two characters that encode to `token_id`."""
    return _SPELLING[token_id]


def decode(token_ids: Iterable[int]) -> str:
    return " ".join(map(_SPELLING.__getitem__, token_ids))


def output_ids(prompt_ids: Sequence[int], start: int, count: int) -> list[int]:
    """Ids of the simulated model's output tokens `start .. start+count-1` after
    `prompt_ids`: a pure function of the prompt, so the engine (which caches their
    blocks) and the responses (which spell them) agree without passing them around."""
    seed = prompt_ids[0] * 7919 + len(prompt_ids)
    return [(seed + k * 40503) % VOCAB_SIZE for k in range(start, start + count)]


def _pieces(text: str) -> list[str]:
    words = text.split()  # the same whitespace as the regex's \s
    if words and max(map(len, words)) > 4:
        return _PIECE.findall(text)
    return words


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


class SimTokenizer:
    """The pseudo-tokenizer behind the part of Hugging Face's tokenizer interface that
    prompt builders use (`encode`, `decode`, calling it, no special tokens)."""

    vocab_size = VOCAB_SIZE
    all_special_ids: list[int] = []

    def num_special_tokens_to_add(self) -> int:
        return 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return decode(token_ids)

    def __call__(self, text: str) -> Encoding:
        return Encoding(encode(text))
