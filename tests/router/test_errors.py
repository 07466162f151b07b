from __future__ import annotations

import json

from dpserve.router.errors import error_body, error_type, sse_error_event


def test_error_types_are_named_like_vllm_names_them():
    assert error_type(400) == "BadRequestError"
    assert error_type(404) == "NotFoundError"
    assert error_type(413) == "RequestEntityTooLargeError"
    assert error_type(503) == "ServiceUnavailableError"


def test_error_body_is_the_openai_envelope():
    body = json.loads(error_body(404, "The model `x` does not exist.", param="model"))
    assert body == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                              "param": "model", "code": 404}}


def test_stream_error_event_ends_the_stream():
    event = sse_error_event(502, "stream interrupted")
    first, done = event.decode().strip().split("\n\n")
    assert json.loads(first.removeprefix("data: "))["error"]["code"] == 502
    assert done == "data: [DONE]"
