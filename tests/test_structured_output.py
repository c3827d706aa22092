"""Structured output on the engine, with a tiny random model: the grammar is all that makes its output JSON.

Hypothesis draws JSON schemas (objects, arrays, enums, nesting, optional fields, string patterns and
maxLength, bounded integers); every output must parse and validate against its schema. Each schema is
bounded (maxLength, maxItems, integer bounds), and `max_bytes` bounds the longest document it allows, so
max_tokens (one byte a token with this tokenizer) always leaves room to close it: finish_reason must be
"stop" — never "length". Then: grammars through preemption, chunked prefill and aborts, and requests
without a grammar unchanged by batch mates that have one.
"""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.server.engine.channels import QueueChannel
from iterserve.server.engine.core_proc import EngineCoreLoop
from iterserve.server.engine.messages import AddChecked, AddReply, AddRequest, SchemaCheck
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.structured_output import StructuredOutput
from iterserve.server.errors import InvalidRequestError
from tests.conftest import make_engine
from tests.server_support import with_special_eos


@pytest.fixture(scope="module")
def json_model(tiny_dir, tmp_path_factory):
    return with_special_eos(tiny_dir, tmp_path_factory.mktemp("tiny-json"))


@pytest.fixture(scope="module")
def engine(json_model):
    return make_engine(json_model, max_model_len=512, kv_cache_memory="16MiB")


def run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [engine.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in zip(prompts, params, strict=True)]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def grammar(schema) -> StructuredOutput:
    return StructuredOutput(json_schema=json.dumps(schema))


# -- schemas ----------------------------------------------------------------------------------------

PATTERNS = ["^[a-z]{1,6}$", "^[A-Z][a-z]{0,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no|maybe)$"]
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
scalars = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
              st.integers(0, 3), st.integers(0, 5)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(names, st.integers(-9, 99), st.booleans()),
                                                 min_size=1, max_size=4, unique=True)),
)


def _object(children):
    return st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


def _array(children):
    return st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))


schemas = st.recursive(scalars, lambda children: st.one_of(_object(children), _array(children)), max_leaves=6)


