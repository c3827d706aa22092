"""`iterserve bench`'s shared-prefix workloads (bench/shared_prefix.py): seeded, prefixes shared as
their parameters say, histories resent turn after turn, and the best possible hit count."""

from __future__ import annotations

import argparse

import pytest

from iterserve.bench import cli as bench_cli
from iterserve.bench.shared_prefix import max_prefix_hits
from iterserve.bench.workload import WorkloadError, WorkloadSpec, generate_requests, parse_length


def _requests(n=40, **kw):
    return list(generate_requests(WorkloadSpec(**kw), n))


@pytest.mark.parametrize("shape", ["system-prompt", "multi-turn", "shared-mix"])
def test_same_seed_same_requests(shape):
    a, b, c = (_requests(shape=shape, seed=s, prefix_len=64) for s in (1, 1, 2))
    assert a == b
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]


def test_system_prompt_requests_share_one_of_n_prefixes():
    reqs = _requests(200, shape="system-prompt", prefix_len=100, num_prefixes=3,
                     input_len=parse_length("uniform:5:9"), output_len=parse_length("7"))
    heads = {tuple(r.prompt_ids[:100]) for r in reqs}
    assert len(heads) == 3
    for r in reqs:
        assert 105 <= len(r.prompt_ids) <= 109 and r.input_len == len(r.prompt_ids) and r.max_tokens == 7
        system, user = r.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert r.prompt_text.startswith(system["content"])
    assert len({r.messages[0]["content"] for r in reqs}) == 3
    assert len({tuple(r.prompt_ids[100:]) for r in reqs}) > 150  # the questions are the requests' own


def test_multi_turn_resends_the_history_and_starts_new_conversations():
    reqs = _requests(24, shape="multi-turn", prefix_len=50, num_prefixes=2, num_turns=3,
                     input_len=parse_length("10"), output_len=parse_length("5"))
    # conversations 0 and 1 interleaved for 3 turns, then 2 and 3
    for first, second in zip(reqs, reqs[2:], strict=False):
        if second.index % 6 >= 2:  # a later turn of the same conversation
            assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
            assert len(second.prompt_ids) == len(first.prompt_ids) + 5 + 10  # its answer, then a new question
            assert second.messages[: len(first.messages)] == first.messages
            assert [m["role"] for m in second.messages[-3:]] == ["user", "assistant", "user"]
        else:
            assert second.prompt_ids[:50] != first.prompt_ids[:50] and len(second.prompt_ids) == 60
    assert len({tuple(r.prompt_ids[:50]) for r in reqs}) == 8


def test_multi_turn_histories_fit_the_context():
    for r in _requests(60, shape="multi-turn", prefix_len=40, num_turns=50, max_model_len=200,
                       input_len=parse_length("20"), output_len=parse_length("10")):
        assert len(r.prompt_ids) + r.max_tokens <= 200


def test_shared_mix_draws_every_kind():
    kinds = [r.kind for r in _requests(1000, shape="shared-mix", prefix_len=32)]
    shares = {k: kinds.count(k) / len(kinds) for k in set(kinds)}
    assert shares.keys() == {"system-prompt", "multi-turn", "random"}
    assert abs(shares["random"] - 0.2) < 0.05


def test_max_prefix_hits_counts_whole_blocks_found_earlier():
    a = list(range(40))
    assert max_prefix_hits([a], 16) == (40, 0)
    assert max_prefix_hits([a, a], 16) == (80, 32)
    assert max_prefix_hits([a[:32], a[:32]], 16) == (64, 16)  # the last token is always computed
    assert max_prefix_hits([a, a[:20] + [99] * 20], 16) == (80, 16)
    assert max_prefix_hits([a, [7] + a[1:]], 16) == (80, 0)
    reqs = _requests(50, shape="system-prompt", prefix_len=64, num_prefixes=2, input_len=parse_length("8"))
    queries, hits = max_prefix_hits([r.prompt_ids for r in reqs], 16)
    assert queries == 50 * 72 and hits == 48 * 64


@pytest.mark.parametrize("field", ["prefix_len", "num_prefixes", "num_turns"])
def test_bad_parameters_are_refused_by_name(field):
    with pytest.raises(WorkloadError, match=f"--{field.replace('_', '-')}"):
        WorkloadSpec("system-prompt", **{field: 0})


def test_cli_flags_reach_the_workload():
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--url", "http://127.0.0.1:1", "--out", "o", "--workload", "multi-turn",
                              "--concurrency", "2",
                              "--prefix-len", "300", "--num-prefixes", "6", "--num-turns", "5"])
    w = bench_cli.config_from_args(args).workload
    assert (w.shape, w.prefix_len, w.num_prefixes, w.num_turns) == ("multi-turn", 300, 6, 5)
    assert w.describe()["num_turns"] == 5
