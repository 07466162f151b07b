import math

import pytest

from loadtest.client import RequestRecord
from loadtest.metrics import (
    distribution,
    meets_slos,
    peak_concurrency,
    percentile_key,
    summarize,
    tpot_s,
)


def ok(i, *, ttft, latency, tokens, start=0.0, itl=(), prompt=10, replica=None):
    return RequestRecord(index=i, request_id=str(i), scheduled_s=start, start_s=start,
                         end_s=start + latency, ok=True, ttft_s=ttft, latency_s=latency,
                         itl_s=list(itl), output_tokens=tokens, prompt_tokens=prompt,
                         replica=replica)


def failed(i, reason, *, start=0.0, end=0.1, replica=None):
    return RequestRecord(index=i, request_id=str(i), scheduled_s=start, start_s=start,
                         end_s=end, error=reason, replica=replica)


def test_tpot_is_the_time_after_the_first_token_per_further_token():
    assert tpot_s(ok(0, ttft=0.1, latency=1.0, tokens=10)) == pytest.approx(0.1)


def test_a_one_token_answer_has_no_tpot():
    assert tpot_s(ok(0, ttft=0.1, latency=0.1, tokens=1)) is None
    assert tpot_s(failed(0, "timeout")) is None


def test_distributions_use_numpy_linear_percentiles_and_population_std():
    d = distribution([0.001, 0.002, 0.003, 0.004], [50, 90, 99.9])
    assert (d.count, d.mean, d.median) == (4, pytest.approx(2.5), pytest.approx(2.5))
    assert d.std == pytest.approx(math.sqrt(1.25))
    assert d.percentiles == {"p50": pytest.approx(2.5), "p90": pytest.approx(3.7),
                             "p99.9": pytest.approx(3.997)}


def test_nothing_measured_is_null_not_zero():
    d = distribution([], [99])
    assert (d.count, d.mean, d.median, d.std, d.percentiles) == (0, None, None, None,
                                                                 {"p99": None})


def test_percentile_keys():
    assert [percentile_key(p) for p in (90, 99.0, 99.9)] == ["p90", "p99", "p99.9"]


def test_peak_concurrency_counts_overlaps_not_touches():
    assert peak_concurrency([(0, 1), (0.5, 2), (1, 3)]) == 2
    assert peak_concurrency([(0, 1), (1, 2), (2, 3)]) == 1
    assert peak_concurrency([]) == 0


def test_summary_of_a_run():
    records = [
        ok(0, ttft=0.1, latency=1.0, tokens=10, start=0.0, itl=[0.1] * 9, prompt=20),
        ok(1, ttft=0.3, latency=2.2, tokens=20, start=0.5, itl=[0.1] * 19, prompt=30),
        failed(2, "timeout", start=0.6, end=3.0),
        failed(3, "http_503", start=0.7, end=0.8),
        failed(4, "timeout", start=0.9, end=3.5),
    ]
    m = summarize(records, duration_s=4.0, percentiles=[50])
    assert (m.completed, m.failed) == (2, 3)
    assert (m.total_input_tokens, m.total_output_tokens) == (50, 30)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx(20.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.tpot_ms.median == pytest.approx(100.0)  # (0.9/9 + 1.9/19) / 2
    assert m.itl_ms.count == 28
    assert m.e2el_ms.percentiles["p50"] == pytest.approx(1600.0)
    assert m.failures == {"timeout": 2, "http_503": 1}
    assert list(m.failures) == ["timeout", "http_503"]  # most frequent first
    assert m.peak_concurrency == 4  # at 0.75 s: requests 0-3 (4 starts after 3 ends)
    assert (m.request_goodput, m.good_requests) == (None, None)


def test_goodput_counts_successful_requests_within_every_slo():
    records = [
        ok(0, ttft=0.1, latency=1.0, tokens=10),   # tpot 100 ms
        ok(1, ttft=0.6, latency=1.5, tokens=10),   # ttft too slow
        ok(2, ttft=0.1, latency=2.0, tokens=10),   # tpot 211 ms: too slow
        ok(3, ttft=0.2, latency=0.2, tokens=1),    # one token: tpot counts as 0
        failed(4, "timeout"),
    ]
    slos = {"ttft": 500.0, "tpot": 150.0}
    assert [meets_slos(r, slos) for r in records] == [True, False, False, True, False]
    m = summarize(records, duration_s=2.0, slos_ms=slos)
    assert (m.good_requests, m.request_goodput) == (2, 1.0)
    assert summarize(records, 2.0, slos_ms={"e2el": 1000.0}).good_requests == 2


def test_per_replica_breakdown_from_the_router_header():
    records = [
        ok(0, ttft=0.1, latency=1.0, tokens=10, replica="r0"),
        ok(1, ttft=0.3, latency=1.0, tokens=5, replica="r1"),
        ok(2, ttft=0.1, latency=1.0, tokens=10, replica="r0"),
        failed(3, "http_500", replica="r1"),
        failed(4, "connect_error"),  # never reached a replica
    ]
    per = summarize(records, duration_s=2.0).per_replica
    assert list(per) == ["r0", "r1"]
    r0, r1 = per["r0"], per["r1"]
    assert (r0.requests, r0.completed, r0.failed, r0.output_tokens) == (2, 2, 0, 20)
    assert (r1.requests, r1.completed, r1.failed, r1.output_tokens) == (2, 1, 1, 5)
    assert (r0.share, r1.share) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    assert r0.request_throughput == 1.0
    assert r1.ttft_ms.median == pytest.approx(300.0)


def test_no_replica_header_means_no_breakdown():
    assert summarize([ok(0, ttft=0.1, latency=1.0, tokens=3)], 1.0).per_replica == {}


def test_a_run_where_everything_failed():
    m = summarize([failed(0, "connect_error"), failed(1, "connect_error")], 1.0)
    assert (m.completed, m.failed, m.failures) == (0, 2, {"connect_error": 2})
    assert m.ttft_ms.mean is None and m.request_throughput == 0.0


def test_gaps_read_together_and_the_sending_span():
    """A 0 gap is an event read with the one before (they share the read's timestamp)."""
    records = [ok(0, ttft=0.1, latency=1.0, tokens=5, start=0.0, itl=[0.0, 0.2, 0.0, 0.3]),
               ok(1, ttft=0.1, latency=1.0, tokens=3, start=1.5, itl=[0.0, 0.0]),
               failed(2, "timeout", start=2.5, end=3.0)]
    m = summarize(records, duration_s=3.0, percentiles=[50])
    assert m.itl_read_together == pytest.approx(4 / 6)
    assert m.itl_ms.median == 0.0  # what a bursty stream shows: past half, the median is 0
    assert m.sending_s == 2.5  # the failed request was sent too
    assert summarize([ok(0, ttft=0.1, latency=0.1, tokens=1)], duration_s=1.0,
                     percentiles=[50]).itl_read_together is None