def max_bytes(schema: dict) -> int:
    """The longest compact document `schema` allows, in UTF-8 bytes (a character is at most 4)."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        if "pattern" in schema:
            return 2 + 4 * 8  # the patterns above match at most 7 characters
        return 2 + 4 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(k)) + 2 + max_bytes(v) for k, v in schema["properties"].items())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas.filter(lambda s: max_bytes(s) <= 400), seed=st.integers(0, 2**31))
def test_every_output_validates_against_its_schema(engine, schema, seed):
    bound = max_bytes(schema) + 1  # + EOS
    # random draws (each its own seed) and a greedy one, batched together
    params = [SamplingParams(max_tokens=bound, temperature=1.0, seed=seed + i, structured_output=grammar(schema))
              for i in range(3)]
    params.append(SamplingParams(max_tokens=bound, temperature=0, structured_output=grammar(schema)))
    outputs = run(engine, [[10 + i, 20, 30] for i in range(len(params))], params)
    for out in outputs:
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert engine.core.grammar.num_live == 0  # every matcher freed with its request


def test_json_object_gives_an_object(engine):
    spec = StructuredOutput(json_object=True)
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_output=spec) for s in range(4)]
    for out in run(engine, [[5, 6, 7]] * 4, params):
        # nesting is not bounded here: a random model may still be inside the object at max_tokens, and
        # then the text must be a prefix of one, which parses once closed is beyond a simple check
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == 200


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _mixed_batch(n: int, with_grammar: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    # ids 0-93 are printable ASCII: a prompt of random bytes could end inside a UTF-8 character, which the
    # first output bytes would then complete (or turn into U+FFFD) in the text
    prompts = [[(7 * i + j) % 94 for j in range(5 + 9 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=120, temperature=0,
                             structured_output=grammar(PERSON) if with_grammar and i % 2 == 0 else None)
              for i in range(n)]
    return prompts, params


def test_requests_without_a_grammar_are_unchanged_by_batch_mates_with_one(json_model):
    """Half the batch under a grammar; the other half's greedy outputs equal those of the same batch run
    without any grammar."""
    prompts, with_grammar = _mixed_batch(8, with_grammar=True)
    _, without = _mixed_batch(8, with_grammar=False)
    mixed = run(make_engine(json_model, max_num_seqs=8), prompts, with_grammar)
    plain = run(make_engine(json_model, max_num_seqs=8), prompts, without)
    for i, (a, b) in enumerate(zip(mixed, plain, strict=True)):
        if i % 2:
            assert a.token_ids == b.token_ids
        else:
            jsonschema.validate(json.loads(a.text), PERSON)
            assert a.token_ids != b.token_ids  # the grammar did change these


def test_grammars_through_preemption_and_chunked_prefill(json_model):
    """Greedy grammar requests in a pool too small for all of them (preempted, recomputed) and in small
    prefill chunks give the tokens they give alone, and valid JSON."""
    prompts, params = _mixed_batch(8, with_grammar=True)
    alone = [run(make_engine(json_model), [p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    # 512 B a token: 14 blocks of 16 tokens for 8 requests of up to 68 + 120 tokens
    crowded = make_engine(json_model, kv_cache_memory=14 * 16 * 512, max_model_len=200, max_num_seqs=8,
                          prefill_chunk_size=7, max_num_batched_tokens=16)
    outputs = run(crowded, prompts, params)
    assert crowded.stats.num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    for i, out in enumerate(outputs):
        if i % 2 == 0:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), PERSON)
    assert crowded.core.grammar.num_live == 0


def test_an_aborted_request_frees_its_matcher(engine):
    keep = engine.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        max_tokens=100, temperature=0, structured_output=grammar(PERSON)))
    gone = engine.add_request(prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams(
        max_tokens=100, temperature=0, structured_output=grammar(PERSON)))
    while engine.core.grammar.num_live == 2 and len(engine.core.grammar._matchers) < 2:
        engine.step()  # until both compiled and sampled once
    engine.abort_request(gone)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[gone].finish_reason == "abort" and finished[keep].finish_reason == "stop"
    assert engine.core.grammar.num_live == 0


def test_a_request_still_compiling_can_be_aborted(engine):
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 37}}, "required": ["q"]}
    rid = engine.add_request(prompt_token_ids=[1, 2], sampling_params=SamplingParams(
        max_tokens=50, structured_output=grammar(schema)))
    engine.abort_request(rid)
    outs = [o for _ in range(3) for o in engine.step()]
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert not engine.has_unfinished_requests() and engine.core.grammar.num_live == 0


BAD_SCHEMAS = [
    ({"type": "nothing"}, "Unsupported type"),
    ({"type": "string", "pattern": "(unclosed"}, "parenthesis"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ({"$ref": "#/$defs/missing"}, "missing"),
]


@pytest.mark.parametrize("schema, words", BAD_SCHEMAS)
def test_a_bad_schema_names_the_field(engine, schema, words):
    """Offline, the engine's own check refuses it when the request is made, before anything is queued."""
    params = SamplingParams(structured_output=grammar(schema))  # only its shape is checked here
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(prompt_token_ids=[1, 2], sampling_params=params)
    assert e.value.param == "response_format.json_schema.schema" and words in e.value.message
    assert "/project/" not in e.value.message  # the native source location is stripped
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("schema, words", BAD_SCHEMAS[:2])
def test_the_core_checks_the_schemas_of_the_requests_it_is_handed(engine, schema, words):
    """The server's AddChecked: every schema is checked in the core's loop, and the requests are added all
    or none, with the reply sent before any step runs them."""
    client_end, core_end = QueueChannel.pair()
    loop = EngineCoreLoop(engine.core, core_end)
    good = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(max_tokens=20, structured_output=grammar(good))
    adds = [AddRequest(f"checked-{words}-{i}", [40, 41], params, 0, 0.0) for i in range(2)]
    loop._handle(AddChecked(7, [SchemaCheck("tools[0].function.parameters", json.dumps(good)),
                                SchemaCheck("tools[1].function.parameters", json.dumps(schema))], adds))
    (reply,) = client_end.receive(1)
    assert reply.call_id == 7 and reply.error_param == "tools[1].function.parameters"
    assert reply.error_message.startswith("this JSON schema is not supported: ") and words in reply.error_message
    assert not engine.has_unfinished_requests()  # neither request was added
    loop._handle(AddChecked(8, [SchemaCheck("response_format.json_schema.schema", json.dumps(good))], adds))
    assert client_end.receive(1) == [AddReply(8)]
    assert sorted(engine.core.unfinished_request_ids()) == [a.request_id for a in adds]
    finished = [o for _ in range(60) if engine.has_unfinished_requests() for o in engine.core.step()
                if o.finish_reason is not None]
    assert sorted((o.request_id, o.finish_reason) for o in finished) == [(a.request_id, "stop") for a in adds]


