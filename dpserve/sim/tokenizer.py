"""The simulator's pseudo-tokenizer: cheap, deterministic, no model files.

Rule: **a token is a run of 1 to 4 non-whitespace characters**; whitespace only
separates tokens. A word of up to 4 characters is one token, "tokenizer" is
three (`toke`, `nize`, `r`), so English text comes out at roughly 1.5 tokens per
word, close to a BPE tokenizer's count. Each piece gets an id in
``[0, VOCAB_SIZE)``: a piece of exactly three characters of ``[A-Za-z0-9_-]``
reads as a base-64 number (so the vocabulary spells every id), any other piece
is its CRC-32 modulo the vocabulary size. Ids are the same in every process and
on every run, so prompt lengths and prefix-cache block hashes are reproducible.

`decode` spells each id as its three characters, space-separated, so
``encode(decode(ids)) == ids`` for any ids, and generated text re-encodes to
exactly ``completion_tokens`` tokens. `SimTokenizer` has the Hugging Face
methods that dpserve's load generator uses to build prompts of exact lengths.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
_DIGIT = {c: i for i, c in enumerate(_ALPHABET)}
_PIECE = re.compile(r"\S{1,4}")
VOCAB_SIZE = len(_ALPHABET) ** 3
"""262,144 ids: every three-character spelling over the 64-character alphabet."""


def encode(text: str) -> list[int]:
    """Token ids of `text` (no special tokens are added)."""
    return [_piece_id(p) for p in _PIECE.findall(text)]


def count(text: str) -> int:
    """Number of tokens of `text`, without building the ids."""
    return sum(1 for _ in _PIECE.finditer(text))


def spell(token_id: int) -> str:
    """The three characters that encode to `token_id`."""
    return _ALPHABET[token_id >> 12] + _ALPHABET[(token_id >> 6) & 63] + _ALPHABET[token_id & 63]


def decode(token_ids: Iterable[int]) -> str:
    return " ".join(spell(t) for t in token_ids)


def _piece_id(piece: str) -> int:
    if len(piece) == 3:
        a, b, c = (_DIGIT.get(ch) for ch in piece)
        if a is not None and b is not None and c is not None:
            return (a << 12) | (b << 6) | c
    return zlib.crc32(piece.encode()) % VOCAB_SIZE


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
