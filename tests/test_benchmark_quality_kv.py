"""The pure parts of `benchmarks.routing.quality_kv`: arms as written on the command line,
the routers' KV series, the chat load's windows and bound, vllm-router's event sources,
the alternation of the open-loop load, and the targets' verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.common.tools import vllm_router_kv_args
from benchmarks.routing import chat_load, quality_kv, workloads
from benchmarks.routing.kv_routers import router_command
from benchmarks.routing.load import config_from_spec
from benchmarks.routing.quality_kv_report import (
    Arm,
    Row,
    add_series,
    kv_series,
    parse_arm,
    verdicts,
)
from benchmarks.routing.sim_fleet import FleetDelta


def test_an_arm_is_kind_policy_and_an_optional_number_of_routers():
    assert parse_arm("dpserve:kv-aware") == Arm("dpserve", "kv-aware", 1)
    two = parse_arm(" vllm-router:cache_aware:2 ")
    assert two == Arm("vllm-router", "cache_aware", 2)
    assert (two.name, two.label) == ("vllm-router:cache_aware:2", "vllm-router cache_aware x2")
    assert parse_arm(Arm("dpserve", "kv-aware").name) == Arm("dpserve", "kv-aware")
    workers = parse_arm("dpserve:kv-aware:2:peers:w2")
    assert workers == Arm("dpserve", "kv-aware", 2, peers=True, workers=2)
    assert (workers.name, workers.label) == ("dpserve:kv-aware:2:peers:w2",
                                             "dpserve kv-aware x2 peers w2")
    assert parse_arm("dpserve:kv-aware:w3") == Arm("dpserve", "kv-aware", workers=3)
    for bad in ("dpserve", "dpserve:", "dpserve:kv-aware:0", "a:b:c:d", "dpserve:kv:two",
                "dpserve:kv-aware:w0", "dpserve:kv-aware:w2:2", "vllm-router:kv_aware:w2",
                "dpserve:kv-aware:peers"):
        with pytest.raises(ValueError):
            parse_arm(bad)


def test_an_arm_with_workers_starts_its_router_with_them():
    def argv(arm: str) -> list[str]:
        return router_command(parse_arm(arm), ["http://127.0.0.1:1"], 2, 3,
                              tokenizer="build/tiny-llama").argv

    two = argv("dpserve:kv-aware:w2")
    assert two[two.index("--workers") + 1] == "2"
    assert "--workers" not in argv("dpserve:kv-aware")


def test_the_kv_series_of_both_routers_are_read_and_summed():
    dpserve = """# HELP dpserve_kv_routing_decisions_total ...
