"""Token replay: what it takes to carry a broken stream on to another replica.

With migration on, a streaming completion or chat request that can be continued
(`refusal` is None) is forwarded with vLLM's `return_token_ids`, and its
`StreamState` keeps what the engine reported: the prompt's token ids (with the first
chunk; for chat, the prompt as the engine rendered it from the messages) and every
generated id. If the stream breaks after it started, the rest is asked of another
replica as a completion whose prompt is those ids
(`dpserve.router.migration.continuation`), with `max_tokens`/`min_tokens` reduced by
what was generated and every sampling parameter that means the same there kept. The
new replica prefills that context (no KV cache moves) and goes on; for greedy
decoding it produces exactly the tokens an uninterrupted run would have (checked on
vLLM 0.32, CPU, float32). `StreamState.client_chunk` turns its chunks into the
client's: the same `id`, `created`, `model` and choice index, chat deltas for a chat
request, and a `usage` counting the original prompt and every completion token.

Where the seam goes. vLLM's detokenizer holds back text that does not decode yet
(a UTF-8 character split across tokens, a stray byte waiting for a partner): a
chunk then carries ids but empty text. Replaying such ids makes the new engine's
detokenizer start mid-character; seen on vLLM 0.32, it printed the whole prompt
again. So the seam goes after the last chunk whose text was not empty: there the
text the client has is exactly the text of the ids replayed, and the ids after it
are generated again (for greedy decoding, the same ones).

What does not migrate, and why: `dpserve.router.migration.eligibility`. Stop strings:
`dpserve.router.migration.stops`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from dpserve.router.migration.stops import SentText, StopScan, stop_strings

TOKEN_FIELDS = ("token_ids", "prompt_token_ids")
"""What `return_token_ids` adds to a choice (and to a chat chunk: `prompt_token_ids`,
`prompt_text`); taken out again unless the client asked for them."""

@dataclass
class Seam:
    """One migration, as told in the final chunk and the log."""

    source: str
    target: str
    reason: str
    replayed_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {"from": self.source, "to": self.target, "reason": self.reason,
                "replayed_tokens": self.replayed_tokens}


@dataclass(frozen=True)
class Trim:
    """A chunk of several tokens in which the router's stop check found a stop string
    (`dpserve.router.migration.stops`): vLLM would have stopped at the token that
    completed it."""

    before: int
    """Ids of the stream before the chunk's."""
    ids: list[int]
    needed: int
    """Characters of the chunk's text up to the stop string's end."""
    text: str
    """The chunk's text as the engine sent it."""


