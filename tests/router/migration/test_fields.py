"""The fields the router reads are read as vLLM reads them: the same coercion, the
same refusals. Checked against vLLM 0.32's own request models (the installed engine)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpserve.router.errors import RouterError
from dpserve.router.migration.fields import CHAT, COMPLETION, coerce_fields


@pytest.fixture(scope="module")
def vllm_models() -> dict[bool, Any]:
    """vLLM's request models, by `chat`."""
    completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    return {False: completion.CompletionRequest, True: chat.ChatCompletionRequest}


@pytest.fixture(scope="module")
def refusals(vllm_models) -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: pydantic's error, or its own (raised
    by its model validators, which check some fields before pydantic does)."""
    exceptions = pytest.importorskip("vllm.exceptions")
    return ValueError, exceptions.VLLMClientError


def vllm_reads(models: dict[bool, Any], chat: bool, name: str, value: Any) -> Any:
    """What vLLM's model makes of `name: value` (ValidationError if it refuses it)."""
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "hi"}]} if chat
                            else {"prompt": "hi"})
    request = models[chat].model_validate({"model": "m", **base, name: value})
    return request.__dict__[name]  # not getattr: a deprecated field warns


def test_the_declarations_are_vllms(vllm_models):
    for chat, fields in ((False, COMPLETION), (True, CHAT)):
        declared = vllm_models[chat].model_fields
        for name in fields:
            assert name in declared, (chat, name)


@pytest.mark.parametrize(("value", "expected"), [
    ("3", 3), (3.0, 3), (" 3 ", 3), ("+3", 3), (True, 1), (3, 3),
    (None, 16)])  # a completion's null is its default, as vLLM reads it
def test_an_integer_field_takes_what_vllm_takes(value, expected):
    body = {"max_tokens": value}
    coerce_fields(body, chat=False)
    assert body["max_tokens"] == expected and type(body["max_tokens"]) is type(expected)


@pytest.mark.parametrize(("name", "value"), [
    ("max_tokens", "three"), ("max_tokens", 3.5), ("n", None), ("echo", "maybe"),
    ("seed", 2**64), ("temperature", [0.5]), ("use_beam_search", None)])
def test_what_vllm_refuses_is_a_400_naming_the_field(name, value):
    with pytest.raises(RouterError) as exc:
        coerce_fields({name: value}, chat=False)
    assert exc.value.status == 400 and exc.value.param == name
    assert exc.value.message.startswith(f"'{name}': ")


def test_fields_of_the_declared_type_are_left_as_they_are():
    body = {"max_tokens": 5, "temperature": 0.5, "echo": False, "n": 1, "seed": -1,
            "logprobs": None, "prompt": "x"}
    before = dict(body)
    coerce_fields(body, chat=False)
    assert body == before


@pytest.mark.parametrize("value", [0, 1, 2**53, 2**53 + 1, -(2**60)])
def test_an_integer_for_a_float_is_the_float_vllm_reads(value):
    body = {"temperature": value}
    coerce_fields(body, chat=False)
    assert type(body["temperature"]) is float and body["temperature"] == float(value)


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(alphabet="0123456789.-+eE _truefalsyonTRUE", max_size=8),
    st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(chat=st.booleans(), data=st.data(), value=_VALUES)
def test_the_router_reads_every_value_as_vllm_does(vllm_models, refusals, chat, data, value):
    """Whatever vLLM accepts, the router reads as the same value; whatever the router
    refuses, vLLM refuses too."""
    name = data.draw(st.sampled_from(sorted(CHAT if chat else COMPLETION)))
    body = {name: value}
    try:
        coerce_fields(body, chat=chat)
    except RouterError:
        with pytest.raises(refusals):
            vllm_reads(vllm_models, chat, name, value)
        return
    try:
        expected = vllm_reads(vllm_models, chat, name, value)
    except refusals:
        return  # refused by a rule of vLLM's beyond the type (a range): the engine's 400
    assert body[name] == expected or (expected != expected and body[name] != body[name])
