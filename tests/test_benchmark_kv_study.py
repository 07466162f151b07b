"""`python -m benchmarks.routing.kv_study` on a tiny fleet: it runs to its tables, and two
kv-aware routers reading one KV index send each conversation's turns where its prefix
is cached, whichever of them places the turn (two prefix-affinity routers, each with
its own memory, do not)."""

from __future__ import annotations

from collections import defaultdict

from benchmarks.routing import kv_study, workloads
from benchmarks.routing.kv_study import Arm, Placement
from benchmarks.routing.sim_fleet import SIM_CONFIG

REPLICAS = 4


def turns_by_conversation(placements: list[Placement]) -> dict[int, list[Placement]]:
    by: dict[int, list[Placement]] = defaultdict(list)
    for p in sorted(placements, key=lambda p: (p.conversation, p.turn)):
        by[p.conversation].append(p)
    return by


def play(policy: str) -> tuple[list[workloads.Conversation], dict[int, list[Placement]]]:
    convs = workloads.chat(4, seed=0, start_window_s=5.0, think_s=1.0)
    cfg = kv_study.sim_config(convs, REPLICAS, pressure=0.5)  # room for everything
    run = kv_study.simulate(Arm(policy, 2), convs, cfg, replicas=REPLICAS, reset_at=None)
    return convs, turns_by_conversation(run.placements)


def test_two_kv_aware_routers_send_every_turn_where_its_conversation_is_cached():
    convs, by = play("kv-aware")
    bs = SIM_CONFIG["block_size"]
    assert isinstance(bs, int)
    for c, placed in by.items():
        assert [p.turn for p in placed] == list(range(len(convs[c].turns)))
        assert {p.router for p in placed} == {0, 1}  # both routers placed its turns
        assert len({p.replica for p in placed}) == 1
        for p in placed[1:]:
            before = convs[c].turns[p.turn - 1]
            # all of the last prompt and answer but the answer's last token (never computed)
            assert p.cached_tokens == (len(before.ids) + before.output_tokens - 1) // bs * bs


def test_two_prefix_affinity_routers_each_give_a_conversation_its_own_home():
    _, by = play("prefix-affinity")
    assert any(len({p.replica for p in placed}) > 1 for placed in by.values())


def test_the_study_prints_its_tables_and_the_reset_s_timeline(capsys):
    assert kv_study.main(["--seeds", "0,1", "--conversations", "6", "--replicas", "2",
                          "--reset-at", "20", "--start-window-s", "5", "--think-s", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("== working set / fleet KV cache") == 2
    for arm in kv_study.ARMS:
        assert f"\n{arm.name:<20}" in out
    assert "kv-aware x2 / kv-aware: hit rate" in out and "best peer" in out
    assert "hit rate % per 10 s window" in out and "reset at 20 s" in out