@dataclass
class StreamState:
    """One migratable stream as the client has seen it so far."""

    chat: bool
    body: dict[str, Any]
    """The request as the client sent it (model already the engine's name)."""
    wants_ids: bool = False
    """The client asked for `return_token_ids` itself: the ids stay in its chunks."""
    identity: dict[str, Any] = field(default_factory=dict)
    """`id`, `created`, `model` of the first chunk: every later chunk gets them."""
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    synced: int = 0
    """How many of `ids` the client's text covers exactly (see the module's notes)."""
    counted: int = 0
    """Completion tokens generated before the current upstream began (for `usage`)."""
    finish_reason: str | None = None
    done: bool = False
    """A finish reason came (or the engine sent an error): nothing is left to generate."""
    usage_sent: bool = False
    closed: bool = False
    """`[DONE]` went out."""
    pending: bytearray = field(default_factory=bytearray)
    """Events passed on by `client_block`, not read yet (`learn`)."""
    seams: list[Seam] = field(default_factory=list)
    stops: list[str] = field(init=False)
    """The request's stop strings: its text is then read in full (`sent`)."""
    sent: SentText = field(init=False)
    """The text the client got, when there are stop strings."""
    scan: StopScan | None = None
    """The router's own stop-string check, from the first seam on."""
    cut: bool = False
    """The router found a stop string: the stream ends with this chunk."""
    trim: Trim | None = None
    """A stop string completed in a chunk of several tokens: which (`Trim`)."""
    shown: int = 0
    """Ids the client got before the last seam: a continuation does not send them again
    (those generated again after a rewind), to a client that asked for ids."""

    def __post_init__(self) -> None:
        self.stops = stop_strings(self.body) or []
        self.sent = SentText(keep=max([64, *map(len, self.stops)]))

    @property
    def started(self) -> bool:
        return self.prompt_ids is not None

    def client_block(self, block: bytes) -> bytes:
        """A run of the engine's own events as the client gets them: the token ids
        taken out unless asked for, by one pass over vLLM's compact JSON. What they
        teach is read later, many events at a time, and only when needed (`learn`):
        the router's cost per token stays a few microseconds."""
        self.pending += block
        if len(self.pending) >= LEARN_EVERY_BYTES:
            self.learn()
        self.closed = self.closed or block.endswith(_DONE_ENDS)
        if self.wants_ids:
            return block
        if _IDS in block:
            block = _IDS_ANY.sub(b'"token_ids":null', block)
        if _PROMPT_IDS in block:  # the first event's
            block = _PROMPT_IDS_ANY.sub(b'"prompt_token_ids":null', block)
        return block

    def learn(self) -> None:
        """Read the events `client_block` passed on since the last time: the first
        one parsed (its identity and prompt ids), the rest by a few scans of the bytes
        where they are vLLM's compact JSON, else parsed one by one."""
        if not self.pending:
            return
        block = bytes(self.pending)
        self.pending.clear()
        if not self.identity:
            ends = [i + len(e) for e in (b"\n\n", b"\r\n\r\n") if (i := block.find(e)) >= 0]
            cut = min(ends, default=len(block))
            self._parse(block[:cut])
            block = block[cut:]
        if block and not self._scan(block):
            self._parse(block)

    def _parse(self, block: bytes) -> None:
        for event in block.split(b"\n\n"):
            event = event.strip(b"\r\n")
            if event == b"data: [DONE]":
                self.closed = True
            elif event.startswith(b"data: {"):
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    self.done = True
                else:
                    self.client_chunk(chunk, continuation=False)

    def _scan(self, block: bytes) -> bool:
        """`learn` from the bytes; False (nothing learned) where they do not suffice:
        an error, the prompt's ids, a second choice, JSON written with spaces. A key
        cannot appear inside a string value (its quotes are escaped), so a match is
        the field itself."""
        if any(bad in block for bad in _NOT_FAST) or (
                block.count(b'"index":') != block.count(b'"index":0,')):
            return False
        ids = _all_ids(block)
        if ids is None:
            return False
        # The seam may follow the last event that printed text (or finished).
        text_key = _TEXT_CHAT if self.chat else _TEXT
        printed = block.rfind(text_key)
        while printed >= 0 and block[printed + len(text_key)] == 0x22:  # "": none printed
            printed = block.rfind(text_key, 0, printed)
        finished = block.rfind(_FINISHED)
        last = max(printed, finished)
        if last >= 0:
            end = block.find(b"\n\n", last)
            covered = ids if end + 2 == len(block) else _all_ids(block[:end])
            self.synced = len(self.ids) + len(covered or ())
        self.ids += ids
        if self.stops:  # the text the client got, for the seam (`stops`)
            pieces = (_TEXTS_CHAT if self.chat else _TEXTS).findall(block)
            self.sent.add(json.loads(b'"' + b"".join(pieces) + b'"'))
        if finished >= 0:
            at = finished + len(_FINISHED)
            self.finish_reason, self.done = block[at:block.find(b'"', at)].decode("latin-1"), True
        self.usage_sent = self.usage_sent or b'"usage":{' in block
        return True

    def client_chunk(self, chunk: dict[str, Any], *, continuation: bool
                     ) -> dict[str, Any] | None:
        """Learn from one upstream chunk and return it as the client gets it, or None
        if that is as the engine wrote it. On a continuation the chunk is a
        completion's, turned into the client's kind."""
        if not self.identity:
            self.identity = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if not continuation and self.chat and self.prompt_ids is None:
            self.prompt_ids = chunk.get("prompt_token_ids")
        choices = chunk.get("choices") or []
        for choice in choices:
            self._learn(choice, first=not continuation)
        if chunk.get("usage"):
            chunk["usage"] = self.usage(chunk["usage"])
            self.usage_sent = True
        if continuation:
            chunk = self._as_client_kind(chunk)
        elif self.wants_ids or not _has_ids(chunk):
            return None
        if not self.wants_ids:
            for key in ("prompt_token_ids", "prompt_text"):
                if key in chunk:
                    chunk[key] = None
            for choice in chunk.get("choices") or []:
                for key in TOKEN_FIELDS:
                    if key in choice:
                        choice[key] = None
        if self.done and self.seams and chunk.get("choices"):
            chunk["dpserve"] = {"migrations": [s.as_dict() for s in self.seams]}
        return chunk

    def _learn(self, choice: dict[str, Any], *, first: bool) -> None:
        if first and not self.chat and self.prompt_ids is None:
            self.prompt_ids = choice.get("prompt_token_ids")
        new = choice.get("token_ids") or []
        self.ids.extend(new)
        text = (choice.get("delta") or {}).get("content") if self.chat and first else \
            choice.get("text")
        if text:
            self.synced = len(self.ids)
            if first and self.stops:
                self.sent.add(text)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.synced = len(self.ids)
            self.done = True

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """An upstream's `usage` as the client's: its original prompt, and every
        completion token (those before the seam plus the continuation's own). With
        `completion_tokens` 0, what the whole stream used so far."""
        prompt = len(self.prompt_ids or ())
        completion = self.counted + int(usage.get("completion_tokens") or 0)
        if not usage.get("completion_tokens"):
            completion = len(self.ids)
        return usage | {"prompt_tokens": prompt, "completion_tokens": completion,
                        "total_tokens": prompt + completion}

    def usage_so_far(self) -> dict[str, int]:
        prompt, completion = len(self.prompt_ids or ()), len(self.ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _as_client_kind(self, chunk: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.identity)
        out["object"] = "chat.completion.chunk" if self.chat else "text_completion"
        out["choices"] = [self._choice(c) for c in chunk.get("choices") or []]
        for key in ("usage", "system_fingerprint"):
            if chunk.get(key) is not None:
                out[key] = chunk[key]
        return out

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        choice = self._stop_check(choice)
        ids = choice.get("token_ids") or []
        first = len(self.ids) - len(ids)  # the chunk's ids were learned already
        if self.wants_ids and self.shown > first:
            choice = choice | {"token_ids": ids[self.shown - first:]}
        if not self.chat:
            return {k: v for k, v in choice.items() if k != "prompt_token_ids"} | {"index": 0}
        out: dict[str, Any] = {"index": 0, "delta": {"content": choice.get("text") or ""},
                               "logprobs": None, "finish_reason": choice.get("finish_reason")}
        if choice.get("finish_reason") is not None:
            out["stop_reason"] = choice.get("stop_reason")
        if self.wants_ids:
            out["token_ids"] = choice.get("token_ids")
        return out

    def _stop_check(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A continuation's choice after the router's stop-string check: its text as
        the client gets it, and the stream's end if a stop string completed here."""
        if self.scan is None:
            return choice
        finish, engine_stop = choice.get("finish_reason"), choice.get("stop_reason")
        finish_text = choice.get("text") or ""
        out, stop = self.scan.feed(choice.get("text") or "", len(choice.get("token_ids") or ()),
                                   finished=finish is not None)
        if stop is None and finish == "stop" and isinstance(engine_stop, str) and \
                not self.scan.include:  # the engine's own match (the router's sees more)
            out = out.removesuffix(engine_stop)
        choice = choice | {"text": out}
        if stop is not None:
            choice |= {"finish_reason": "stop", "stop_reason": stop}
            self.finish_reason, self.done, self.cut = "stop", True, True
            ids = choice.get("token_ids") or ()
            if len(ids) > 1:  # the tokens after the one completing it: not generated
                self.trim = Trim(len(self.ids) - len(ids), list(ids), self.scan.needed,
                                 finish_text)
        self.sent.add(out)
        return choice

    def keep_of_chunk(self, trim: Trim, kept: int) -> None:
        """Only the first `kept` ids of `trim`'s chunk were generated."""
        del self.ids[trim.before + kept:]
        self.synced = min(self.synced, len(self.ids))

    def drop_last(self) -> None:
        """Replay one id fewer: its text is not a whole character yet."""
        self.ids.pop()
        self.synced = self.counted = len(self.ids)

    def rewind(self, *, keep: bool = False) -> None:
        """Drop the ids after the last synced chunk: they are generated again. With
        `keep` (stop strings: the text of every id is asked of an engine, `stops`), all
        stay. A client that asked for ids has them all already (`shown`)."""
        self.shown = max(self.shown, len(self.ids))
        if keep:
            self.synced = len(self.ids)
        else:
            del self.ids[self.synced:]
        self.counted = len(self.ids)

    def seam(self, source: str, target: str, reason: str) -> Seam:
        seam = Seam(source, target, reason, len(self.prompt_ids or ()) + len(self.ids))
        self.seams.append(seam)
        return seam

    def finish_chunk(self, reason: str) -> dict[str, Any]:
        """The last chunk, written by the router: nothing was left to generate."""
        self.finish_reason, self.done = reason, True
        choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None} if self.chat
                                  else {"index": 0, "text": "", "logprobs": None})
        return self.identity | {
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "choices": [choice | {"finish_reason": reason, "stop_reason": None}]}

    def context_tokens(self) -> int:
        return len(self.prompt_ids or ()) + self.synced


