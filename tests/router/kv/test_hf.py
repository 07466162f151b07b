"""The router's prompt token ids equal vLLM's own, token for token.

The reference is vLLM 0.32's renderer (`vllm_render.py`), fed the same bodies, on the
tiny model's tokenizer and three chat templates: the model's own (content as one
string), one that renders tools, tool calls, reasoning, documents and extra template
arguments as JSON, and one that loops over content parts and knows the developer role.
Where the router answers None it declines to route by prefix, which is always safe; a
wrong non-None answer is the failure these tests look for. Hypothesis then throws
generated bodies, odd ones included, at both.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.kv.hf import HfPromptEncoder
from dpserve.router.kv.prompt import Budget, ChatSettings, TokenIds
from tests.router.kv.chat_templates import PARTS_TEMPLATE, TOOLS_TEMPLATE
from tests.router.kv.vllm_render import VllmRenderer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

TEMPLATES = {"model's": None, "tools": TOOLS_TEMPLATE, "parts": PARTS_TEMPLATE}


class Pair:
    """The router's encoder and vLLM's renderer, set up alike."""

    def __init__(self, model_dir: Path, template: str | None) -> None:
        self.ours = HfPromptEncoder(model_dir, ChatSettings(chat_template=template))
        self.vllm = VllmRenderer(model_dir, chat_template=template)

    def tokens(self, route: str, body: dict[str, Any]) -> TokenIds | None:
        job = self.ours.prepare(route, body, Budget(1 << 20, 1 << 17))
        if job is None:
            return None
        try:
            return job.run()
        except Exception:
            return None

    def check(self, route: str, body: dict[str, Any], *, routed: bool = False) -> None:
        """Where vLLM renders `body`, our ids are its ids, or None (not routed by prefix)
        unless `routed`. Where vLLM refuses it, any answer is harmless: the request fails
        wherever it goes."""
        ours = self.tokens(route, body)
        theirs = self.vllm.render(route, body)
        if routed:
            assert isinstance(theirs, tuple), theirs
            assert ours == theirs, body
        elif isinstance(theirs, tuple) and ours is not None:
            assert ours == theirs, body


@pytest.fixture(scope="module")
def pairs(tiny_model: Path) -> Iterator[dict[str, Pair]]:
    made = {name: Pair(tiny_model, template) for name, template in TEMPLATES.items()}
    yield made
    for pair in made.values():
        pair.vllm.close()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


COMPLETION_BODIES = [
    {"prompt": "Hello world, routing by prefix."},
    {"prompt": "no BOS here", "add_special_tokens": False},
    {"prompt": ["a batch of one </s> with an EOS spelled out"]},
    {"prompt": [1, 5, 300, 2]},
    {"prompt": [[7, 8, 9]]},
    {"prompt": "  leading spaces, tabs\t, newlines\n\nand ünïcödé 日本語 🙂"},
]
CHAT_BODIES = [
    {"messages": [user("hi")]},
    {"messages": [{"role": "system", "content": "Be brief."}, user("What is 2+2?"),
                  {"role": "assistant", "content": "4"}, user("And 3+3?")]},
    {"messages": [user("go on"), {"role": "assistant", "content": "Once upon"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [user("no generation prompt")], "add_generation_prompt": False},
    {"messages": [user("with BOS twice")], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                {"type": "input_text", "text": "two"}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"},
                                                     {"type": "thinking",
                                                      "thinking": "hmm", "closed": True}]}]},
    {"messages": [{"role": "developer", "content": "dev rules"}, user("hi"),
                  {"role": "system", "content": "late system"}]},
    {"messages": [{"role": "system", "content": "x-anthropic-billing-header: cch=9\nreal"},
                  user("hi")]},
    {"messages": [user("weather?"),
                  {"role": "assistant", "content": None, "reasoning_content": "call it",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "get", "arguments": '{"city":"X"}'}}]},
                  {"role": "tool", "content": [{"type": "text", "text": "sunny"}],
                   "tool_call_id": "c1"}],
     "tools": [{"type": "function", "function": {
         "name": "get", "description": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}]},
    {"messages": [user("hi"), {"role": "assistant", "content": "ok", "name": "bot",
                               "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": "[1]"}}]}],
     "tools": [{"function": {"name": "f", "strict": True}}], "tool_choice": "none"},
    {"messages": [user("cite")], "documents": [{"title": "t", "text": "body"}],
     "reasoning_effort": "low"},
    {"messages": [user("kwargs")], "chat_template_kwargs": {
        "custom_flag": {"a": [1, 2.5, None, True]}, "enable_thinking": False,
        "unused": "x", "add_generation_prompt": False}},
    {"messages": [user("auto is unset")], "chat_template_kwargs": {"custom_flag": "auto"}},
    {"messages": [{"role": "narrator", "content": "a custom role"}, user("hi")]},
]


@pytest.mark.parametrize("body", COMPLETION_BODIES, ids=range(len(COMPLETION_BODIES)))
def test_a_completion_prompt_has_vllms_token_ids(pairs, body):
    pairs["model's"].check(COMPLETIONS, body, routed=True)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("body", CHAT_BODIES, ids=range(len(CHAT_BODIES)))
def test_chat_messages_have_vllms_token_ids(pairs, template, body):
    pairs[template].check(CHAT, body, routed=True)


def test_tools_rendered_by_the_template_are_vllms_dump(pairs):
    body = CHAT_BODIES[9]
    pairs["tools"].check(CHAT, body, routed=True)
    assert len(pairs["tools"].tokens(CHAT, body) or ()) > len(
        pairs["model's"].tokens(CHAT, body) or ())


def test_a_template_that_raises_gives_none(tiny_model):
    broken = HfPromptEncoder(tiny_model, ChatSettings(
        chat_template="{{ raise_exception('no system messages') }}"))
    job = broken.prepare(CHAT, {"messages": [user("hi")]}, Budget(1000, 100))
    assert job is not None
    with pytest.raises(Exception, match="no system messages"):
        job.run()  # PromptTokenizer turns this into None


@pytest.mark.parametrize(("route", "body"), [
    (COMPLETIONS, {"prompt": ["two", "prompts"]}),
    (COMPLETIONS, {"prompt": [[1], [2]]}),
    (COMPLETIONS, {"prompt": "fim", "suffix": "tail"}),
    (COMPLETIONS, {"prompt": "salted", "cache_salt": "s"}),
    (COMPLETIONS, {"prompt": "cut", "truncate_prompt_tokens": 3}),
    (COMPLETIONS, {"prompt": "x", "add_special_tokens": "true"}),
    (COMPLETIONS, {"prompt": [1, True, 3]}),
    (COMPLETIONS, {"prompt": [1, -2]}),
    (COMPLETIONS, {"prompt": []}),
    (COMPLETIONS, {"prompt_embeds": "AAAA"}),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "video", "text": "x"}]}]}),
    (CHAT, {"messages": [user("own template")], "chat_template": "{{ messages }}"}),
    (CHAT, {"messages": [user("x")], "chat_template_kwargs": {"chat_template": "t"}}),
    (CHAT, {"messages": [user("x")], "chat_template_kwargs": {"tokenize": True}}),
    (CHAT, {"messages": [user("x")], "add_generation_prompt": True,
            "continue_final_message": True}),
    (CHAT, {"messages": []}),
    (CHAT, {"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}),
    (CHAT, {"messages": [{"role": 3, "content": "x"}]}),
    (CHAT, {"messages": [user("x")], "reasoning_effort": "extreme"}),
    (CHAT, {"messages": [user("x")], "tools": [{"type": "custom", "custom": {}}]}),
])
def test_what_cannot_be_rendered_exactly_gives_none(pairs, route, body):
    assert pairs["model's"].tokens(route, body) is None


# --- generated bodies ------------------------------------------------------------------

PIECES = ["a", "b", " ", "\n", "é", "日本", "🙂", "</s>", "<s>", "<|user|>", "{{ x }}",
          "x-anthropic-billing-header: 1\n", "\\u0000", '"', "auto"]
texts = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
parts = st.one_of(
    texts,
    st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text"]),
                           "text": texts}),
    st.fixed_dictionaries({"type": st.just("refusal"), "refusal": texts}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": texts},
                          optional={"closed": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("text")}, optional={"text": st.none()}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.just({"url": "http://x/a.png"})}),
    st.fixed_dictionaries({"type": st.sampled_from(["bogus", 3])}),
    st.just({"text": "untyped"}),
)
contents = st.one_of(st.none(), texts, st.lists(parts, max_size=3), st.integers())
calls = st.lists(st.fixed_dictionaries({
    "id": texts, "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": texts, "arguments": st.sampled_from(
        ["", "{}", '{"a": 1}', "[1]", "not json", '{"b": {"c": [true]}}'])})}), max_size=2)
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "narrator"]),
     "content": contents},
    optional={"name": st.one_of(texts, st.none()), "reasoning_content": texts,
              "reasoning": st.one_of(texts, st.none()), "tool_calls": st.one_of(calls, st.none()),
              "tool_call_id": st.one_of(texts, st.none()), "extra": st.just(1)})
tools = st.lists(st.fixed_dictionaries(
    {"type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts}, optional={
         "description": st.one_of(texts, st.none()), "strict": st.one_of(st.booleans(), st.none()),
         "parameters": st.one_of(st.none(), st.just({"type": "object", "properties": {}}))})}),
    max_size=2)
flags = st.one_of(st.booleans(), st.none(), st.just("yes"), st.just(1))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), texts),
                           lambda inner: st.lists(inner, max_size=2), max_leaves=4)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(messages, min_size=1, max_size=4)},
    optional={"add_generation_prompt": flags, "continue_final_message": flags,
              "add_special_tokens": flags, "tools": st.one_of(tools, st.none()),
              "tool_choice": st.sampled_from(["none", "auto", None]),
              "documents": st.one_of(st.none(), st.lists(st.fixed_dictionaries(
                  {"title": texts, "text": texts}), max_size=2)),
              "reasoning_effort": st.sampled_from([None, "none", "high", "bogus"]),
              "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(
                  ["custom_flag", "enable_thinking", "add_generation_prompt", "documents",
                   "bos_token", "unused"]), json_values, max_size=3))})
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(texts, st.lists(texts, max_size=2),
                         st.lists(st.integers(-1, 1100), max_size=4),
                         st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=2))},
    optional={"add_special_tokens": flags})

# Bodies as clients send them: every one must be routed, with vLLM's ids.
words = st.lists(st.sampled_from(["the", "cat", " sat", "\n", "日本", "🙂", "</s>", "{{x}}"]),
                 min_size=1, max_size=8).map("".join)
text_parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]),
                                             "text": words}), min_size=1, max_size=3)
call = st.fixed_dictionaries({"id": words, "type": st.just("function"), "function":
                              st.fixed_dictionaries({"name": words, "arguments": st.sampled_from(
                                  ['{"city": "X"}', "{}", ""])})})
plain_messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer"]),
                           "content": st.one_of(words, text_parts)},
                          optional={"name": words}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(words, st.none())},
                          optional={"tool_calls": st.lists(call, min_size=1, max_size=2),
                                    "reasoning_content": words}),
    st.fixed_dictionaries({"role": st.just("tool"), "content": st.one_of(words, text_parts),
                           "tool_call_id": words}))
plain_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": (
    st.fixed_dictionaries({"name": words}, optional={"description": words, "parameters": st.just(
        {"type": "object", "properties": {"city": {"type": "string"}}})}))}), min_size=1,
    max_size=2)
plain_bodies = st.fixed_dictionaries(
    {"messages": st.lists(plain_messages, min_size=1, max_size=5)},
    optional={"add_generation_prompt": st.booleans(), "tools": plain_tools,
              "documents": st.lists(st.fixed_dictionaries({"title": words, "text": words}),
                                    max_size=2),
              "reasoning_effort": st.sampled_from(["none", "low", "high"]),
              "chat_template_kwargs": st.dictionaries(st.sampled_from(
                  ["custom_flag", "enable_thinking", "unused"]), json_values, max_size=2)})

SLOW_OK = settings(max_examples=150, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture,
                                          HealthCheck.too_slow])


@SLOW_OK
@given(body=chat_bodies, template=st.sampled_from(list(TEMPLATES)))
def test_generated_chat_bodies_get_vllms_ids_or_none(pairs, body, template):
    pairs[template].check(CHAT, body)


@SLOW_OK
@given(body=plain_bodies, template=st.sampled_from(list(TEMPLATES)))
def test_ordinary_chat_bodies_are_all_routed_with_vllms_ids(pairs, body, template):
    pair = pairs[template]
    if isinstance(pair.vllm.render(CHAT, body), tuple):
        pair.check(CHAT, body, routed=True)


@SLOW_OK
@given(body=completion_bodies)
def test_generated_completion_bodies_get_vllms_ids_or_none(pairs, body):
    pairs["model's"].check(COMPLETIONS, body)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


@SLOW_OK
@given(text=st.text(min_size=1, max_size=300), special=st.booleans())
def test_any_text_encodes_as_calling_the_transformers_tokenizer_does(pairs, hf_tokenizer,
                                                                     text, special):
    """The cross-check without vLLM: the Rust backend gives what calling the tokenizer
    as vLLM does gives."""
    ours = pairs["model's"].tokens(COMPLETIONS, {"prompt": text, "add_special_tokens": special})
    assert ours == tuple(hf_tokenizer(text, add_special_tokens=special)["input_ids"])
