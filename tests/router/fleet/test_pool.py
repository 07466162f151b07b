from __future__ import annotations

import pytest

from dpserve.router.fleet.pool import Replica, ReplicaPool, ReplicaState


def make_pool(*states: ReplicaState) -> ReplicaPool:
    return ReplicaPool([Replica(id=f"r{i}", url=f"http://r{i}", state=s,
                                models=frozenset({f"m{i}"})) for i, s in enumerate(states)])


def test_only_ready_replicas_take_requests():
    pool = make_pool(ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.STARTING,
                     ReplicaState.RELOADING, ReplicaState.DOWN, ReplicaState.READY)
    assert [r.id for r in pool.ready()] == ["r0", "r5"]


def test_mark_down_takes_a_replica_out_and_notifies_listeners():
    pool = make_pool(ReplicaState.READY, ReplicaState.READY)
    seen = []
    pool.on_state_change(lambda r, old, new: seen.append((r.id, old, new)))
    pool.mark_down(pool.get("r1"), "connection refused")
    assert [r.id for r in pool.ready()] == ["r0"]
    assert pool.get("r1").last_error == "connection refused"
    assert seen == [("r1", ReplicaState.READY, ReplicaState.DOWN)]


def test_mark_down_leaves_admin_states_alone():
    pool = make_pool(ReplicaState.RELOADING)
    pool.mark_down(pool.get("r0"), "boom")
    assert pool.get("r0").state is ReplicaState.RELOADING


def test_served_models_are_those_of_ready_replicas():
    pool = make_pool(ReplicaState.READY, ReplicaState.DOWN)
    assert pool.served_models() == {"m0"}


def test_replica_ids_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        ReplicaPool([Replica(id="a", url="u"), Replica(id="a", url="v")])


def test_a_replica_turning_ready_has_no_last_error_and_has_been_ready_until_it_restarts():
    pool = make_pool(ReplicaState.READY)
    replica = pool.get("r0")
    pool.mark_down(replica, "connection refused")
    assert replica.last_error == "connection refused"
    pool.set_state(replica, ReplicaState.READY, "health checks pass")
    assert replica.last_error is None and replica.has_been_ready
    pool.set_state(replica, ReplicaState.DOWN, "process exited with code 1")
    assert replica.has_been_ready  # its failed checks while down are an outage
    pool.set_state(replica, ReplicaState.STARTING)
    assert not replica.has_been_ready  # the restarted engine is loading
