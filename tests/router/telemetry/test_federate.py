"""/metrics/engines: the replicas' own metrics merged, each sample labelled with its replica."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpserve.config import ConfigError, build_router_config
from dpserve.replicas.launcher import free_port
from dpserve.router.telemetry.federate import label_sample, merge_expositions
from tests.conftest import running_router
from tests.waiting import wait_for

VLLM_LIKE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 3.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


def test_a_label_less_sample_gets_a_label_set():
    assert label_sample("process_open_fds 12.0", "r0") == 'process_open_fds{replica="r0"} 12.0'


def test_the_replica_label_goes_first_and_the_value_and_timestamp_stay():
    assert (label_sample('x_total{a="1",b="2"} 3.0 1700000000000', "r1")
            == 'x_total{replica="r1",a="1",b="2"} 3.0 1700000000000')


def test_braces_commas_and_escaped_quotes_inside_label_values_are_left_alone():
    line = r'x{path="/a}b,c",q="say \"hi\" {x}"} 1'
    assert label_sample(line, "r0") == r'x{replica="r0",path="/a}b,c",q="say \"hi\" {x}"} 1'


def test_an_existing_replica_label_is_kept_as_exported_replica():
    assert (label_sample('x{a="1",replica="other"} 1', "r0")
            == 'x{replica="r0",a="1",exported_replica="other"} 1')
    # a value that merely contains `replica=` is no clash
    assert label_sample('x{a="replica="} 1', "r0") == 'x{replica="r0",a="replica="} 1'


def test_the_replica_id_is_escaped():
    assert label_sample("x 1", 'a"b\\c') == 'x{replica="a\\"b\\\\c"} 1'


def test_merging_keeps_one_help_and_type_per_family_with_every_replica_samples():
    merged = merge_expositions([("r0", VLLM_LIKE), ("r1", VLLM_LIKE)])
    assert merged.count("# TYPE vllm:e2e_request_latency_seconds histogram") == 1
    assert merged.count("# HELP vllm:num_requests_running ") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    hist = families["vllm:e2e_request_latency_seconds"]
    assert hist.type == "histogram"
    assert {s.labels["replica"] for s in hist.samples} == {"r0", "r1"}
    assert len(hist.samples) == 8
    running = families["vllm:num_requests_running"]
    assert [(s.labels["replica"], s.value) for s in running.samples] == [("r0", 2.0), ("r1", 2.0)]
    assert "process_cpu_seconds" not in families


def test_a_family_only_one_replica_has_is_kept_and_untyped_samples_stand_alone():
    merged = merge_expositions([("r0", VLLM_LIKE),
                                ("r1", "vllm:lonely 1\n# a comment\n\n")])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert [s.labels for s in families["vllm:lonely"].samples] == [{"replica": "r1"}]
    assert "# a comment" not in merged
    assert merge_expositions([]) == ""


def test_only_the_engines_own_families_are_relayed_with_their_help_and_type():
    api_server = """\
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 3.0
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 120.0
untyped_thing 1
vllm:untyped_but_ours 2
"""
    merged = merge_expositions([("r0", api_server + VLLM_LIKE), ("r1", VLLM_LIKE)])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(families) == {"vllm:untyped_but_ours", "vllm:num_requests_running",
                             "vllm:e2e_request_latency_seconds"}
    assert all(line.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:"))
               for line in merged.splitlines())


async def test_engine_metrics_of_every_replica_are_served_with_a_replica_label(fake_replicas):
    a = await fake_replicas("a")
    b = await fake_replicas("b")
    async with running_router([a.url, b.url]) as (base, _), httpx.AsyncClient() as c:
        await c.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "hi"})
        resp = await c.get(base + "/metrics/engines")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    served = {s.labels["replica"]: s.value for s in families["vllm:request_success"].samples}
    assert served.keys() == {"r0", "r1"}
    assert sum(served.values()) == 1.0
    # the replicas' API server and Python process series are not relayed
    assert {name.split(":")[0] for name in families} == {"vllm"}
    assert "http_requests" not in resp.text and "process_" not in resp.text


async def test_a_replica_that_cannot_be_scraped_is_left_out_and_counted(fake_replicas):
    a = await fake_replicas("a")
    b = await fake_replicas("b", serve_metrics=False)
    unreachable = f"http://127.0.0.1:{free_port()}"
    async with running_router([a.url, b.url, unreachable]) as (base, _), \
            httpx.AsyncClient() as c:
        engines = (await c.get(base + "/metrics/engines")).text
        router = (await c.get(base + "/metrics")).text
    assert 'replica="r0"' in engines
    assert 'replica="r1"' not in engines and 'replica="r2"' not in engines
    assert 'dpserve_engine_scrape_errors_total{replica="r1"} 1.0' in router
    assert 'dpserve_engine_scrape_errors_total{replica="r2"} 1.0' in router


async def test_callers_share_one_fetch_of_the_engines_however_many_ask(fake_replicas):
    """Anonymous callers cannot make the router query every engine per GET: one fetch
    serves everyone waiting for it, and its answer serves for `engine_metrics_cache_s`."""
    a = await fake_replicas("a")
    b = await fake_replicas("b")
    async with running_router([a.url, b.url], engine_metrics_cache_s=3600) as (base, router), \
            httpx.AsyncClient() as c:
        scraped = (a.metrics_scrapes, b.metrics_scrapes)
        a.metrics_gate.clear()  # a slow engine: every caller arrives while it is fetched
        calls = [asyncio.create_task(c.get(base + "/metrics/engines")) for _ in range(20)]
        await wait_for(lambda: a.metrics_scrapes > scraped[0], "the fetch to reach r0")
        a.metrics_gate.set()
        answers = await asyncio.gather(*calls)
        later = [await c.get(base + "/metrics/engines") for _ in range(20)]
        assert router.engine_metrics.fetches == 1
    assert {r.status_code for r in answers + later} == {200}
    assert len({r.text for r in answers + later}) == 1 and 'replica="r1"' in later[0].text
    assert (a.metrics_scrapes - scraped[0], b.metrics_scrapes - scraped[1]) == (1, 1)


async def test_a_stale_answer_is_fetched_again(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], engine_metrics_cache_s=0) as (base, router), \
            httpx.AsyncClient() as c:
        for _ in range(3):
            assert (await c.get(base + "/metrics/engines")).status_code == 200
        assert router.engine_metrics.fetches == 3


async def test_engine_metrics_can_need_a_key(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], api_keys=["api-key-12345678"],
                              admin_key="admin-key-of-sixteen-chars",
                              engine_metrics_need_key=True) as (base, _), \
            httpx.AsyncClient() as c:
        anonymous = await c.get(base + "/metrics/engines")
        api = await c.get(base + "/metrics/engines",
                          headers={"authorization": "Bearer api-key-12345678"})
        admin = await c.get(base + "/metrics/engines",
                            headers={"authorization": "Bearer admin-key-of-sixteen-chars"})
        router_metrics = await c.get(base + "/metrics")
    assert (anonymous.status_code, api.status_code, admin.status_code) == (401, 200, 200)
    assert anonymous.json()["error"]["code"] == 401
    assert router_metrics.status_code == 200  # the router's own stay open
    with pytest.raises(ConfigError, match=r"router\.engine_metrics_need_key"):
        build_router_config({"engine_metrics_need_key": True}, env={})


async def test_engine_metrics_need_no_api_key(fake_replicas):
    a = await fake_replicas("a")
    async with running_router([a.url], api_keys=["secret"]) as (base, _), \
            httpx.AsyncClient() as c:
        assert (await c.get(base + "/metrics/engines")).status_code == 200
        assert (await c.get(base + "/v1/models")).status_code == 401
