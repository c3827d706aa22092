"""The conformance script's comparison (benchmarks/api_conformance.py): what counts as a difference between
two servers' answers to one request, and which differences are marked intended."""

from __future__ import annotations

from benchmarks.api_conformance import NULL_FIELD, compare, diff, intended, shape
from benchmarks.api_conformance_suite import CASES, Case


def test_shape_names_json_types_and_lists_by_their_first_item():
    assert shape({"a": 1, "b": 1.5, "c": True, "d": None, "e": "x", "f": [{"g": 1}], "h": []}) == {
        "a": "number", "b": "number", "c": "bool", "d": "null", "e": "str", "f": [{"g": "number"}], "h": []}


def test_diff_finds_missing_extra_and_retyped_fields_but_not_volatile_values():
    ours = {"id": "a", "created": 1, "object": "chat.completion", "choices": [{"index": 0, "x": 1}], "extra": 2}
    theirs = {"id": "b", "created": 2, "object": "chat.completion", "choices": [{"index": 0, "x": "1"}],
              "more": None}
    assert diff(ours, theirs) == [
        ("$.choices[0].x", '"number"', '"str"'),
        ("$.extra", "number", "(absent)"),
        ("$.more", "(absent)", "null"),
    ]
    assert diff(ours, ours) == []


def test_contract_values_differ_but_free_text_fields_do_not():
    ours = {"object": "text_completion", "choices": [{"finish_reason": "stop", "text": "a"}],
            "usage": {"prompt_tokens": 3}}
    theirs = {"object": "chat.completion", "choices": [{"finish_reason": "length", "text": "b"}],
              "usage": {"prompt_tokens": 4}}
    assert [p for p, _, _ in diff(ours, theirs)] == ["$.choices[0].finish_reason", "$.object",
                                                      "$.usage.prompt_tokens"]


def test_compare_reports_status_and_greedy_text_and_skips_values_of_sampled_requests():
    greedy = Case("g", "/v1/completions", {"prompt": "x"})
    sampled = Case("s", "/v1/completions", {"prompt": "x"}, compare_text=False)
    a = {"choices": [{"text": "one", "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}
    b = {"choices": [{"text": "two", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}
    assert [p for p, _, _ in compare(greedy, (200, a), (200, b))] == [
        "$.choices[0].finish_reason", "$.usage.completion_tokens", "text"]
    assert compare(sampled, (200, a), (200, b)) == []
    assert compare(greedy, (400, {"error": {}}), (200, a))[0] == ("status", "400", "200")


def test_intended_differences_are_matched_by_case_and_path():
    unknown_field = Case("error: unknown field", "/v1/chat/completions", {})
    other = Case("chat", "/v1/chat/completions", {})
    assert intended(unknown_field, "status", "400", "200")
    assert intended(other, "status", "400", "200") is None
    assert intended(other, "$.error.type", "'invalid_request_error'", "'BadRequestError'")
    assert intended(other, "$.kv_transfer_params", "(absent)", "null") == NULL_FIELD
    assert intended(other, "$.choices[0].text", "(absent)", "str") is None


def test_the_suite_names_each_case_once_and_posts_json_bodies():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    for case in CASES:
        assert case.path.startswith("/")
        assert case.body is None or case.raw is None
