"""The routing policies alone: least-load's ranking, and CHWBL's stickiness, bound and stability."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.router.policy import HashRing, LeastLoad, PodLoad, PrefixHash, RoundRobin, make_policy
from iterserve.router.prefix_key import prompt_text, routing_key

PODS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


def loads(**in_flight) -> list[PodLoad]:
    return [PodLoad(name, in_flight=in_flight.get(f"p{i}", 0)) for i, name in enumerate(PODS, 1)]


@pytest.mark.parametrize("pods,expected", [
    # the larger of the router's in-flight count and the pod's waiting + running decides
    ([PodLoad("a", in_flight=3), PodLoad("b", in_flight=1), PodLoad("c", in_flight=2)], "b"),
    ([PodLoad("a", in_flight=0, waiting=5), PodLoad("b", in_flight=2, waiting=0)], "b"),
    ([PodLoad("a", in_flight=0, running=3), PodLoad("b", in_flight=2)], "b"),  # another router's traffic
    ([PodLoad("a", in_flight=2, running=2), PodLoad("b", in_flight=0, running=3)], "a"),  # counted once
    ([PodLoad("a", in_flight=1, waiting=1), PodLoad("b", in_flight=3)], "a"),
    # the scrape counted two of this router's requests that have ended since: b runs one, not three
    ([PodLoad("a", running=2), PodLoad("b", running=3, ended=2)], "b"),
    # KV usage breaks a tie
    ([PodLoad("a", in_flight=1, kv_usage=0.9), PodLoad("b", in_flight=1, kv_usage=0.2)], "b"),
    ([PodLoad("a", kv_usage=0.1), PodLoad("b", kv_usage=0.5), PodLoad("c", kv_usage=0.3)], "a"),
    # the prefill ahead: a long prompt being prefilled outweighs a few decoding requests ...
    ([PodLoad("a", running=1, prompt_tokens_pending=900), PodLoad("b", running=4)], "b"),
    # ... but not many of them (32 tokens a request), nor a short prompt's
    ([PodLoad("a", running=1, prompt_tokens_pending=100), PodLoad("b", running=8)], "a"),
    ([PodLoad("a", running=2, prompt_tokens_pending=20), PodLoad("b", running=3)], "a"),
    # what this router sent since the last scrape counts (its requests still in flight)
    ([PodLoad("a", unscraped={1: 600, 2: 200}), PodLoad("b", running=4)], "b"),
    ([PodLoad("a", unscraped={1: 20}), PodLoad("b", running=4)], "a"),
])
def test_least_load_picks_the_least_queued(pods, expected):
    assert LeastLoad().pick(pods).pod == expected


def test_least_requests_ignores_the_prefill_ahead():
    pods = [PodLoad("a", running=1, prompt_tokens_pending=900), PodLoad("b", running=4)]
    assert make_policy("least-requests").pick(pods).pod == "a"
    assert make_policy("least-load").pick(pods).pod == "b"


def test_round_robin_is_blind_to_load_and_cycles_by_name():
    policy = RoundRobin()
    skewed = loads(p1=50, p2=0, p3=7)  # load does not matter: what a Kubernetes Service does
    assert [policy.pick(skewed).pod for _ in range(8)] == PODS * 2
    # the order is the names', not the list's: a reordered healthy list keeps the rotation
    assert policy.pick(list(reversed(skewed))).pod == PODS[0]
    # a pod gone from the healthy list is skipped, the others keep alternating
    assert [policy.pick(skewed[:2]).pod for _ in range(4)] == [PODS[1], PODS[0], PODS[1], PODS[0]]
    assert isinstance(make_policy("round-robin"), RoundRobin)
    with pytest.raises(LookupError):
        policy.pick([])


def test_least_load_takes_turns_among_equal_pods():
    policy = LeastLoad()
    picks = collections.Counter(policy.pick(loads()).pod for _ in range(400))
    assert picks == {name: 100 for name in PODS}


def test_no_pod_is_an_error_not_a_guess():
    for policy in (LeastLoad(), PrefixHash()):
        with pytest.raises(LookupError):
            policy.pick([], "key")


def test_same_prefix_same_pod_and_keys_spread():
    policy = PrefixHash()
    owners = {f"system prompt {i}": policy.pick(loads(), f"system prompt {i}").pod for i in range(200)}
    for key, pod in owners.items():
        assert policy.pick(loads(), key).pod == pod  # sticky while no pod is over the bound
    spread = collections.Counter(owners.values())
    assert set(spread) == set(PODS) and min(spread.values()) >= 25, spread  # 100 virtual nodes: no pod starves


def test_bounded_load_spills_to_the_next_pod_on_the_ring():
    policy = PrefixHash(load_factor=1.25)
    key = "a shared system prompt"
    home = policy.pick(loads(), key).pod
    ring_order = list(policy._ring.walk(key))
    assert ring_order[0] == home
    # 8 in flight on home, 0 elsewhere: bound = ceil(1.25 * 9 / 4) = 3, home is over it
    pods = [PodLoad(name, in_flight=8 if name == home else 0) for name in PODS]
    decision = policy.pick(pods, key)
    assert decision.pod == ring_order[1] and decision.spilled
    # under the bound the key goes home again
    pods = [PodLoad(name, in_flight=1) for name in PODS]  # bound ceil(1.25 * 5 / 4) = 2: home takes a second
    assert policy.pick(pods, key).pod == home and not policy.pick(pods, key).spilled


@settings(max_examples=200, deadline=None)
@given(in_flight=st.lists(st.integers(0, 50), min_size=1, max_size=6), key=st.text(max_size=40),
       load_factor=st.floats(1.0, 3.0))
def test_chwbl_always_places_within_the_bound(in_flight, key, load_factor):
    pods = [PodLoad(f"pod-{i}", in_flight=n) for i, n in enumerate(in_flight)]
    decision = PrefixHash(load_factor).pick(pods, key)
    chosen = next(p for p in pods if p.name == decision.pod)
    bound = load_factor * (sum(in_flight) + 1) / len(pods)
    assert chosen.in_flight + 1 <= -(-bound // 1)  # ceil: the request being placed keeps it within the bound


def test_removing_a_pod_moves_only_its_keys():
    policy = PrefixHash()
    keys = [f"conversation {i}" for i in range(500)]
    before = {k: policy.pick(loads(), k).pod for k in keys}
    gone = PODS[2]
    remaining = [p for p in loads() if p.name != gone]
    after = {k: policy.pick(remaining, k).pod for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone}
    # and when it returns, its keys come back to it: the ring kept its arcs
    assert {k: policy.pick(loads(), k).pod for k in keys} == before


def test_a_new_ring_moves_only_the_new_pods_share():
    keys = [f"k{i}" for i in range(1000)]
    old, new = HashRing(PODS[:3]), HashRing(PODS)
    moved = [k for k in keys if next(old.walk(k)) != next(new.walk(k))]
    assert all(next(new.walk(k)) == PODS[3] for k in moved)
    assert 150 <= len(moved) <= 350  # about a quarter of the keys


def test_a_load_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        PrefixHash(0.9)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


@pytest.mark.parametrize("body,chars,expected", [
    ({"prompt": "hello world"}, 5, "hello"),
    ({"prompt": ["first prompt", "second"]}, 100, "first prompt"),
    ({"prompt": [1, 2, 3]}, 100, "1 2 3"),
    ({"prompt": [[7, 8], [9]]}, 100, "7 8"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}, 100,
     "system:be brief\nuser:hi\n"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     100, "user:ab\n"),
    ({"messages": [{"role": "system", "content": "x" * 50}, {"role": "user", "content": "y"}]}, 10, "system:xxx"),
    ({"model": "m"}, 10, ""),
])
def test_prompt_text(body, chars, expected):
    assert prompt_text(body, chars) == expected


def test_routing_key_of_a_body_that_is_not_a_json_object():
    assert routing_key(b"not json at all", 3) == "not"
    assert routing_key(b"[1, 2]", 100) == "[1, 2]"
    assert routing_key(b'{"prompt": "abc"}', 100) == "abc"
