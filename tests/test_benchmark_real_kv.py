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
                                  ["--arms", "dpserve"], ["--model", "/nonexistent"]])
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
    assert ("| dpserve kv-aware | 55.0% [50.0%, 60.0%] | 150 | 100 | 200 | n/a | 150 | 50 | "
            "n/a | 2 |") in out
    assert "hit rate 1.125 [1.000, 1.250]" in out
