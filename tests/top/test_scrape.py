"""Scrapes of the router's `/metrics` and `/metrics/engines` become per-replica samples."""

from __future__ import annotations

import math

import pytest

from dpserve.metrics.fake_nvml import FakeGpu, FakeNvml
from dpserve.metrics.gpu import GpuCollector
from dpserve.router.kv.decisions import KVRoutingStats
from dpserve.router.kv.events import Stored
from dpserve.router.kv.index import KVIndex
from dpserve.router.kv.metrics import KVCollector
from dpserve.router.kv.subscriber import FeedStats
from dpserve.router.telemetry.federate import merge_expositions
from dpserve.top.scrape import (
    ReplicaSample,
    RoutingSample,
    ScrapeError,
    parse_replicas,
    parse_routing,
)
from tests.fakes import fake_engine_metrics


def vllm_text(*, engines: int = 1, tokens: float = 0.0, waiting: float = 0.0,
              kv: tuple[float, ...] = (0.0,), ttft: dict[str, float] | None = None,
              prefix: tuple[float, float] | None = None) -> str:
    """An exposition shaped like vLLM 0.32's, one label set per engine; `prefix`: its
    prefix-cache (hits, queries) counters."""
    lines = ["# TYPE vllm:num_requests_waiting gauge",
             *(f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} {waiting}'
               for e in range(engines)),
             "# TYPE vllm:kv_cache_usage_perc gauge",
             *(f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {kv[e % len(kv)]}'
               for e in range(engines)),
             "# TYPE vllm:generation_tokens counter",
             *(f'vllm:generation_tokens_total{{engine="{e}",model_name="m"}} {tokens}'
               for e in range(engines)),
             "# TYPE vllm:time_to_first_token_seconds histogram"]
    if prefix is not None:
        for name, value in zip(("hits", "queries"), prefix, strict=True):
            lines += [f"# TYPE vllm:prefix_cache_{name} counter",
                      *(f'vllm:prefix_cache_{name}_total{{engine="{e}",model_name="m"}} {value}'
                        for e in range(engines))]
    for e in range(engines):
        for le, count in (ttft or {}).items():
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{engine="{e}",le="{le}",'
                         f'model_name="m"}} {count}')
    return "\n".join(lines) + "\n"


def test_engine_series_are_summed_per_replica_and_kv_takes_the_fullest_engine():
    engines = merge_expositions([
        ("r0", vllm_text(engines=2, tokens=10, waiting=3, kv=(0.25, 0.5),
                         ttft={"0.1": 1, "0.5": 2, "+Inf": 2})),
        ("r1", vllm_text(tokens=7)),
    ])
    samples = parse_replicas(None, engines)
    assert samples["r0"].generation_tokens == 20
    assert samples["r0"].waiting == 6
    assert samples["r0"].kv_cache_usage == 0.5
    assert samples["r0"].ttft_buckets == ((0.1, 2.0), (0.5, 4.0), (math.inf, 4.0))
    assert samples["r1"].generation_tokens == 7
    assert samples["r1"].ttft_buckets == ()


def test_the_shared_fakes_exposition_gives_running_and_its_ttft_histogram():
    samples = parse_replicas(None, merge_expositions([("r0", fake_engine_metrics(2, 5))]))
    assert samples["r0"].running == 2
    assert samples["r0"].ttft_buckets == ((0.1, 5.0), (math.inf, 5.0))
    assert samples["r0"].generation_tokens is None  # not reported: unknown, not 0


def test_gpu_replicas_get_their_gpus_utilization_and_memory_from_the_router_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    nvml = FakeNvml([FakeGpu(f"GPU-{i}", utilization_percent=40 + i) for i in range(3)])
    registry = CollectorRegistry()
    collector = GpuCollector.open(nvml, replicas=lambda: {0: "r0", 1: "r1"})
    assert collector is not None
    registry.register(collector)
    samples = parse_replicas(generate_latest(registry).decode(), None)
    assert set(samples) == {"r0", "r1"}  # the GPU no replica uses is left out
    gpu = nvml.gpus[0]
    assert samples["r0"].gpu_utilization == pytest.approx(0.40)
    assert samples["r0"].gpu_memory_used_bytes == gpu.memory_used
    assert samples["r0"].gpu_memory_total_bytes == gpu.memory_total
    assert samples["r0"].cpu_utilization is None


