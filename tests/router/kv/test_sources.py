"""A replica's `/kv_event_sources` answer, read as hostile input: the router connects
to the replica's own host only, and says in one line why a source is unusable."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpserve.router.kv.sources import (
    MAX_SOURCES_BYTES,
    EventSource,
    SourceError,
    override_source,
    parse_sources,
)

URL = "http://10.0.0.7:8001"


def answer(**fields: object) -> bytes:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
              "replay_endpoint": None, "buffer_steps": 10000, "hwm": 100000,
              "max_queue_size": 100000, "topic": "kv"} | fields
    return json.dumps({"0": config}).encode()


def test_vllms_answer_becomes_the_same_ports_on_the_replicas_host():
    got = parse_sources(answer(replay_endpoint="tcp://*:5558"), URL)
    assert got == EventSource("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558", "kv")


@pytest.mark.parametrize("wildcard", ["*", "0.0.0.0", "[::]"])
def test_every_wildcard_bind_is_reached_on_the_replicas_host(wildcard):
    assert parse_sources(answer(endpoint=f"tcp://{wildcard}:6000"), URL).endpoint == (
        "tcp://10.0.0.7:6000")


def test_an_ipv6_replica_is_bracketed():
    assert parse_sources(answer(), "http://[fd00::5]:8000").endpoint == "tcp://[fd00::5]:5557"


@pytest.mark.parametrize("body", [b"{}", json.dumps({"0": {"enable_kv_cache_events": False,
                                                           "publisher": "null"}}).encode()])
def test_events_off_is_no_source(body):
    assert parse_sources(body, URL) is None


def test_a_named_host_is_refused_whatever_it_names():
    """The engine connects out there; and the router never connects where a replica's
    answer points it."""
    with pytest.raises(SourceError, match="names a host"):
        parse_sources(answer(endpoint="tcp://169.254.169.254:80"), URL)
    with pytest.raises(SourceError, match="names a host"):
        parse_sources(answer(replay_endpoint="tcp://evil.example:5558"), URL)


@pytest.mark.parametrize("body, why", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"[" * 20_000, "not JSON"),
    (b" " * (MAX_SOURCES_BYTES + 1), "over"),
    (answer(endpoint=5557), "no endpoint"),
    (answer(endpoint="ipc:///tmp/x"), "another host"),
    (answer(endpoint="tcp:/x"), "tcp://HOST:PORT"),
    (answer(endpoint="tcp://*:0"), "no valid port"),
    (answer(endpoint="tcp://*:70000"), "no valid port"),
    (answer(endpoint="tcp://*:5557\n"), "tcp://HOST:PORT"),
    (answer(topic=["kv"]), "topic"),
    (answer(topic="k" * 300), "topic"),
    (answer(replay_endpoint=7), "replay_endpoint"),
    (json.dumps({"0": json.loads(answer())["0"], "1": json.loads(answer())["0"]}).encode(),
     "ranks"),
])
def test_unusable_answers_say_why_in_one_line(body, why):
    with pytest.raises(SourceError, match=why) as caught:
        parse_sources(body, URL)
    assert "\n" not in str(caught.value)


@given(st.binary(max_size=512))
def test_any_bytes_give_a_source_none_or_a_source_error(body):
    try:
        got = parse_sources(body, URL)
    except SourceError:
        return
    assert got is None or got.endpoint.startswith("tcp://10.0.0.7:")


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20))
def test_any_json_gives_a_source_on_the_replicas_host_none_or_a_source_error(data):
    try:
        got = parse_sources(json.dumps({"0": data}).encode(), URL)
    except SourceError:
        return
    assert got is None or got.endpoint.startswith("tcp://10.0.0.7:")


def test_a_replica_on_this_machine_may_publish_on_a_unix_socket():
    got = parse_sources(answer(endpoint="ipc:///tmp/dpserve-kv-x/r0.pub",
                               replay_endpoint="ipc:///tmp/dpserve-kv-x/r0.replay"),
                        "http://127.0.0.1:8001")
    assert got == EventSource("ipc:///tmp/dpserve-kv-x/r0.pub",
                              "ipc:///tmp/dpserve-kv-x/r0.replay", "kv")


@pytest.mark.parametrize("endpoint", ["ipc://relative", "ipc:///a/../etc", "ipc:///a b",
                                      "ipc:///" + "a" * 120, "ipc:///a\x00b"])
def test_odd_unix_socket_paths_are_refused(endpoint):
    with pytest.raises(SourceError, match="ABSOLUTE"):
        parse_sources(answer(endpoint=endpoint), "http://127.0.0.1:8001")


def test_the_override_is_placed_on_each_replicas_host():
    assert override_source("tcp://*:7000", "tcp://*:7001", "kv", URL) == EventSource(
        "tcp://10.0.0.7:7000", "tcp://10.0.0.7:7001", "kv")
    with pytest.raises(SourceError, match="kv_events_endpoint"):
        override_source("tcp://other:7000", None, "kv", URL)
