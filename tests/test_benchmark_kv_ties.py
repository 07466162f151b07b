"""`python -m benchmarks.routing.kv_ties` on a tiny fleet: it prints every arm, and what it
records is what each what-if claims: the index is never behind the engines when a turn
is placed, and a router reading the live queue never sees it short."""

from __future__ import annotations

from benchmarks.routing import kv_study, kv_ties, workloads
from benchmarks.routing.kv_study import Arm

REPLICAS = 4


def watched(name: str) -> kv_ties.Watch:
    what = next(a for a in kv_ties.what_ifs([2.0]) if a.name == name)
    convs = workloads.chat(8, seed=0, start_window_s=2.0, think_s=1.0)
    cfg = kv_study.sim_config(convs, REPLICAS, pressure=0.5)
    watch = kv_ties.Watch(what, convs)
    run = kv_study.simulate(Arm("kv-aware", what.routers), convs, cfg, replicas=REPLICAS,
                            reset_at=None, probe=watch)
    assert set(watch.decisions) == {(p.conversation, p.turn) for p in run.placements}
    return watch


def test_the_index_is_never_behind_the_engines_when_a_turn_is_placed():
    assert not any(d.lag for d in watched("x2").decisions.values())


def test_with_the_live_queue_no_router_counts_fewer_requests_than_the_engine_holds():
    assert not any(d.queue_low for d in watched("x2 live queue").decisions.values())


def test_one_router_never_lands_on_a_prefill_another_router_sent():
    assert not any(d.others for d in watched("x1").decisions.values())


def test_the_diagnosis_prints_every_arm_and_where_the_extra_time_went(capsys):
    assert kv_ties.main(["--seeds", "0", "--conversations", "6", "--replicas", "2",
                         "--pressure", "0.75", "--reset-at", "20"]) == 0
    out = capsys.readouterr().out
    for what in kv_ties.what_ifs([2.0]):
        assert f"\n{what.name:<28}" in out
    assert "extra TTFT over the base arm" in out and "first turn" in out
