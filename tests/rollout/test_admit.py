"""What a replica goes through before it enters rotation (`Admission`), against the
shared fake replica: a warm-up request the engine must answer like a canary, then the
adapters. The warm-up's effect on a real engine (its one-time set-up paid before any
client request) is in tests/integration/test_deploy.py."""

from __future__ import annotations

from dpserve.rollout.admit import Admission
from dpserve.router.fleet.pool import Replica, ReplicaState
from tests.fakes import MODEL


def replica_of(fake) -> Replica:
    return Replica(id=fake.name, url=fake.url, state=ReplicaState.STARTING,
                   models=frozenset({MODEL, "support@v1"}))


async def test_the_engine_answers_a_greedy_logprobs_request_before_its_adapters_load(
        fake_replicas):
    fake = await fake_replicas("r0")
    requests_before_adapters: list[int] = []

    async def adapters(replica: Replica) -> str | None:
        requests_before_adapters.append(len(fake.requests))
        return None

    assert await Admission(then=adapters)(replica_of(fake)) is None
    [warm_up] = fake.requests
    assert warm_up["model"] == MODEL  # the base weights, not an adapter it holds
    assert warm_up["temperature"] == 0 and warm_up["logprobs"] == 1
    assert requests_before_adapters == [1]


async def test_an_engine_that_cannot_answer_is_not_admitted_and_says_why(fake_replicas):
    fake = await fake_replicas("r0", mode="error500")
    called: list[Replica] = []

    async def adapters(replica: Replica) -> str | None:
        called.append(replica)
        return None

    problem = await Admission(then=adapters)(replica_of(fake))
    assert problem is not None and problem.startswith("warm-up request failed: ")
    assert "HTTP 500" in problem and not called

