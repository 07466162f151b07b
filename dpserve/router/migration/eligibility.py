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
"""

from __future__ import annotations

from typing import Any

from dpserve.router.migration.stops import stop_strings

_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "structured_outputs", "structural_tag",
               "grammar", "json_schema", "regex", "choice")


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
    if chat:
        if _multimodal(body.get("messages")):
            return "multimodal"
    elif not _single_prompt(body.get("prompt")):
        return "several_prompts"
    return None


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


