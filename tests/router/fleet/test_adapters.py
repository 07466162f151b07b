from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.errors import RouterError
from dpserve.router.fleet.adapters import (
    Adapters,
    AdapterVersion,
    list_models,
    rename_model,
    rewrite_model,
    with_fingerprint,
)


def version(name: str = "support", v: str = "step-000010-1a2b3c4d") -> AdapterVersion:
    return AdapterVersion(name=name, version=v, path=f"/snap/{name}-{v}", rank=8)


def test_a_name_means_its_current_version_and_a_pinned_one_its_own():
    adapters = Adapters()
    v1, v2 = version(v="v1"), version(v="v2")
    adapters.add(v1)
    assert adapters.resolve("support") is None  # loading: no client can name it yet
    adapters.switch(v1)
    adapters.add(v2)
    assert adapters.resolve("support") is v1
    with pytest.raises(RouterError):  # still loading: not even a pinned request
        adapters.resolve("support@v2")
    assert adapters.switch(v2) is v1
    assert adapters.resolve("support") is v2
    assert adapters.resolve("support@v2") is v2
    assert v1.retiring and adapters.get("support@v1") is v1  # still finishing its requests


def test_the_base_model_and_unknown_names_are_not_adapters():
    adapters = Adapters()
    adapters.add(v := version())
    adapters.switch(v)
    assert adapters.resolve("dpserve-tiny-llama") is None
    assert adapters.resolve(None) is None
    assert adapters.resolve("other@v1") is None  # the replicas' 404 decides


@pytest.mark.parametrize("pinned", ["support@nope", "support@v1"])
def test_a_pinned_version_not_served_is_a_404_naming_the_current_one(pinned):
    adapters = Adapters()
    adapters.add(v1 := version(v="v1"))
    adapters.switch(v1)
    adapters.add(v2 := version(v="v2"))
    adapters.switch(v2)  # v1 retires: no new request may start on it
    with pytest.raises(RouterError) as exc:
        adapters.resolve(pinned)
    assert exc.value.status == 404 and exc.value.param == "model"
    assert f"`{pinned}` does not exist" in exc.value.message
    assert "serves version v2" in exc.value.message


def test_a_pinned_version_of_a_withdrawn_or_loading_adapter_is_a_404_for_good():
    """Whatever NAME means now (nothing, after a deploy's `drop_adapters`), NAME@VERSION
    not serving is refused here: the engines may still hold it while its last requests
    end, or after an unload that failed, and it runs on base weights it was not
    trained on."""
    adapters = Adapters()
    adapters.add(v1 := version(v="v1"))
    with pytest.raises(RouterError, match="adapter `support` is not served"):
        adapters.resolve("support@v1")  # the first version, still loading
    adapters.switch(v1)
    assert adapters.withdraw("support") is v1 and v1.retiring
    for pinned in ("support@v1", "support@v0"):
        with pytest.raises(RouterError) as exc:
            adapters.resolve(pinned)
        assert exc.value.status == 404 and "is not served" in exc.value.message
    assert adapters.resolve("support") is None  # no adapter: the base models' check
    adapters.remove(v1)  # unloaded (or its unload failed on some engine)
    assert adapters.in_use and len(adapters) == 0
    with pytest.raises(RouterError):
        adapters.resolve("support@v1")


def test_a_workers_mirror_keeps_the_names_its_leader_served():
    leader, follower = Adapters(), Adapters()
    leader.add(v1 := version(v="v1"))
    leader.switch(v1)
    leader.withdraw("support")
    leader.remove(v1)
    follower.mirror([], {}, leader.served_names())
    with pytest.raises(RouterError):
        follower.resolve("support@v1")


def test_a_lease_counts_the_requests_on_a_version_even_when_they_fail():
    adapters = Adapters()
    v = version()
    with adapters.lease(v), adapters.lease(v):
        assert v.in_flight == 2
    with pytest.raises(RuntimeError), adapters.lease(v):
        raise RuntimeError
    assert v.in_flight == 0


def test_removing_the_current_version_forgets_the_name():
    adapters = Adapters()
    adapters.add(v := version())
    adapters.switch(v)
    adapters.remove(v)
    assert len(adapters) == 0 and adapters.names() == frozenset()
    assert adapters.resolve("support") is None


def test_a_version_cannot_be_added_twice():
    adapters = Adapters()
    adapters.add(version())
    with pytest.raises(ValueError, match="already served"):
        adapters.add(version())


def test_the_request_body_names_the_engine_version_and_keeps_everything_else():
    body = b'{"model": "support", "prompt": "caf\\u00e9 \xe2\x82\xac", "max_tokens": 3}'
    out = json.loads(rewrite_model(json.loads(body), "support@v2"))
    assert out == {"model": "support@v2", "prompt": "café €", "max_tokens": 3}


