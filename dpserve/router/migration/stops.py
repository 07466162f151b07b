"""Stop strings across a seam: the router finishes what two engines each half saw.

While a stream with stop strings runs, vLLM holds back the last `len(longest) - 1`
characters of its text (they might begin a stop string), so when the replica breaks
the client has less text than the ids the router replays. The rest, `held`, is the
text of those ids past what the client got: the router asks an engine to detokenize
the ids (`held_text`) and sends it first. And a stop string may straddle the seam
(begun in the old replica's text, ended in the new one's), which the new engine
cannot see: its own stop check starts at its own first character. So on a
continuation the router checks stop strings itself, as vLLM 0.32 does
(`check_stop_strings`: the match that completes earliest wins, ties go to the list's
order; not before `min_tokens`; text cut before the stop string unless
`include_stop_str_in_output`), and holds back text the same way. The continuation is
asked with `include_stop_str_in_output` so its text arrives unheld, in step with its
ids, and the router sees every stop string the moment the token that completes it
comes.

A chunk may carry several tokens (vLLM merges outputs when its reader falls behind):
vLLM would have stopped at the token completing the string and counted none after
it. So where a stop completes in such a chunk, the router learns how many of its
tokens the string needed (`needed`, then `dpserve.router.migration.tracked`: an
engine detokenizes the chunk's ids one more at a time) and drops the rest from the
ids and `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REPLACEMENT = "\ufffd"
"""What a tokenizer prints for bytes that are not a whole UTF-8 character yet."""


def stop_strings(body: dict[str, Any]) -> list[str] | None:
    """The request's stop strings ([] for none), or None if they are not a string or
    a list of strings (vLLM answers that request with an error of its own)."""
    stop = body.get("stop")
    if stop is None or stop == "" or stop == []:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return list(stop)
    return None


@dataclass
class SentText:
    """How much text the client got, and its end (enough to check a seam against)."""

    chars: int = 0
    tail: str = ""
    keep: int = 64

    def add(self, text: str) -> None:
        self.chars += len(text)
        self.tail = (self.tail + text)[-self.keep:]


def held_text(full: str, prompt: str, sent: SentText) -> str | None:
    """The text of the replayed ids the client has not got: `full` is the prompt's
    and those ids' text, `prompt` the prompt's alone (both detokenized by an engine).
    None if they do not line up with what was sent (then the seam cannot be made
    safely)."""
    if not full.startswith(prompt):
        return None
    generated = full[len(prompt):]
    if len(generated) < sent.chars or not generated[:sent.chars].endswith(sent.tail):
        return None
    return generated[sent.chars:]


@dataclass
class StopScan:
    """The stop-string check of a continuation, fed its chunks' text in order."""

    stops: list[str]
    include: bool
    min_tokens: int
    tokens: int
    """Completion tokens before the continuation's first."""
    text: str
    """The end of the stream's text: what the client got (at least the longest stop
    string's length of it) followed by what it did not get yet."""
    unsent: int
    """How many characters at the end of `text` the client did not get yet."""
    needed: int = 0
    """Once a stop string matched: the characters of the last piece up to its end."""

    @classmethod
    def at_seam(cls, stops: list[str], body: dict[str, Any], sent: SentText, held: str,
                tokens: int) -> StopScan:
        min_tokens = body.get("min_tokens")
        return cls(stops=stops, include=body.get("include_stop_str_in_output") is True,
                   min_tokens=min_tokens if isinstance(min_tokens, int) else 0,
                   tokens=tokens, text=sent.tail + held, unsent=len(held))

    @property
    def hold(self) -> int:
        return 0 if self.include else max(len(s) for s in self.stops) - 1

    def feed(self, piece: str, tokens: int, *, finished: bool) -> tuple[str, str | None]:
        """Take one chunk's text (`tokens` ids); return the text the client gets now
        and the stop string that ends the stream here, if one does."""
        self.text += piece
        self.unsent += len(piece)
        self.tokens += tokens
        matched = None
        if piece and self.tokens > self.min_tokens:
            matched = self._match(len(piece))
        if matched is not None:
            stop, at = matched
            self.needed = at + len(stop) - (len(self.text) - len(piece))
            end = at + len(stop) if self.include else at
            start = len(self.text) - self.unsent
            out = self.text[start:max(start, end)]
            self.unsent = 0
            return out, stop
        keep = 0 if finished else min(self.hold, self.unsent)
        out = self.text[len(self.text) - self.unsent:len(self.text) - keep]
        self.unsent = keep
        longest = max(len(s) for s in self.stops)
        self.text = self.text[-(longest + self.unsent):]
        return out, None

    def _match(self, new: int) -> tuple[str, int] | None:
        """vLLM's `check_stop_strings` over the last `new` characters."""
        best: tuple[str, int] | None = None
        best_end = len(self.text) + 1
        for stop in self.stops:
            at = self.text.find(stop, max(0, len(self.text) + 1 - new - len(stop)))
            if at >= 0 and at + len(stop) < best_end:
                best, best_end = (stop, at), at + len(stop)
        return best
