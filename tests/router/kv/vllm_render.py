"""vLLM's own prompt rendering, offline: the reference the router's prompt tokenizer is
held to. vLLM 0.32 ships a GPU-less render server (`vllm launch render`); its
`OnlineRenderer` is built here the way that server builds it, from the model directory
alone (no engine, no sockets), and given requests as vLLM's API server validates them."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

Rendered = tuple[int, ...] | str
"""The prompt's token ids, or why vLLM refused the request."""


class VllmRenderer:
    def __init__(self, model_dir: Path, chat_template: str | None = None,
                 default_chat_template_kwargs: dict[str, Any] | None = None) -> None:
        pytest.importorskip("vllm")
        from vllm.config import VllmConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        model_config = AsyncEngineArgs(model=str(model_dir)).create_model_config()
        self._renderer = OnlineRenderer(
            model_config=model_config,
            renderer=renderer_from_config(VllmConfig(model_config=model_config)),
            request_logger=None, chat_template=chat_template,
            chat_template_content_format="auto", trust_request_chat_template=False,
            default_chat_template_kwargs=default_chat_template_kwargs,
            # As `--enable-auto-tool-choice --tool-call-parser hermes`: tool choices other
            # than "none" are served, and render the same prompt.
            enable_auto_tools=True, tool_parser="hermes")
        self._loop = asyncio.new_event_loop()

    def close(self) -> None:
        self._loop.close()

    def render(self, route: str, body: dict[str, Any]) -> Rendered:
        return self._loop.run_until_complete(self._render(route, copy.deepcopy(body)))

    async def _render(self, route: str, body: dict[str, Any]) -> Rendered:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        try:
            if route == "/v1/chat/completions":
                result = await self._renderer.render_chat(
                    ChatCompletionRequest.model_validate(body))
                inputs = result if isinstance(result, ErrorResponse) else result[1]
            else:
                inputs = await self._renderer.render_completion(
                    CompletionRequest.model_validate(body))
        except Exception as e:  # validation, template errors: vLLM answers 400
            return f"{type(e).__name__}: {e}"
        if isinstance(inputs, ErrorResponse):
            return inputs.error.message
        if len(inputs) != 1:
            return f"{len(inputs)} prompts"
        return tuple(inputs[0]["prompt_token_ids"])
