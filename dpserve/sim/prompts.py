"""Prompts as dpserve's simulated engines see them (`protocol.prompt_ids`): their
pseudo-tokenizer and chat template, so that a router studied on the simulated fleet
matches on the token ids the simulated prefix caches hold. It plugs into the router's
prompt tokenizer (`dpserve.router.kv.tokens.PromptTokenizer`) like vLLM's does.
"""

from __future__ import annotations

from typing import Any

from dpserve.router.kv.prompt import Budget, Job, is_json
from dpserve.sim import protocol


class SimPromptEncoder:
    """No cache keys: the pseudo-tokenizer costs ~0.3 ms per 4k tokens, about what a
    cache key of the same prompt would."""

    def prepare(self, route: str, body: dict[str, Any], budget: Budget) -> Job | None:
        kind: protocol.Kind = "chat" if route == "/v1/chat/completions" else "completion"
        if not is_json(body.get("messages" if kind == "chat" else "prompt"), budget):
            return None
        return Job(None, lambda: tuple(protocol.prompt_ids(kind, body)))
