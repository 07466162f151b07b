"""real_kv.py's pure parts: its conversations, its flags, its report (the runs need
real vLLM replicas and are a benchmark, not a test)."""

from __future__ import annotations

import pytest

from benchmarks.routing import real_chat, real_kv


def test_conversations_share_no_first_block_and_start_in_the_window():
    convs = real_chat.conversations(16, 4, system_sentences=15, start_window_s=8.0,
                                    think_s=1.0, seed=0)
    assert len({c.system[:40] for c in convs}) == 16
    assert all(len(c.questions) == 4 and 0 <= c.start_s <= 8.0 for c in convs)
    again = real_chat.conversations(16, 4, system_sentences=15, start_window_s=8.0,
                                    think_s=1.0, seed=0)
    assert again == convs


@pytest.mark.parametrize("argv", [["--pressure", "0"], ["--rounds", "0"],
                                  ["--arms", "dpserve"], ["--model", "/nonexistent"],
                                  ["--engine-cpus", "0-x"], ["--router-cpus", "4096"]])
def test_bad_flags_are_refused_naming_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        real_kv.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_the_report_pairs_arms_round_by_round(capsys):
    runs = []
    for rnd, (a, b) in enumerate([(50.0, 40.0), (60.0, 60.0)]):
        for arm, hits in (("dpserve:kv-aware", a), ("dpserve:prefix-affinity", b)):
            runs.append(real_kv.Run(1.5, rnd, arm, hits=hits, queries=100.0,
                                    ttft_ms=[100.0, 200.0], requests=2, moved=1,
                                    engine={"ttft_s": 0.2 * (rnd + 1), "ttft_n": 2.0,
                                            "queue_s": 0.1, "queue_n": 2.0,
                                            "preemptions": 1.0}))
    real_kv.report(runs, [real_kv.parse_arm("dpserve:kv-aware"),
                          real_kv.parse_arm("dpserve:prefix-affinity")])
    out = capsys.readouterr().out
    # the engines' own means over both rounds' requests: (0.2 + 0.4) s / 4, 0.2 s / 4
    # client head and router first byte: not given, so n/a; the loop lag likewise
    assert ("| dpserve kv-aware | 55.0% [50.0%, 60.0%] | 150 | 100 | 200 | n/a | n/a | 150 | "
            "50 | n/a | 2 |") in out
    assert out.count("| n/a | n/a |\n") == 2  # neither arm's loop lag is known
    assert "hit rate 1.125 [1.000, 1.250]" in out


def test_cpu_lists_read_as_taskset_reads_them():
    assert real_kv.parse_cpus("0") == {0}
    assert real_kv.parse_cpus("0,2-4") == {0, 2, 3, 4}
    with pytest.raises(ValueError):
        real_kv.parse_cpus("a")


def test_a_router_series_may_be_one_label_set(monkeypatch):
    body = (b'# TYPE x histogram\nx_bucket{le="0.01"} 7.0\nx_bucket{le="+Inf"} 9.0\n'
            b"x_count 9.0\n")
    monkeypatch.setattr(real_kv, "http_call", lambda url, timeout: (200, body))
    got = real_kv.scraped_totals(["a", "b"], {'x_bucket{le="0.01"}': "fast", "x_count": "n"})
    assert got == {"fast": 14.0, "n": 18.0}
