"""Replica errors reach the client in the OpenAI envelope
(`dpserve.router.forward.upstream_errors`): the rules as pure functions, their bounds
as properties, and what the official OpenAI client shows, against FakeReplicas (see
tests/fakes.py)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpserve.router.fleet.pool import ReplicaState
from dpserve.router.forward.upstream_errors import (
    MAX_MESSAGE_CHARS,
    MAX_PARSED_BYTES,
    NOT_MOUNTED,
    openai_error,
    relay_error,
)
from tests.conftest import running_router
from tests.fakes import MODEL, FakeReplica

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
          "/detokenize", "/v1/models"]
NOT_FOUND = b'{"detail":"Not Found"}'
VALIDATION = json.dumps({"detail": [
    {"type": "missing", "loc": ["body", "prompt"], "msg": "Field required", "input": {}},
    {"type": "int_parsing", "loc": ["body", "max_tokens"], "msg": "Input should be a valid "
     "integer", "input": "x"}]}).encode()
NGINX_413 = (b"<html>\r\n<head><title>413 Request Entity Too Large</title></head>\r\n<body>\r\n"
             b"<center><h1>413 Request Entity Too Large</h1></center>\r\n<hr><center>nginx"
             b"</center>\r\n</body>\r\n</html>\r\n")


def envelope(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def wrapped(status: int, body: bytes, route: str = "/v1/completions",
            model: str | None = MODEL) -> tuple[int, dict]:
    answer = openai_error(status, body, route=route, model=model)
    assert answer is not None
    return answer[0], envelope(answer[1])


# -- the rules -----------------------------------------------------------------------------

def test_a_body_in_the_envelope_passes_byte_for_byte():
    body = b'{"error": {"message": "max_tokens is too large", "type": "BadRequestError", ' \
           b'"param": "max_tokens", "code": 400}, "extra": 1}'
    assert openai_error(400, body, route="/v1/completions", model=MODEL) is None
    headers = [(b"content-type", b"application/json")]
    assert relay_error(400, body, headers, route="/v1/completions", model=MODEL) == (400, body)
    assert headers == [(b"content-type", b"application/json")]


def test_a_fastapi_detail_keeps_its_status_and_becomes_the_message():
    assert wrapped(404, NOT_FOUND, route="/tokenize") == (404, {
        "message": "Not Found", "type": "NotFoundError", "param": None, "code": 404})
    assert wrapped(500, b'{"detail":"engine is dead"}')[1]["message"] == "engine is dead"


def test_a_validation_error_names_each_field_and_the_first_as_param():
    status, error = wrapped(422, VALIDATION)
    assert status == 422 and error["type"] == "UnprocessableEntityError"
    assert error["message"] == ("body.prompt: Field required; "
                                "body.max_tokens: Input should be a valid integer")
    assert error["param"] == "prompt"


@pytest.mark.parametrize(("body", "message"), [
    (NGINX_413, "413 Request Entity Too Large"),
    (b"<p>upstream <b>timed</b> out</p>", "upstream timed out"),
    (b"Internal Server Error", "Internal Server Error"),
    (b"", "Bad Gateway"),
    (b'{"error": "fake reload failure"}', "fake reload failure"),
    (b'{"object": "error", "message": "old vLLM shape"}', "old vLLM shape"),
    (b"[1, 2]", "[1,2]"),
    (b'"just a string"', '"just a string"'),
])
def test_text_html_and_other_json_shapes_become_a_message(body: bytes, message: str):
    assert wrapped(502, body) == (502, {"message": message, "type": "BadGatewayError",
                                        "param": None, "code": 502})


def test_a_route_the_model_does_not_mount_is_the_requests_fault():
    status, error = wrapped(404, NOT_FOUND, route="/v1/embeddings", model="tiny-llama")
    assert status == 400
    assert error == {"message": "the served model tiny-llama is not an embedding model: "
                                "/v1/embeddings is not served",
                     "type": "BadRequestError", "param": "model", "code": "model_not_embedding"}
    status, error = wrapped(404, NOT_FOUND, route="/v1/chat/completions", model="bge")
    assert (status, error["code"]) == (400, "model_not_generative")
    assert error["message"] == ("the served model bge is not a generative model: "
                                "/v1/chat/completions is not served")


def test_only_fastapis_own_not_found_is_read_as_a_route_not_mounted():
    # vLLM's handlers answer their 404s in the envelope: those pass as they are.
    body = b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError",' \
           b'"param":"model","code":404}}'
    assert openai_error(404, body, route="/v1/embeddings", model="x") is None
    assert wrapped(404, b'{"detail":"no such adapter"}', route="/v1/embeddings")[0] == 404
    assert wrapped(405, b'{"detail":"Not Found"}', route="/v1/embeddings")[0] == 405


def test_a_rewritten_body_is_labelled_json_and_a_compressed_one_is_left_alone():
    headers = [(b"content-type", b"text/html"), (b"x-request-id", b"1")]
    status, body = relay_error(413, NGINX_413, headers, route="/v1/completions", model=None)
    assert status == 413 and envelope(body)["message"] == "413 Request Entity Too Large"
    assert headers == [(b"x-request-id", b"1"), (b"content-type", b"application/json")]
    gzipped = [(b"content-type", b"text/html"), (b"content-encoding", b"gzip")]
    assert relay_error(413, b"\x1f\x8b...", gzipped, route="/v1/completions",
                       model=None) == (413, b"\x1f\x8b...")


def test_without_a_model_in_the_request_the_replicas_own_is_named():
    status, body = relay_error(404, NOT_FOUND, [], route="/v1/embeddings", model=None,
                               served=frozenset({"tiny-llama"}))
    assert status == 400
    assert envelope(body)["message"].startswith("the served model tiny-llama is not")


# -- the bounds ----------------------------------------------------------------------------

SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(
        st.sampled_from(["detail", "error", "message", "loc", "msg", "param"]) | st.text(
            max_size=5), inner, max_size=5),
    max_leaves=30)


def holds_the_rules(status: int, body: bytes, route: str) -> None:
    answer = openai_error(status, body, route=route, model=MODEL)
    if answer is None:  # only a body in the envelope passes as it is
        if len(body) > MAX_PARSED_BYTES:  # too large to parse: it starts like one
            assert body.lstrip().startswith(b"{") and b'"error"' in body[:64]
        else:
            assert isinstance(json.loads(body)["error"]["message"], str)
        return
    new_status, new_body = answer
    error = json.loads(new_body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= MAX_MESSAGE_CHARS
    assert error["param"] is None or isinstance(error["param"], str)
    assert new_status == status or (new_status, status, route in NOT_MOUNTED) == (400, 404, True)


@SETTINGS
@given(st.integers(400, 599), st.binary(max_size=2000), st.sampled_from(ROUTES))
def test_any_bytes_become_an_envelope_with_a_bounded_message(status, body, route):
    holds_the_rules(status, body, route)


@SETTINGS
@given(st.integers(400, 599), JSON, st.sampled_from(ROUTES))
def test_any_json_becomes_an_envelope_with_a_bounded_message(status, value, route):
    holds_the_rules(status, json.dumps(value).encode(), route)


@settings(SETTINGS, max_examples=50)
@given(st.integers(400, 599), st.binary(max_size=200),
       st.sampled_from([b" ", b"<", b"x", b"\xff", b"{", b"["]), st.sampled_from(ROUTES))
def test_any_body_past_the_parse_limit_becomes_an_envelope_too(status, start, fill, route):
    holds_the_rules(status, start + fill * MAX_PARSED_BYTES, route)


@SETTINGS
@given(st.integers(400, 599), st.text(max_size=3000), st.text(max_size=20) | st.none(),
       st.integers(0, 1000))
def test_any_envelope_passes_unchanged(status, message, param, padding):
    body = json.dumps({"error": {"message": message, "type": "X", "param": param,
                                 "code": status}}).encode() + b" " * padding
    assert openai_error(status, body, route="/v1/completions", model=MODEL) is None


@pytest.mark.parametrize("body", [
    b"[" * 60_000,  # nested past Python's recursion limit
    b'{"detail":' * 6_000 + b"1" + b"}" * 6_000,
    b"<" * MAX_PARSED_BYTES,  # a tag that never ends
    b'{"detail": "' + b"x" * 50_000 + b'"}',
    b"y" * (MAX_PARSED_BYTES + 1),
    b" " * (MAX_PARSED_BYTES + 1),  # no text at all: the status's phrase
    b'{"detail": "' + b"x" * MAX_PARSED_BYTES + b'"}',
])
def test_hostile_bodies_are_answered_quickly_and_bounded(body):
    start = time.perf_counter()
    status, error = wrapped(500, body)
    assert status == 500 and len(error["message"]) <= MAX_MESSAGE_CHARS
    assert time.perf_counter() - start < 3.0  # milliseconds when bounded; a busy CI: slower


def test_a_large_body_in_the_envelope_passes_unparsed():
    body = b'{"error": {"message": "' + b"x" * MAX_PARSED_BYTES + b'"}}'
    assert openai_error(400, body, route="/v1/completions", model=MODEL) is None


# -- through the router, as the OpenAI SDK shows it ----------------------------------------

@asynccontextmanager
async def sdk(*replicas: FakeReplica) -> AsyncIterator[tuple[openai.AsyncOpenAI, str, object]]:
    async with running_router([r.url for r in replicas]) as (base, router), \
            openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                               max_retries=0) as client:
        yield client, base, router


async def test_the_sdk_shows_a_validation_errors_fields(fake_replicas):
    picky = await fake_replicas("a", mode="error422",
                                error_answer=("application/json", VALIDATION))
    async with sdk(picky) as (client, _, _):
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.completions.create(model=MODEL, prompt="hi")
    assert "body.prompt: Field required" in str(caught.value)
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_sdk_shows_the_title_of_a_proxys_html_page(fake_replicas, stream):
    behind_nginx = await fake_replicas("a", mode="error413",
                                       error_answer=("text/html", NGINX_413))
    async with sdk(behind_nginx) as (client, _, _):
        with pytest.raises(openai.APIStatusError) as caught:
            await client.completions.create(model=MODEL, prompt="hi", stream=stream)
    assert caught.value.status_code == 413
    assert str(caught.value) == "Error code: 413 - 413 Request Entity Too Large"


async def test_a_replicas_own_envelope_reaches_the_client_byte_for_byte(fake_replicas):
    a = await fake_replicas("a", mode="error400")
    async with running_router([a.url]) as (base, _), httpx.AsyncClient() as c:
        r = await c.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.content == json.dumps({"error": {"message": "a says no", "type": "FakeError",
                                              "param": None, "code": 400}}).encode()


async def test_embeddings_from_a_generative_model_are_a_400_that_says_why(
        fake_replicas: Callable[..., FakeReplica]):
    a, b = await fake_replicas("a"), await fake_replicas("b")  # generative models
    async with sdk(a, b) as (client, base, router), httpx.AsyncClient() as c:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model=MODEL, input="hi")
        metrics = (await c.get(base + "/metrics")).text
        breakers = [router.dispatcher.breaker(r).state(time.monotonic()).value
                    for r in router.pool]
        states = [r.state for r in router.pool]
    assert str(caught.value) == ("Error code: 400 - the served model fake-model is not an "
                                 "embedding model: /v1/embeddings is not served")
    assert (caught.value.code, caught.value.param) == ("model_not_embedding", "model")
    # the request's fault: asked once, not retried, no replica blamed
    assert a.reached() + b.reached() == ["POST /v1/embeddings"]
    assert 'dpserve_request_retries_total{route="/v1/embeddings"} 0.0' in metrics
    assert breakers == ["closed", "closed"] and states == [ReplicaState.READY] * 2
    served_by = "r0" if a.reached() else "r1"
    assert (f'dpserve_requests_total{{replica="{served_by}",route="/v1/embeddings",'
            f'status_class="4xx"}} 1.0') in metrics


async def test_an_embedding_model_serves_embeddings_and_says_it_does_not_generate(
        fake_replicas):
    bge = await fake_replicas("bge", task="embed")
    async with sdk(bge) as (client, _, _):
        answer = await client.embeddings.create(model=MODEL, input="hi")
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="hi")
    assert answer.data[0].embedding == [0.25, -0.5]
    assert caught.value.code == "model_not_generative"