dpserve_kv_routing_decisions_total{basis="events"} 5.0
dpserve_kv_routing_decisions_total{basis="no_events"} 1.0
dpserve_kv_routed_tokens_total{kind="prompt"} 600.0
dpserve_kv_routed_tokens_total{kind="cached"} 450.0
dpserve_kv_index_blocks{replica="r0"} 18.0
"""
    total = add_series(kv_series(dpserve), kv_series(dpserve))
    assert total['dpserve_kv_routing_decisions_total{basis="events"}'] == 10
    assert "dpserve_kv_index_blocks" not in "".join(total)
    row = Row(workload="chat-fits", arm=Arm("dpserve", "kv-aware", 2), kv=total)
    assert row.kv_summary() == "10/2/0 75%"
    vllm = ('\nvllm_router_kv_placement_lookups_total{result="miss"} 3\n\n'
            'vllm_router_requests_total{route="/v1/completions"} 3\n')
    row = Row(workload="chat-fits", arm=Arm("vllm-router", "kv_aware"), kv=kv_series(vllm))
    assert row.kv_summary() == "lookups 0 hit/3 miss"
    assert Row(workload="uniform", arm=Arm("dpserve", "prefix-affinity")).kv_summary() == "-"


def test_deploy_windows_average_the_turns_sent_in_each():
    turns = [{"sent_s": s, "ttft_s": t, "ok": ok} for s, t, ok in (
        (79.0, 0.1, True), (85.0, 0.3, True), (91.0, 0.9, True), (92.0, 0.5, True),
        (95.0, 9.9, False), (130.0, 0.1, True))]
    assert chat_load.window_means(turns, 80.0, 10.0, 4) == [300.0, 700.0, None, None]


def test_a_chat_run_is_bounded_by_its_longest_conversation():
    convs = workloads.chat(3, seed=1, start_window_s=10.0)
    bound = chat_load.schedule_s(convs, answer_s=5.0)
    assert bound == max(c.start_s + sum(t.think_s for t in c.turns) + 5.0 * len(c.turns)
                        for c in convs)


def test_vllm_router_is_pointed_at_each_replicas_event_ports():
    sources = [{"0": {"endpoint": "tcp://*:7001", "replay_endpoint": "tcp://*:7002"}},
               {"0": {"endpoint": "tcp://*:7003", "replay_endpoint": "tcp://*:7004"}}]
    argv = vllm_router_kv_args(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], sources,
                               block_size=16, model="sim-model")
    assert argv == ["--kv-event-block-size", "16", "--kv-event-model", "sim-model",
                    "--kv-event-source", "http://127.0.0.1:8001=tcp://127.0.0.1:7001",
                    "--kv-event-replay-source", "http://127.0.0.1:8001=tcp://127.0.0.1:7002",
                    "--kv-event-source", "http://127.0.0.1:8002=tcp://127.0.0.1:7003",
                    "--kv-event-replay-source", "http://127.0.0.1:8002=tcp://127.0.0.1:7004"]


def test_the_open_loop_load_sends_to_every_router_of_an_arm(tmp_path):
    spec = {"base_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
            "dataset_path": str(tmp_path / "p.jsonl"), "num_prompts": 4, "request_rate": 2,
            "seed": 0, "request_timeout_s": 5, "duration_s": None,
            "result_json": str(tmp_path / "r.json")}
    config = config_from_spec(spec)
    assert config.base_urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    one = config_from_spec({**spec, "base_urls": None, "base_url": "http://127.0.0.1:3"})
    assert one.base_urls == ("http://127.0.0.1:3",)


def test_smoke_runs_a_short_deploy_through_one_and_two_kv_aware_routers():
    args = quality_kv.parse_args(["--smoke"])
    assert args.workloads == ["chat-deploy"]
    assert args.arms == [Arm("dpserve", "kv-aware"), Arm("dpserve", "kv-aware", 2)]
    assert (args.replicas, args.turns, args.reset_at) == (4, 3, 15.0)
    args = quality_kv.parse_args(["--smoke", "--arms", "vllm-router:kv_aware"])
    assert args.arms == [Arm("vllm-router", "kv_aware")] and args.replicas == 4


def fleet(hit_rate: float) -> FleetDelta:
    return FleetDelta(prefix_cache_queries=1000.0, prefix_cache_hits=1000 * hit_rate,
                      hit_rate=hit_rate, preemptions=0.0, finished_per_replica=[1.0],
                      imbalance=1.0, steps=100.0, late_share=0.0, very_late_share=0.0,
                      resyncs=0.0, mean_error_ms=0.3, unreadable=0)


def row(workload: str, arm: str, hit_rate: float, mean: float, p99: float) -> Row:
    load: dict[str, Any] = {"metrics": {"completed": 10, "ttft_ms": {
        "mean": mean, "median": mean, "percentiles": {"p99": p99}}}}
    return Row(workload=workload, arm=parse_arm(arm), load=load, fleet=fleet(hit_rate))


def test_verdicts_compare_two_routers_with_one_and_kv_aware_with_its_peers(capsys):
    rows = [row("chat-fits", "dpserve:kv-aware", 0.70, 200, 800),
            row("chat-fits", "dpserve:kv-aware:2", 0.69, 212, 900),
            row("uniform", "dpserve:kv-aware", 0.0, 200, 300),
            row("uniform", "dpserve:kv-aware:2", 0.0, 205, 300),
            row("chat-1.5x", "dpserve:kv-aware", 0.60, 300, 1000),
            row("chat-1.5x", "dpserve:kv-aware:2", 0.55, 320, 1300),
            row("chat-1.5x", "dpserve:prefix-affinity", 0.58, 350, 4000),
            row("chat-1.5x", "vllm-router:cache_aware", 0.60, 310, 2500),
            row("chat-1.5x", "vllm-router:cache_aware:2", 0.30, 600, 1250)]
    got = {(v["workload"], v["target"]): v["verdict"] for v in verdicts(rows)}
    assert got == {
        ("chat-fits", "x2 hit rate"): "PASS",  # 0.986
        ("chat-fits", "x2 mean TTFT"): "FAIL",  # 1.06
        ("uniform", "x2 hit rate"): "n/a",  # nothing shared
        ("uniform", "x2 mean TTFT"): "PASS",
        ("chat-1.5x", "x2 hit rate"): "FAIL",  # 0.917
        ("chat-1.5x", "x2 mean TTFT"): "FAIL",
        ("chat-1.5x", "p99 vs best vllm-router"): "PASS",  # 1000 / 1250 = 0.80
        ("chat-1.5x", "hit rate vs prefix-affinity"): "PASS",  # 60% > 58%
        ("chat-1.5x", "p99 vs best vllm-router x2"): "info",  # 2 routers: reported only
    }
    assert "cache_aware x2 1,250 ms = 0.80" in capsys.readouterr().out
