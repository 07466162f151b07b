"""Traces on real vLLM replicas: one trace holds the router's span and the engine's.

The session's deployment traces to an OTLP/HTTP endpoint in the test process
(`tests.otlp`); vLLM runs with `--otlp-traces-endpoint` (set by `dpserve serve`) and
puts its `llm_request` span under the router's, from the `traceparent` it was sent.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import MODEL_NAME, Deployment
from tests.otlp import OtlpReceiver
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.vllm

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_one_trace_holds_the_router_span_and_the_engine_span_under_it(
        deployment: Deployment, otlp: OtlpReceiver):
    r = httpx.post(deployment.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "A trace of", "max_tokens": 4},
        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200
    replica = r.headers["x-dpserve-replica"]

    def both() -> tuple | None:
        mine = [s for s in otlp.spans if s.trace_id == CLIENT_TRACE]
        router = [s for s in mine if s.service == "dpserve-router"]
        engine = [s for s in mine if s.service == "dpserve-engine"]
        return (router, engine) if router and engine else None

    router, engine = wait_for_sync(both, "the router's and the engine's spans", within_s=30)
    (span,) = router
    assert (span.name, span.parent_id) == ("POST /v1/completions", CLIENT_SPAN)
    assert span.attributes["dpserve.replica"] == replica
    assert span.attributes["http.response.status_code"] == 200
    assert {s.parent_id for s in engine} == {span.span_id}, engine
    assert {s.attributes["resource.dpserve.replica"] for s in engine} == {replica}
    assert any(s.attributes.get("gen_ai.usage.completion_tokens") == 4 for s in engine), [
        s.attributes for s in engine]