def test_structured_output_needs_a_tokenizer(tiny_llama):
    engine = make_engine(tiny_llama[0], load_format="dummy")
    assert engine.tokenizer is None  # the tiny model's directory has no tokenizer files
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(prompt_token_ids=[1, 2], sampling_params=SamplingParams(
            structured_output=StructuredOutput(json_object=True)))
    assert e.value.param == "response_format"


def test_a_request_id_used_again_keeps_its_grammar(engine):
    """A finished request's id may be taken again at once (LLMEngine refuses it only while in flight): the
    new request's grammar must not be freed as the old one's leaving is told to the next step."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for _ in range(3):
        outs = run_with_ids(engine, ["again-0", "again-1"], SamplingParams(
            max_tokens=20, temperature=1.0, structured_output=grammar(schema)))
        assert [(o.finish_reason, json.loads(o.text) in ({"ok": True}, {"ok": False})) for o in outs] == [
            ("stop", True)] * 2


def run_with_ids(engine, ids: list[str], params: SamplingParams) -> list:
    for request_id in ids:
        engine.add_request(prompt_token_ids=[40, 41], sampling_params=params, request_id=request_id)
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    return [final[i] for i in ids]


def test_the_grammar_end_stops_a_request_that_ignores_eos(engine):
    """ignore_eos keeps EOS from stopping a request, but a grammar at its end state allows nothing else:
    the request stops there (as vLLM's), with the document complete, rather than run on to max_tokens."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    (out,) = run(engine, [[40, 41, 42]], [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True,
                                                           structured_output=grammar(schema))])
    assert out.finish_reason == "stop" and len(out.token_ids) < 100
    assert json.loads(out.text) in ({"ok": True}, {"ok": False})


def test_a_batch_without_grammars_builds_no_mask(json_model):
    """Requests without a grammar pay nothing for the grammar engine: no step carries a mask, no fill runs."""
    engine = make_engine(json_model, max_num_seqs=4)
    seen = []
    execute = engine.core.model_runner.execute_model
    engine.core.model_runner.execute_model = lambda out: (seen.append(out.grammar_bitmask), execute(out))[1]
    run(engine, [[7, 8, 9]] * 4, [SamplingParams(max_tokens=8, temperature=0)] * 4)
    assert seen and all(b is None for b in seen)
    assert engine.core.grammar._batch is None and engine.core.grammar._last_fill is None


def test_masks_fill_while_the_model_runs(json_model):
    """The core hands the runner masks still being filled, on the mask thread; the forward pass does not
    wait for them. The fill here waits until the runner was entered: were the fill done before the forward
    pass (serially), it would time out, and the outputs would differ from the plain sequential run."""
    prompts, params = _mixed_batch(4, with_grammar=True)
    expected = run(make_engine(json_model, max_num_seqs=4), prompts, params)
    engine = make_engine(json_model, max_num_seqs=4)
    grammar, runner = engine.core.grammar, engine.core.model_runner
    entered, fills = threading.Event(), []
    fill, execute = grammar._fill, runner.execute_model

    def gated_fill(ids, matchers):
        fills.append((entered.wait(timeout=30), threading.current_thread().name))
        return fill(ids, matchers)

    def entering_execute(out):
        entered.set()
        result = execute(out)
        entered.clear()
        return result

    grammar._fill, runner.execute_model = gated_fill, entering_execute
    outputs = run(engine, prompts, params)
    assert fills and all(ok and name.startswith("iterserve-grammar-mask") for ok, name in fills)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
