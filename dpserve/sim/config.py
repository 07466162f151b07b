"""Settings of one simulated engine replica, validated once at the edge.

The defaults describe an 8B-parameter model in bf16 on one 40 GB A100-class GPU
served by vLLM with its online-serving defaults: a decode step of ~12 ms plus
0.1 ms per running sequence, prefill at ~20k tokens/s, 2,048 tokens per step
(chunked prefill), 256 sequences at most, room for 160k tokens of KV cache.
Change them to describe another model or GPU; README.md says how to fit them
to a real replica's measurements.

YAML layout (every key optional, the field names below)::

    model: sim-model
    step_base_s: 0.012
    prefill_per_token_s: 0.00005
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dpserve.config.settings import require as _require
from dpserve.config.settings import resolve


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """What one simulated replica serves, how fast its engine steps are and whether it
    publishes its KV-cache events."""

    model: str = "sim-model"
    """Served model name: what `/v1/models` lists and requests must name (or omit)."""
    max_model_len: int = 8192
    """Longest prompt plus completion, in tokens; longer requests get 400 as from vLLM."""
    max_num_seqs: int = 256
    """Most sequences in the running batch (vLLM's `--max-num-seqs`)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one engine step: one per decoding sequence, the rest for prefill
    chunks (vLLM's `--max-num-batched-tokens` with chunked prefill)."""
    kv_cache_tokens: int = 160_000
    """KV-cache capacity in tokens, rounded down to whole blocks. Blocks not held by a
    running sequence form the prefix cache, as in vLLM."""
    block_size: int = 16
    """Tokens per KV block; the prefix cache hashes and matches whole blocks."""
    enable_prefix_caching: bool = True
    """Reuse the KV of cached leading prompt blocks, so they cost no prefill time."""
    step_base_s: float = 0.012
    """Fixed time of every engine step (weights read once per step)."""
    prefill_per_token_s: float = 0.00005
    """Added step time per prompt token computed in the step (cached tokens are free)."""
    decode_per_seq_s: float = 0.0001
    """Added step time per sequence decoding one token in the step."""
    decode_per_context_token_s: float = 0.0
    """Added step time per token of context of each decoding sequence (attention reading
    the KV cache); 0 leaves it out. About 1e-7 for an 8B model on an A100."""
    step_jitter: float = 0.0
    """Relative random spread of step times: each step takes its modelled time times a
    uniform factor in [1 - jitter, 1 + jitter], drawn from a generator seeded by `seed`."""
    seed: int = 0
    """Seed of the jitter generator; replica i of a fleet uses seed + i."""
    lora: list[str] = field(default_factory=list)
    """LoRA adapters loaded at start, each ``NAME`` or ``NAME=PATH`` (the path defaults to
    the name), as vLLM's `--lora-modules`; more are loaded at run time with `POST
    /v1/load_lora_adapter` (adapters.py). Flag `--lora`, repeated."""
    max_loras: int = 1
    """Most distinct adapters in one engine step's batch (vLLM's `--max-loras`, default 1):
    a waiting request under another adapter waits while that many run."""
    kv_events: bool = False
    """Publish the prefix cache's KV-cache events over ZMQ in vLLM's wire format, and their
    endpoints at `GET /kv_event_sources`, as vLLM with `--kv-events-config` (kv_events.py)."""
    kv_events_topic: str = "kv"
    """Topic frame of every event message (vLLM's `topic`)."""
    kv_events_buffer_steps: int = 10_000
    """Latest batches kept for the replay socket (vLLM's `buffer_steps`)."""
    kv_events_hwm: int = 100_000
    """Messages the PUB socket queues per subscriber before it drops them for that
    subscriber (ZMQ's high-water mark, vLLM's `hwm`); 0: no limit."""

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


def build_sim_config(
    flags: Mapping[str, Any] | None = None, file_values: Mapping[str, Any] | None = None
) -> SimConfig:
    """Resolve flags > YAML mapping > defaults, then validate (environment not read)."""
    cfg = resolve(SimConfig, flags or {}, file_values or {}, {}, prefix="")
    validate(cfg)
    return cfg


def validate(c: SimConfig) -> None:
    """Raise ConfigError naming the first setting out of range."""
    _require(bool(c.model.strip()), "model", "must not be empty", c.model)
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
        value = getattr(c, name)
        _require(isinstance(value, int) and value >= 1, name, "must be an integer >= 1", value)
    for name in ("step_base_s", "prefill_per_token_s", "decode_per_seq_s",
                 "decode_per_context_token_s"):
        value = getattr(c, name)
        _require(value >= 0, name, "must be >= 0", value)
    _require(c.step_base_s + c.prefill_per_token_s + c.decode_per_seq_s > 0, "step_base_s",
             "steps must take some time (step_base_s, prefill_per_token_s and "
             "decode_per_seq_s are all 0)", c.step_base_s)
    _require(0 <= c.step_jitter < 1, "step_jitter", "must be in [0, 1)", c.step_jitter)
    _require(isinstance(c.kv_events_buffer_steps, int) and c.kv_events_buffer_steps >= 1,
             "kv_events_buffer_steps", "must be an integer >= 1", c.kv_events_buffer_steps)
    _require(isinstance(c.kv_events_hwm, int) and c.kv_events_hwm >= 0, "kv_events_hwm",
             "must be an integer >= 0", c.kv_events_hwm)
    _require(isinstance(c.max_loras, int) and c.max_loras >= 1, "max_loras",
             "must be an integer >= 1", c.max_loras)
    names = [parse_lora(entry)[0] for entry in c.lora]
    for name in names:
        _require(bool(name), "lora", "each entry must be NAME or NAME=PATH", c.lora)
        _require(name != c.model, "lora", f"adapter {name!r} has the base model's name",
                 c.lora)
    _require(len(set(names)) == len(names), "lora", "adapter names must be unique", c.lora)
    _require(c.num_blocks * c.block_size >= c.max_model_len + c.block_size, "kv_cache_tokens",
             f"must hold at least one request of max_model_len ({c.max_model_len}) tokens "
             "plus one block", c.kv_cache_tokens)


def parse_lora(entry: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); ``NAME`` -> (NAME, NAME). Both stripped."""
    name, _, path = entry.partition("=")
    return name.strip(), path.strip() or name.strip()


def replace(c: SimConfig, **changes: Any) -> SimConfig:
    """A validated copy of `c` with some settings changed."""
    cfg = dataclasses.replace(c, **changes)
    validate(cfg)
    return cfg
