"""When a failed attempt may be tried again, where, and after how long.

A retry is only safe while the client has seen nothing: once a byte of the
response went out, a second attempt would splice two different generations
into one answer. Before that, every forwarded route may be retried, because
none has side effects on the replica (completions, embeddings and
tokenization compute; they store nothing).

Pure functions, so the proxy's retry loop is tested with jitter off and a
seeded random source.
"""

from __future__ import annotations

import random

from dpserve.router.fleet.breaker import Outcome

RETRYABLE_STATUSES = frozenset({502, 503, 504})
"""A gateway or overload answer from the replica's side: another replica may
well serve. A 500 is not among them — it is usually the request itself
tripping the engine, and would fail the same way elsewhere."""

_ALWAYS = frozenset({Outcome.CONNECT_FAILED, Outcome.CONNECT_TIMEOUT, Outcome.DISCONNECTED})


def is_retryable(outcome: Outcome, *, status: int | None = None, bytes_sent_to_client: bool,
                 stream: bool) -> bool:
    """Whether an attempt that ended in `outcome` (with response `status`, if any)
    may be repeated, on another replica.

    Never once a byte reached the client. Before that: connection failures,
    connect timeouts and dropped connections always; a 502, 503 or 504; and a
    timeout waiting for the response only when not streaming — vLLM answers a
    streaming request's headers at once, so a stream that times out before its
    first token was accepted by a replica that is slow, not broken, and its
    twin would queue just the same. (A stream whose *headers* do not come within
    the stream idle timeout met a stuck server: the proxy retries that itself.)
    """
    if bytes_sent_to_client:
        return False
    if outcome in _ALWAYS:
        return True
    if outcome is Outcome.SERVER_ERROR:
        return status in RETRYABLE_STATUSES
    if outcome is Outcome.TIMEOUT:
        return not stream
    return False


def backoff(attempt: int, *, base: float = 0.05, cap: float = 2.0, jitter: bool = True,
            rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1 for the first retry).

    Exponential, `base * 2**(attempt - 1)`, at most `cap`; with `jitter`, a
    uniform draw from zero to that ("full jitter"), so clients that failed
    together do not come back together.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    delay = min(cap, base * 2.0 ** min(attempt - 1, 64))
    if not jitter:
        return delay
    return (rng or random).uniform(0.0, delay)
