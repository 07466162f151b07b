"""What may migrate: a continuation must be the same request, or it is refused.

What does not migrate, and why (`refusal`; each is counted by reason):
`n`/`best_of` > 1 and beam search (several sequences, one seam each), `echo` (the
prompt would be echoed again), presence and frequency penalties (they count only
generated tokens: replayed ids would become prompt and stop counting), logprobs
and prompt logprobs (not carried across the seam yet), structured output and
tools (the grammar's state and the tool-call parser are not carried), `seed`
with sampling (a seeded run would not repeat), `bad_words` (a multi-token bad
word half-generated at the seam would be missed), several prompts in one request,
multimodal messages (their placeholder ids cannot be replayed without the media),
and prompts given as embeddings. Repetition penalty does migrate: vLLM applies it
to prompt and output tokens alike; so do stop strings (`dpserve.router.migration.stops`).

Every field of vLLM 0.32's request models has a place in `FIELDS` (a test checks it
against the installed vLLM, so a field a new version adds is decided, not dropped):
carried to the continuation, written by the router, spent on the prompt whose ids are
replayed, or refused when set. Fields vLLM does not declare it ignores, and so does
a continuation.
"""

from __future__ import annotations

from typing import Any

from dpserve.router.migration.stops import stop_strings

_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "structured_outputs", "structural_tag",
               "grammar", "json_schema", "regex", "choice")


CARRIED, ROUTER, PROMPT, REFUSED = "carried", "router", "prompt", "refused"
FIELDS: dict[str, str] = {
    **dict.fromkeys((
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
        "ignore_eos", "logit_bias", "allowed_token_ids", "skip_special_tokens",
        "spaces_between_special_tokens", "stream_options", "stream_interval", "user",
        "priority", "cache_salt", "seed", "return_tokens_as_token_ids", "session_id",
        "length_penalty"), CARRIED),
    # The continuation's own: the ids so far, what is left of the limits, the stop
    # strings the router checks across the seam, the first leg's id (`replay`).
    **dict.fromkeys((
        "model", "stream", "prompt", "messages", "max_tokens", "max_completion_tokens",
        "min_tokens", "stop", "include_stop_str_in_output", "return_token_ids",
        "request_id"), ROUTER),
    # Spent on rendering and tokenizing the prompt, whose ids are replayed as they are
    # (tools with `tool_choice` "none" are rendered and never parsed; media is refused;
    # the render endpoint's payload options change nothing generated).
    **dict.fromkeys((
        "add_special_tokens", "add_generation_prompt", "chat_template",
        "chat_template_kwargs", "continue_final_message", "documents", "reasoning_effort",
        "truncate_prompt_tokens", "truncation_side", "mm_processor_kwargs",
        "media_io_kwargs", "mm_payload", "return_mm_kwargs", "return_prompt_text",
        "tools", "tool_choice", "parallel_tool_calls"), PROMPT),
    **dict.fromkeys((
        "n", "use_beam_search", "echo", "presence_penalty", "frequency_penalty", "logprobs",
        "top_logprobs", "prompt_logprobs", "logprob_token_ids", "response_format",
        "structured_outputs", "bad_words", "prompt_embeds", "suffix", "repetition_detection",
        "watermarking", "thinking_token_budget", "include_reasoning", "vllm_xargs",
        "kv_transfer_params", "ec_transfer_params", "return_token_offsets",
        "routed_experts_prompt_start"), REFUSED),
}
"""What a continuation does with each field of vLLM 0.32's `CompletionRequest` and
`ChatCompletionRequest`."""

_UNCARRIED: dict[str, str] = {
    "logprob_token_ids": "logprobs",
    # State built from the generated tokens, which the replay turns into prompt.
    "repetition_detection": "generation_state", "watermarking": "generation_state",
    "thinking_token_budget": "generation_state",
    "vllm_xargs": "vllm_xargs",  # custom extensions: their meaning is unknown here
    "kv_transfer_params": "kv_transfer", "ec_transfer_params": "kv_transfer",
    "return_token_offsets": "output_fields", "routed_experts_prompt_start": "output_fields",
}
"""Fields refused when set (not null, false, empty, or their default), with the reason."""
_UNSET_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "thinking_token_budget": (-1,), "routed_experts_prompt_start": (0,)}


