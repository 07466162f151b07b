"""Session affinity (a bounded-load ring) and prefix affinity (homes in a table)."""

from __future__ import annotations

from collections import Counter

from dpserve.router.routing.policies import PrefixAffinity, RequestInfo, SessionAffinity
from tests.router.routing.policies.fakes import ScriptedRandom, replicas

ROUTE = "/v1/chat/completions"
SYSTEM = "You are a terse assistant who answers in French. " * 8  # 400 characters


def session(sid: str | None) -> RequestInfo:
    return RequestInfo(route=ROUTE, session_id=sid)


def prompt(text: str | None, model: str | None = "tiny") -> RequestInfo:
    return RequestInfo(route=ROUTE, model=model, prefix=text)


def test_every_turn_of_a_session_goes_to_the_same_replica():
    pool = replicas(0, 0, 0, 0)
    policy = SessionAffinity()
    homes = {policy.select(pool, session("alice")).id for _ in range(10)}
    assert len(homes) == 1


def test_sessions_spread_over_the_replicas():
    pool = replicas(0, 0, 0, 0)
    policy = SessionAffinity()
    homes = Counter(policy.select(pool, session(f"user-{i}")).id for i in range(400))
    assert all(70 < homes[r] < 130 for r in ("r0", "r1", "r2", "r3")), homes


def test_a_busy_session_spills_to_another_replica_instead_of_queueing():
    pool = replicas(0, 0, 0, 0)
    policy = SessionAffinity(load_factor=1.25)
    home = policy.select(pool, session("alice"))
    home.in_flight = 1  # one turn in flight; the fleet is otherwise idle: capacity 1
    assert policy.select(pool, session("alice")) is not home


def test_requests_without_a_session_use_the_less_loaded_of_two_random_replicas():
    pool = replicas(4, 1, 3)
    policy = SessionAffinity(rng=ScriptedRandom((0, 2), (0, 1)))
    assert [policy.select(pool, session(None)).id for _ in range(2)] == ["r2", "r1"]


def test_prompts_sharing_their_start_share_a_replica_whatever_follows():
    pool = replicas(0, 0, 0, 0)
    policy = PrefixAffinity(prefix_chars=256)
    homes = {policy.select(pool, prompt(SYSTEM + f"user: question {i}")).id for i in range(20)}
    assert len(homes) == 1


def test_prompts_with_different_starts_spread():
    pool = replicas(0, 0, 0, 0)
    policy = PrefixAffinity(prefix_chars=64)
    homes = Counter(policy.select(pool, prompt(f"system prompt number {i}: " + SYSTEM)).id
                    for i in range(400))
    assert all(70 < homes[r] < 130 for r in ("r0", "r1", "r2", "r3")), homes


def test_only_the_first_prefix_chars_count():
    pool = replicas(0, 0, 0, 0)
    policy = PrefixAffinity(prefix_chars=8)
    homes = {policy.select(pool, prompt(f"same 8c-{i}")).id for i in range(50)}
    assert len(homes) == 1  # 50 keys hashed apart would never all land on one of 4


def test_the_model_is_part_of_the_key():
    pool = replicas(0, 0, 0, 0, 0, 0, 0, 0)
    policy = PrefixAffinity()
    homes = {policy.select(pool, prompt(SYSTEM, model=f"model-{i}")).id for i in range(20)}
    assert len(homes) > 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_new_prefixes_get_homes_in_turn_and_keep_them():
    pool = replicas(0, 0, 0, 0)
    policy = PrefixAffinity(clock=Clock())
    first = [policy.select(pool, prompt(f"tenant {k}: " + SYSTEM)).id for k in range(4)]
    again = [policy.select(pool, prompt(f"tenant {k}: " + SYSTEM + "question")).id
             for k in (2, 2, 0, 3, 1)]
    assert first == ["r0", "r1", "r2", "r3"]
    assert again == ["r2", "r2", "r0", "r3", "r1"]


def test_a_new_prefix_goes_where_the_least_work_went_lately():
    pool = replicas(0, 0, 0)
    policy = PrefixAffinity(clock=Clock())
    for _ in range(3):
        policy.select(pool, prompt("hot: " + SYSTEM))  # r0, its home, three times
    assert [policy.select(pool, prompt(f"cold {k}: " + SYSTEM)).id for k in range(4)] == [
        "r1", "r2", "r1", "r2"]


def test_a_hot_prefix_spills_once_its_replica_is_at_the_bound():
    pool = replicas(3, 3, 3, 3)
    policy = PrefixAffinity(load_factor=1.25, clock=Clock())
    home = policy.select(pool, prompt(SYSTEM))
    home.in_flight = 5  # 14 in flight + 1 new over 4 replicas, 25% slack: capacity 5
    spill = policy.select(pool, prompt(SYSTEM))
    assert spill is not home
    home.in_flight = 4
    assert policy.select(pool, prompt(SYSTEM)) is home


def test_a_spilled_prefix_keeps_its_second_home_too():
    pool = replicas(3, 3, 3, 3)
    policy = PrefixAffinity(load_factor=1.25, clock=Clock())
    assert policy.select(pool, prompt(SYSTEM)).id == "r0"
    pool[0].in_flight = 5
    assert policy.select(pool, prompt(SYSTEM)).id == "r1"  # spilled: r1 is a home now
    pool[0].in_flight = 4
    # both homes open, equal work: the one after the last chosen in turn, then the other
    assert [policy.select(pool, prompt(SYSTEM)).id for _ in range(3)] == ["r0", "r1", "r0"]


def test_a_home_that_left_the_candidates_is_replaced():
    pool = replicas(0, 0, 0)
    policy = PrefixAffinity(clock=Clock())
    assert policy.select(pool, prompt(SYSTEM)).id == "r0"
    assert policy.select(pool[1:], prompt(SYSTEM)).id == "r1"  # r0 down, or tried already
    assert policy.select(pool, prompt(SYSTEM)).id in {"r0", "r1"}
    assert policy.select(pool[1:], prompt(SYSTEM)).id == "r1"


def test_the_least_recently_used_prefixes_are_forgotten_past_max_keys():
    pool = replicas(0, 0, 0, 0)
    policy = PrefixAffinity(max_keys=2, clock=Clock())
    assert [policy.select(pool, prompt(k)).id for k in ("a", "b", "a", "c")] == [
        "r0", "r1", "r0", "r2"]  # "b" is the least recently used of three: forgotten
    assert policy.select(pool, prompt("a")).id == "r0"
    assert policy.select(pool, prompt("b")).id == "r3"  # a new key: least work lately


def test_requests_without_a_prompt_are_spread_in_turn():
    pool = replicas(2, 0, 1)
    policy = PrefixAffinity(clock=Clock())
    assert [policy.select(pool, prompt(None)).id for _ in range(4)] == ["r0", "r1", "r2", "r0"]


def test_requests_without_a_prompt_skip_a_replica_over_the_bound():
    pool = replicas(9, 3, 3, 1)  # capacity at load factor 2: 9
    policy = PrefixAffinity(load_factor=2.0, clock=Clock())
    assert [policy.select(pool, prompt(None)).id for _ in range(4)] == ["r1", "r2", "r3", "r1"]