def test_cpu_replicas_get_cpu_utilization_and_rss():
    text = ("# TYPE dpserve_replica_cpu_utilization_ratio gauge\n"
            'dpserve_replica_cpu_utilization_ratio{replica="r0"} 0.75\n'
            "# TYPE dpserve_replica_memory_rss_bytes gauge\n"
            'dpserve_replica_memory_rss_bytes{replica="r0"} 3.0e9\n'
            "# TYPE dpserve_replicas_ready gauge\n"
            "dpserve_replicas_ready 1.0\n")
    assert parse_replicas(text, None) == {
        "r0": ReplicaSample(cpu_utilization=0.75, memory_rss_bytes=3.0e9)}


def test_nan_samples_are_left_out_and_missing_texts_give_no_replicas():
    text = ('# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{replica="r0"} NaN\n')
    assert parse_replicas(text, None) == {}
    assert parse_replicas(None, None) == {}


def test_a_text_that_does_not_parse_names_its_source():
    with pytest.raises(ScrapeError, match="/metrics/engines does not parse"):
        parse_replicas(None, 'vllm:num_requests_waiting{replica="r0"} many\n')


def test_prefix_cache_counters_are_summed_over_the_engines_and_absent_ones_stay_unknown():
    engines = merge_expositions([("r0", vllm_text(engines=2, prefix=(30, 100))),
                                 ("r1", vllm_text())])
    samples = parse_replicas(None, engines)
    assert (samples["r0"].prefix_cache_hits, samples["r0"].prefix_cache_queries) == (60, 200)
    assert samples["r1"].prefix_cache_hits is samples["r1"].prefix_cache_queries is None


def kv_aware_metrics() -> str:
    """The router's `kv-aware` series, from its own collector: r0 followed with 3 blocks
    known, r1 followed but stale (a batch missed), r2 not followed (no events offered)."""
    from prometheus_client import CollectorRegistry, generate_latest

    index = KVIndex()
    index.apply("r0", 0, [Stored(block_hashes=(1, 2, 3), parent=None,
                                 token_ids=tuple(range(6)), block_size=2, lora_name=None,
                                 lora_id=None)])
    index.apply("r1", 0, [])
    index.apply("r1", 5, [])  # 1 to 4 missed
    status = {"r0": "following", "r1": "following", "r2": "not offered"}
    stats = KVRoutingStats(on_events=9, fallbacks={"no_tokens": 1, "no_events": 0},
                           prompt_tokens=1000, cached_tokens=600)
    feeds = {"r0": FeedStats("tcp://r0:5557", batches=4, resyncs=2),
             "r1": FeedStats("tcp://r1:5557", batches=2)}
    registry = CollectorRegistry()
    registry.register(KVCollector(index, lambda: status, stats, lambda: feeds))
    return generate_latest(registry).decode()


def test_kv_aware_series_give_each_replica_its_index_and_feed():
    samples = parse_replicas(kv_aware_metrics(), None)
    r0, r1, r2 = samples["r0"], samples["r1"], samples["r2"]
    assert (r0.kv_index_blocks, r0.kv_index_stale, r0.kv_events_following) == (3, 0, 1)
    assert (r0.kv_event_gaps, r0.kv_event_resyncs) == (0, 2)
    assert (r1.kv_index_stale, r1.kv_event_gaps, r1.kv_event_resyncs) == (1, 1, 0)
    assert (r2.kv_events_following, r2.kv_index_blocks, r2.kv_event_resyncs) == (0, None, None)


def test_kv_aware_decisions_are_read_fleet_wide_and_other_policies_have_none():
    assert parse_routing(kv_aware_metrics()) == RoutingSample(
        decisions={"events": 9, "no_tokens": 1, "no_events": 0},
        routed_tokens={"prompt": 1000, "cached": 600})
    other_policy = "# TYPE dpserve_replicas_ready gauge\ndpserve_replicas_ready 1.0\n"
    assert parse_routing(other_policy) is None
    assert parse_routing(None) is None
