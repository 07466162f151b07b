"""`parse_request`: what the router reads from a body, and each refusal a client gets."""

from __future__ import annotations

import pytest

from dpserve.router.errors import RouterError
from dpserve.router.forward.request import parse_request

KNOWN = frozenset({"m"})


@pytest.mark.parametrize("body, status, message, param", [
    (b"not json", 400, "request body is not valid JSON", None),
    (b"\xff\xfe", 400, "request body is not valid JSON", None),
    (b"[1, 2]", 400, "request body must be a JSON object", None),
    (b'"text"', 400, "request body must be a JSON object", None),
    (b'{"model": 7}', 400, "'model' must be a string", "model"),
    (b'{"model": "m", "stream": "yes"}', 400, "'stream' must be a boolean", "stream"),
    (b'{"model": "other"}', 404, "The model `other` does not exist. Served here: `m`.",
     "model"),
    (b"[" * 100_000, 400, "request body is nested too deeply", None),
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, 400, "request body is nested too deeply",
     None),
], ids=["not-json", "not-utf8", "array", "string", "model-int", "stream-str",
        "unknown-model", "deep-array", "deep-object"])
def test_a_body_the_router_cannot_route_is_refused_naming_why(body, status, message, param):
    with pytest.raises(RouterError) as caught:
        parse_request(body, [], route="/v1/completions", known_models=KNOWN)
    assert caught.value.status == status
    assert caught.value.message.startswith(message)
    assert caught.value.param == param


def test_an_unknown_model_is_answered_with_the_names_served_a_few_at_most():
    known = frozenset(f"model-{i:02d}" for i in range(20))
    with pytest.raises(RouterError) as caught:
        parse_request(b'{"model": "' + b"x" * 5000 + b'"}', [], route="/v1/completions",
                      known_models=known)
    message = caught.value.message
    assert message.startswith("The model `" + "x" * 200 + "...` does not exist.")
    assert "`model-00`, `model-01`" in message and "`model-07` and 12 more" in message
    assert "model-08" not in message and len(message) < 500


@pytest.mark.parametrize("body, known, model, stream", [
    (b'{"model": "m", "prompt": "hi"}', KNOWN, "m", False),
    (b'{"model": "m", "prompt": "hi", "stream": true}', KNOWN, "m", True),
    (b'{"model": "m", "stream": null}', KNOWN, "m", False),
    (b'{"prompt": "hi"}', KNOWN, None, False),  # the replica picks its only model
    (b'{"model": "anything"}', frozenset(), "anything", False),  # no replica reported yet
], ids=["plain", "stream", "stream-null", "no-model", "models-unknown"])
def test_a_routable_body_gives_its_model_and_stream_flag(body, known, model, stream):
    parsed = parse_request(body, [], route="/v1/completions", known_models=known)
    assert (parsed.info.route, parsed.info.model, parsed.stream) == (
        "/v1/completions", model, stream)


def test_affinity_keys_are_read_only_when_the_policy_needs_them():
    body = b'{"model": "m", "prompt": "You are a helpful assistant.", "user": "u1"}'
    headers = [(b"x-session-id", b"s-42")]
    none = parse_request(body, headers, route="/v1/completions", known_models=KNOWN)
    both = parse_request(body, headers, route="/v1/completions", known_models=KNOWN,
                         keys=frozenset({"session_id", "prefix"}), prefix_chars=7)
    user = parse_request(body, [], route="/v1/completions", known_models=KNOWN,
                         keys=frozenset({"session_id"}))
    assert (none.info.session_id, none.info.prefix) == (None, None)
    assert (both.info.session_id, both.info.prefix) == ("s-42", "You are")
    assert user.info.session_id == "u1"