@given(prompt=st.text(max_size=50) | st.just("\ud800 lone surrogate"))
def test_any_json_string_survives_the_rewrite_as_the_client_sent_it(prompt):
    body = json.dumps({"model": "support", "prompt": prompt, "n": 1}).encode()
    rewritten = rewrite_model(json.loads(body), "support@v2")
    assert rewritten.isascii()
    assert json.loads(rewritten) == {"model": "support@v2", "prompt": prompt, "n": 1}


V2 = AdapterVersion(name="support", version="v2", path="/snap/v2", rank=8)


def test_the_answer_names_the_model_the_client_asked_for_and_the_version_it_ran_on():
    chunk = (b'data: {"id":"cmpl-1","object":"text_completion","model":"support@v2",'
             b'"choices":[{"index":0,"text":"hi"}],"system_fingerprint":"vllm-0.32.0-ab"}\n\n')
    assert rename_model(chunk, V2, "support") == chunk.replace(
        b'"model":"support@v2"', b'"model":"support"').replace(
        b'"system_fingerprint":"vllm-0.32.0-ab"', b'"system_fingerprint":"v2"')
    chat = b'{"model":"support@v2","choices":[],"system_fingerprint":null}'
    assert json.loads(rename_model(chat, V2, "support"))["system_fingerprint"] == "v2"


@given(text=st.text(max_size=200))
def test_generated_text_is_never_renamed(text):
    """Whatever the model generates (even the fields themselves) is JSON-escaped text."""
    body = json.dumps({"model": "support@v2", "choices": [{"text": text}],
                       "system_fingerprint": "vllm"},
                      ensure_ascii=False, separators=(",", ":")).encode()
    renamed = json.loads(rename_model(body, V2, "support"))
    assert renamed == {"model": "support", "choices": [{"text": text}],
                       "system_fingerprint": "v2"}


@given(text=st.text(max_size=60))
def test_text_that_spells_the_fingerprint_field_is_left_alone(text):
    spelled = f'"system_fingerprint":"{text}"'
    body = json.dumps({"model": "support@v2", "choices": [{"text": spelled}]},
                      ensure_ascii=False, separators=(",", ":")).encode()
    assert json.loads(rename_model(body, V2, "support"))["choices"][0]["text"] == spelled


@given(version=st.text(max_size=40), text=st.text(max_size=60),
       separators=st.sampled_from([(",", ":"), (", ", ": ")]))
def test_any_version_becomes_the_fingerprint_of_base_answers_as_valid_json(version, text,
                                                                           separators):
    """vLLM writes compact JSON; other servers put a space after the colon."""
    body = json.dumps({"model": "base", "choices": [{"text": text}],
                       "system_fingerprint": "vllm-0.32.0-ab"},
                      ensure_ascii=False, separators=separators).encode()
    assert json.loads(with_fingerprint(body, version)) == {
        "model": "base", "choices": [{"text": text}], "system_fingerprint": version}


def test_an_answer_without_a_fingerprint_is_passed_as_is():
    for body in (b'{"tokens":[1,2,3]}', b"data: [DONE]\n\n", b""):
        assert with_fingerprint(body, "step-000001@ab") is body


def test_the_model_list_is_the_routers_whichever_replica_answered():
    adapters = Adapters()
    adapters.add(v1 := version(v="v1"))
    adapters.switch(v1)
    adapters.add(v2 := version(v="v2"))
    adapters.switch(v2)  # v1 retiring, still loaded on the replica
    adapters.add(version(v="v3"))  # loading
    replica = {"object": "list", "data": [
        {"id": "tiny", "object": "model", "created": 7, "root": "/m", "parent": None},
        {"id": "support@v1", "object": "model", "root": "/snap/v1", "parent": "tiny"},
        {"id": "support@v3", "object": "model", "root": "/snap/v3", "parent": "tiny"}]}
    listed = json.loads(list_models(json.dumps(replica).encode(), adapters))["data"]
    assert [m["id"] for m in listed] == ["tiny", "support", "support@v2"]
    assert listed[1]["parent"] == "tiny" and listed[1]["dpserve"] == {
        "adapter": "support", "version": "v2", "rank": 8}
    assert all(m["root"] == "support@v2" for m in listed[1:])  # no snapshot path leaks


def test_a_model_list_that_is_not_vllms_passes_unchanged():
    adapters = Adapters()
    adapters.add(v := version())
    adapters.switch(v)
    for odd in (b"not json", b'{"data": 3}', b'{"data": [1]}', b"[]"):
        assert list_models(odd, adapters) == odd


def test_an_adapter_the_router_did_not_deploy_is_not_listed_even_with_none_deployed():
    base = {"id": "tiny", "object": "model", "parent": None}
    stray = {"id": "support@by-hand", "object": "model", "parent": "tiny"}
    listed = json.loads(list_models(json.dumps({"object": "list", "data": [base, stray]})
                                    .encode(), Adapters()))
    assert listed["data"] == [base]
    plain = json.dumps({"object": "list", "data": [base]}, indent=1).encode()
    assert list_models(plain, Adapters()) == plain  # nothing to change: bytes as they came