_IDS = b'"token_ids":['
_PROMPT_IDS = b'"prompt_token_ids":['
_FINISHED = b'"finish_reason":"'
_IDS_ANY = re.compile(rb'"token_ids":\[([0-9,]*)\]')
_DONE_ENDS = (b"data: [DONE]\n\n", b"data: [DONE]\r\n\r\n")
_PROMPT_IDS_ANY = re.compile(rb'"prompt_token_ids":\[[0-9,]*\]')
_NOT_FAST = (b'"error"', _PROMPT_IDS, b'": ', b"\r")
"""What the byte scan of `learn` leaves to parsing: an error, the prompt's ids, JSON
written with spaces (or text holding `": `: parsed, to be safe), CRLF line ends."""
LEARN_EVERY_BYTES = 16384
"""Events held unread at most (about 60 tokens): bounded memory per stream."""
_TEXT = b'"text":"'
_TEXT_CHAT = b'"content":"'
_TEXTS = re.compile(rb'"text":"((?:[^"\\]|\\.)*)"')
_TEXTS_CHAT = re.compile(rb'"content":"((?:[^"\\]|\\.)*)"')
"""Each event's text as JSON escapes it (decoded together: one parse for a run)."""


def _all_ids(block: bytes) -> list[int] | None:
    """Every `token_ids` of a run of events, in order; None if one is not a list of
    integers."""
    lists = [x for x in _IDS_ANY.findall(block) if x]
    return _ints(b",".join(lists)) if lists else []


def _ints(data: bytes) -> list[int] | None:
    """`1,2,3` as a list; None if it is not a list of integers."""
    if not data:
        return []
    try:
        return [int(x) for x in data.split(b",")]
    except ValueError:
        return None


def _has_ids(chunk: dict[str, Any]) -> bool:
    return chunk.get("prompt_token_ids") is not None or any(
        c.get(k) is not None for c in chunk.get("choices") or () for k in TOKEN_FIELDS)
