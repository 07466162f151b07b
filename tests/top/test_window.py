"""Rates and TTFT percentiles over the last minute, from successive scrapes."""

from __future__ import annotations

import math

import pytest

from dpserve.top.scrape import ReplicaSample, RoutingSample
from dpserve.top.window import (
    History,
    KVSummary,
    Snapshot,
    bucket_deltas,
    counter_deltas,
    histogram_quantile,
    kv_summary,
    rows,
)

INF = math.inf
ADMIN = ({"id": "r0", "state": "ready", "weight_version": "step-000020", "in_flight": 2,
          "device": "gpu:0", "models": ["tiny", "support@step-000150@1802"]},)


def snap(at: float, **sample: object) -> Snapshot:
    return Snapshot(at, ADMIN, {"r0": ReplicaSample(**sample)})  # type: ignore[arg-type]


def test_a_counter_that_went_down_was_reset_and_counts_from_zero():
    assert counter_deltas((130.0,), (100.0,)) == (30.0,)
    assert counter_deltas((12.0,), (100.0,)) == (12.0,)


def test_histogram_quantile_interpolates_within_the_bucket_like_prometheus():
    buckets = ((0.1, 50.0), (0.5, 90.0), (1.0, 100.0), (INF, 100.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)  # lowest starts at 0
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * 9 / 10)


def test_a_rank_in_the_inf_bucket_is_the_highest_finite_bound():
    assert histogram_quantile(0.99, ((0.1, 1.0), (1.0, 2.0), (INF, 10.0))) == 1.0


def test_no_observations_or_no_inf_bucket_is_no_quantile():
    assert histogram_quantile(0.5, ((0.1, 0.0), (INF, 0.0))) is None
    assert histogram_quantile(0.5, ((0.1, 3.0),)) is None
    assert histogram_quantile(0.5, ()) is None


def test_bucket_deltas_subtract_the_older_scrape_and_restart_after_a_reset():
    old = ((0.1, 10.0), (INF, 12.0))
    assert bucket_deltas(((0.1, 15.0), (INF, 20.0)), old) == ((0.1, 5.0), (INF, 8.0))
    assert bucket_deltas(((0.1, 1.0), (INF, 2.0)), old) == ((0.1, 1.0), (INF, 2.0))
    assert bucket_deltas(((0.1, 1.0), (INF, 2.0)), ()) == ((0.1, 1.0), (INF, 2.0))


def test_tokens_per_second_is_over_the_window_not_since_the_engine_started():
    history = History(window_s=60)
    history.add(snap(0.0, generation_tokens=1_000_000))
    history.add(snap(30.0, generation_tokens=1_000_300))
    history.add(snap(60.0, generation_tokens=1_001_200))
    assert history.rows()[0].tokens_per_s == pytest.approx(1200 / 60)
    history.add(snap(90.0, generation_tokens=1_001_500))  # the scrape at 0 s leaves
    assert len(history) == 3 and history.span_s == 60
    assert history.rows()[0].tokens_per_s == pytest.approx(1200 / 60)


def test_one_scrape_has_no_rates_yet():
    [row] = rows([snap(0.0, generation_tokens=50, ttft_buckets=((0.1, 3.0), (INF, 3.0)))])
    assert row.tokens_per_s is None and row.ttft_p50_s is None and row.ttft_p99_s is None


def test_ttft_percentiles_count_only_the_first_tokens_of_the_window():
    slow_past = ((0.1, 0.0), (1.0, 0.0), (10.0, 1000.0), (INF, 1000.0))
    fast_now = ((0.1, 100.0), (1.0, 100.0), (10.0, 1100.0), (INF, 1100.0))
    [row] = rows([snap(0.0, ttft_buckets=slow_past), snap(60.0, ttft_buckets=fast_now)])
    assert row.ttft_p50_s == pytest.approx(0.05)
    assert row.ttft_p99_s == pytest.approx(0.099)


def test_an_idle_window_has_no_ttft_rather_than_zero():
    same = ((0.1, 5.0), (INF, 5.0))
    [row] = rows([snap(0.0, ttft_buckets=same), snap(2.0, ttft_buckets=same)])
    assert row.ttft_p50_s is None


def test_a_restarted_replica_rates_from_its_new_counters():
    [row] = rows([snap(0.0, generation_tokens=5000), snap(10.0, generation_tokens=40)])
    assert row.tokens_per_s == pytest.approx(4.0)


def test_a_replica_that_appears_mid_window_rates_from_its_first_scrape():
    history = [Snapshot(0.0, ADMIN, {}), snap(10.0, generation_tokens=100),
               snap(20.0, generation_tokens=300)]
    assert rows(history)[0].tokens_per_s == pytest.approx(20.0)


def test_rows_carry_the_admin_view_and_pick_gpu_or_cpu_figures():
    gpu = rows([snap(0.0, gpu_utilization=0.5, gpu_memory_used_bytes=7.0,
                     gpu_memory_total_bytes=8.0, waiting=3.0)])[0]
    assert (gpu.id, gpu.state, gpu.version, gpu.in_flight) == ("r0", "ready", "step-000020", 2)
    assert gpu.adapters == ("support@step-000150@1802",)
    assert (gpu.utilization_of, gpu.utilization, gpu.memory_used_bytes,
            gpu.memory_total_bytes, gpu.waiting) == ("gpu", 0.5, 7.0, 8.0, 3.0)
    cpu = rows([snap(0.0, cpu_utilization=0.9, memory_rss_bytes=3e9)])[0]
    assert (cpu.utilization_of, cpu.utilization, cpu.memory_used_bytes,
            cpu.memory_total_bytes) == ("cpu", 0.9, 3e9, None)
    bare = rows([snap(0.0)])[0]
    assert (bare.utilization_of, bare.utilization, bare.waiting) == ("", None, None)