def refusal(body: dict[str, Any], *, chat: bool) -> str | None:
    """Why a streaming request could not be continued elsewhere as the same request
    (a short reason, the metric's label), or None if it can."""
    if _more_than_one(body.get("n")) or _more_than_one(body.get("best_of")):
        return "n"
    if body.get("use_beam_search"):
        return "beam_search"
    if body.get("echo"):
        return "echo"
    if _nonzero(body.get("presence_penalty")) or _nonzero(body.get("frequency_penalty")):
        return "penalties"
    logprobs = body.get("logprobs")  # completions: 0 asks for the chosen token's
    if ((logprobs is not None and logprobs is not False) or body.get("top_logprobs")
            or body.get("prompt_logprobs") is not None):
        return "logprobs"
    response_format = body.get("response_format")
    if ((isinstance(response_format, dict) and response_format.get("type") not in (None, "text"))
            or any(body.get(k) is not None for k in _STRUCTURED)):
        return "structured_output"
    if (body.get("tools") and body.get("tool_choice") != "none") or body.get("functions"):
        return "tools"
    if body.get("seed") is not None and body.get("temperature", 1.0) != 0:
        return "seed"
    if body.get("bad_words"):
        return "bad_words"
    if stop_strings(body) is None:  # not text: vLLM refuses the request itself
        return "stop_strings"
    if body.get("prompt_embeds") is not None or body.get("suffix"):
        return "unsupported_prompt"
    for name, reason in _UNCARRIED.items():
        if _is_set(name, body.get(name)):
            return reason
    if chat and body.get("include_reasoning", True) is not True:
        return "reasoning"  # the engine would strip what a continuation sends as text
    if chat:
        if _multimodal(body.get("messages")):
            return "multimodal"
    elif not _single_prompt(body.get("prompt")):
        return "several_prompts"
    return None


def _is_set(name: str, value: Any) -> bool:
    """Whether a field asks for something: not null, false, empty or its default (0 is
    a set budget; `False == 0` is not taken for it)."""
    if value is None or value is False or (isinstance(value, (dict, list)) and not value):
        return False
    return not any(type(value) is type(d) and value == d
                   for d in _UNSET_DEFAULTS.get(name, ()))


def _more_than_one(value: Any) -> bool:
    return isinstance(value, int) and value > 1


def _nonzero(value: Any) -> bool:
    return isinstance(value, (int, float)) and value != 0


def _single_prompt(prompt: Any) -> bool:
    """One text, or one list of token ids (not a batch of either)."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list):
        return (len(prompt) == 1 and isinstance(prompt[0], (str, list))) or all(
            isinstance(t, int) for t in prompt)
    return False


_TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                         "tool_reference"})
"""Message content parts vLLM 0.32 reads as text (`renderers.chat_utils`)."""
_MEDIA_KEYS = frozenset({"image_url", "input_image", "image_pil", "image_embeds", "audio_url",
                         "input_audio", "audio_embeds", "video_url", "video_embeds",
                         "prompt_embeds"})
"""Keys that make a content part media whatever its `type`: without one, vLLM takes
the part's kind from them (`{"image_url": ...}` is an image)."""


def _multimodal(messages: Any) -> bool:
    """Whether a message has a part that is not text, as vLLM 0.32 tells
    (`has_non_text_content`): a media key, or a type it does not read as text."""
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and _media(p) for p in m["content"])
               for m in messages)


def _media(part: dict[str, Any]) -> bool:
    kind = part.get("type", "text")
    return (not isinstance(kind, str) or kind not in _TEXT_PARTS
            or any(key in part for key in _MEDIA_KEYS))


