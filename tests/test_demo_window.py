"""The demo's TTFT before and during its deploy, from a load-test result document."""

from __future__ import annotations

from dpserve.demo.deploy_window import ttft_windows

ZERO = 1_000.0  # the run's time zero, Unix seconds


def request(start_s: float, ttft_s: float | None, ok: bool = True) -> dict:
    return {"ok": ok, "start_s": start_s, "ttft_s": ttft_s}


def doc(*requests: dict) -> dict:
    return {"metadata": {"time_zero_unix_s": ZERO}, "requests": list(requests)}


def test_requests_are_split_by_when_they_waited_for_their_first_token():
    windows = ttft_windows(doc(
        request(1.0, 0.5),     # before the steady window
        request(5.0, 0.2),     # steady
        request(9.0, 0.9),     # steady: its first token came before the deploy
        request(9.5, 1.0),     # sent before, still waiting when the deploy started
        request(11.0, 0.1),    # during
        request(12.5, 0.2),    # sent after the deploy: neither
        request(11.0, None, ok=False),  # failed: no TTFT
    ), deploy_start=ZERO + 10, deploy_end=ZERO + 12, steady_s=6)
    assert windows.steady == [0.2, 0.9]
    assert windows.during == [1.0, 0.1]
    line = windows.line()
    assert line.startswith("TTFT p50 / p99: 550 / 893 ms (2 requests) before the deploy")
    assert line.endswith("550 / 991 ms (2 requests) during it")


def test_a_deploy_no_request_overlapped_says_so():
    windows = ttft_windows(doc(request(1.0, 0.1)), deploy_start=ZERO + 10,
                           deploy_end=ZERO + 11, steady_s=20)
    assert windows.during == [] and windows.line().endswith("no request during it")
