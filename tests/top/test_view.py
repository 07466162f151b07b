"""What the screen says for a row and for the fleet."""

from __future__ import annotations

import dataclasses

from dpserve.top.view import COLUMNS, cells, summary
from dpserve.top.window import Row

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

