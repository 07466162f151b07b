"""What the screen says for a row and for the fleet."""

from __future__ import annotations

import dataclasses

from dpserve.top.view import COLUMNS, cells, columns, summary
from dpserve.top.window import KVSummary, Row

GIB = 2**30
ROW = Row(id="r0", state="ready", version="step-000020", adapters=(), device="gpu:0",
          in_flight=3, waiting=1.0, kv_cache_usage=0.42, tokens_per_s=812.25,
          ttft_p50_s=0.0853, ttft_p99_s=12.5, utilization=0.87, utilization_of="gpu",
          memory_used_bytes=70 * GIB, memory_total_bytes=80 * GIB, prefix_hit_rate=0.634)


def test_a_gpu_row_reads_as_a_person_would_write_it():
    assert dict(zip(COLUMNS, cells(ROW), strict=True)) == {
        "replica": "r0", "state": "ready", "version": "step-000020", "adapters": "-",
        "in-flight": "3", "waiting": "1", "tok/s": "812.2", "TTFT p50": "85 ms",
        "TTFT p99": "12.5 s", "KV": "42%", "prefix hit": "63%", "util": "gpu 87%",
        "memory": "70.0 GiB / 80.0 GiB"}


def test_a_cpu_row_shows_rss_and_unknown_figures_are_dashes():
    row = dataclasses.replace(ROW, utilization_of="cpu", utilization=0.5,
                              memory_used_bytes=300 * 2**20, memory_total_bytes=None,
                              waiting=None, tokens_per_s=None, ttft_p50_s=None,
                              kv_cache_usage=None, prefix_hit_rate=None,
                              adapters=("a@v1", "b@v2"))
    got = dict(zip(COLUMNS, cells(row), strict=True))
    assert (got["util"], got["memory"]) == ("cpu 50%", "300 MiB rss")
    assert got["waiting"] == got["tok/s"] == got["TTFT p50"] == got["KV"] == "-"
    assert got["prefix hit"] == "-"
    assert got["adapters"] == "a@v1,b@v2"


def test_the_summary_counts_ready_replicas_and_sums_tokens_per_second():
    down = dataclasses.replace(ROW, id="r1", state="down", in_flight=0, tokens_per_s=None)
    assert summary([ROW, down], span_s=30) == (
        "2 replicas, 1 ready · 3 in flight · 812.2 tok/s · rates over the last 30 s")
    assert summary([down], span_s=0) == "1 replica, 0 ready · 0 in flight"


def test_the_kv_index_column_shows_only_under_kv_aware_after_prefix_hit():
    assert "KV index" not in COLUMNS and columns(kv_aware=False) == COLUMNS
    assert columns(kv_aware=True)[10:13] == ("prefix hit", "KV index", "util")


def kv_index_cell(**fields: object) -> str:
    row = dataclasses.replace(ROW, **fields)  # type: ignore[arg-type]
    return dict(zip(columns(kv_aware=True), cells(row, kv_aware=True), strict=True))[
        "KV index"]


def test_the_kv_index_cell_is_the_blocks_known_or_why_the_replica_is_routed_blind():
    assert kv_index_cell(kv_index_blocks=1234.0, kv_index_stale=False,
                         kv_events_following=True) == "1234"
    assert kv_index_cell(kv_index_blocks=1234.0, kv_index_stale=True,
                         kv_events_following=True) == "stale"
    assert kv_index_cell(kv_events_following=False) == "off"
    assert kv_index_cell() == "-"  # nothing reported of it yet


KV = KVSummary(on_events=0.9, expected_hit_rate=0.6, found_hit_rate=0.581, resyncs=0,
               gaps=0)


def test_under_kv_aware_the_summary_puts_expected_hits_beside_found_ones():
    assert summary([ROW], span_s=30, kv=KV) == (
        "1 replica, 1 ready · 3 in flight · 812.2 tok/s · kv-aware: 90% on events, hit "
        "60% expected / 58% found · rates over the last 30 s")


def test_event_trouble_in_the_window_is_counted_in_the_summary():
    kv = dataclasses.replace(KV, resyncs=1, gaps=3)
    assert summary([ROW], span_s=30, kv=kv).endswith(
        "58% found, 1 resync, 3 gaps · rates over the last 30 s")


def test_a_kv_summary_without_window_figures_is_dashes():
    idle = dataclasses.replace(ROW, tokens_per_s=None)
    assert summary([idle], span_s=0, kv=KVSummary(None, None, None, None, None)) == (
        "1 replica, 1 ready · 3 in flight · kv-aware: - on events, hit - expected / - found")