def test_prefix_hit_rate_is_the_engines_hits_per_query_over_the_window():
    history = History(window_s=60)
    history.add(snap(0.0, prefix_cache_hits=0, prefix_cache_queries=10_000))
    history.add(snap(30.0, prefix_cache_hits=900, prefix_cache_queries=11_000))
    assert history.rows()[0].prefix_hit_rate == pytest.approx(0.9)
    history.add(snap(90.0, prefix_cache_hits=1_000, prefix_cache_queries=12_000))
    assert history.rows()[0].prefix_hit_rate == pytest.approx(0.1)  # 0 s has left


def test_no_prefix_query_in_the_window_or_none_reported_is_no_hit_rate():
    idle = [snap(0.0, prefix_cache_hits=5, prefix_cache_queries=10),
            snap(2.0, prefix_cache_hits=5, prefix_cache_queries=10)]
    assert rows(idle)[0].prefix_hit_rate is None
    assert rows([snap(0.0), snap(2.0)])[0].prefix_hit_rate is None
    assert rows(idle[:1])[0].prefix_hit_rate is None


def test_a_restarted_engine_counts_hits_and_queries_from_zero_together():
    [row] = rows([snap(0.0, prefix_cache_hits=800, prefix_cache_queries=1000),
                  snap(10.0, prefix_cache_hits=30, prefix_cache_queries=40)])
    assert row.prefix_hit_rate == pytest.approx(0.75)
    # Hits already past their old count, queries not: one restart for both, not a
    # delta across it (which would be 40 hits for 20 queries).
    [row] = rows([snap(0.0, prefix_cache_hits=10, prefix_cache_queries=100),
                  snap(10.0, prefix_cache_hits=50, prefix_cache_queries=80)])
    assert row.prefix_hit_rate == pytest.approx(50 / 80)
    assert counter_deltas((50.0, 80.0), (10.0, 100.0)) == (50.0, 80.0)
    assert counter_deltas((50.0, 180.0), (10.0, 100.0)) == (40.0, 80.0)


ADMIN3 = tuple({"id": f"r{i}", "state": "ready"} for i in range(3))


def kv_snap(at: float, events: float, no_tokens: float, prompt: float, cached: float,
            hits: float, queries: float, gaps: float = 0.0, resyncs: float = 0.0) -> Snapshot:
    """A `kv-aware` router's scrape: r0 followed (its engine's prefix counters and the
    feed's), r1 stale, r2 not followed."""
    return Snapshot(at, ADMIN3, {
        "r0": ReplicaSample(prefix_cache_hits=hits, prefix_cache_queries=queries,
                            kv_index_blocks=1234, kv_index_stale=0, kv_events_following=1,
                            kv_event_gaps=gaps, kv_event_resyncs=resyncs),
        "r1": ReplicaSample(kv_index_blocks=12, kv_index_stale=1, kv_events_following=1),
        "r2": ReplicaSample(kv_events_following=0),
    }, RoutingSample({"events": events, "no_tokens": no_tokens, "no_events": 0},
                     {"prompt": prompt, "cached": cached}))


def test_kv_aware_rows_carry_what_the_index_knows_of_each_replica():
    r0, r1, r2 = rows([kv_snap(0.0, 0, 0, 0, 0, 0, 0)])
    assert (r0.kv_index_blocks, r0.kv_index_stale, r0.kv_events_following) == (1234, False, True)
    assert (r1.kv_index_stale, r1.kv_events_following) == (True, True)
    assert (r2.kv_index_blocks, r2.kv_index_stale, r2.kv_events_following) == (None, None, False)


def test_kv_summary_is_the_routers_decisions_and_hit_rates_over_the_window():
    history = [kv_snap(0.0, events=100, no_tokens=0, prompt=10_000, cached=5_000,
                       hits=5_000, queries=10_000, gaps=1, resyncs=1),
               kv_snap(30.0, events=190, no_tokens=10, prompt=20_000, cached=11_000,
                       hits=10_800, queries=20_000, gaps=4, resyncs=1)]
    assert kv_summary(history) == KVSummary(on_events=0.9, expected_hit_rate=0.6,
                                            found_hit_rate=0.58, resyncs=0, gaps=3)


def test_one_kv_scrape_has_no_window_figures_and_other_policies_no_kv_summary():
    assert kv_summary([kv_snap(0.0, 1, 1, 1, 1, 1, 1)]) == KVSummary(None, None, None,
                                                                    None, None)
    assert kv_summary([snap(0.0), snap(2.0)]) is None
    assert kv_summary([]) is None


def test_a_restarted_router_counts_its_decisions_from_zero():
    before = kv_snap(0.0, events=500, no_tokens=0, prompt=50_000, cached=40_000,
                     hits=0, queries=0)
    after = kv_snap(10.0, events=3, no_tokens=1, prompt=100, cached=25, hits=0, queries=0)
    summary = kv_summary([before, after])
    assert summary is not None
    assert (summary.on_events, summary.expected_hit_rate) == (0.75, 0.25)
