"""The requests `api_conformance.py` sends to iterserve and to vLLM: the OpenAI API's surface that apps and
agents use, valid and invalid, streamed and not. Every body names the model `MODEL`; sampling is greedy
(temperature 0) wherever text is compared, so both servers, on one model in fp32, can agree on it."""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL = "smol"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict | None = None  # None: a GET
    raw: bytes | None = None  # a body sent as these bytes instead of JSON (malformed input)
    compare_text: bool = True  # greedy output text compared too (not for sampled or forced outputs)
    headers: dict = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))


def _chat(name: str, stream: bool = False, messages=HELLO, compare_text: bool = True, **fields) -> Case:
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, **fields}
    if stream:
        body["stream"] = True
    return Case(name, "/v1/chat/completions", body, compare_text=compare_text)


def _completion(name: str, stream: bool = False, prompt="The capital of France is", compare_text: bool = True,
                **fields) -> Case:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    if stream:
        body["stream"] = True
    return Case(name, "/v1/completions", body, compare_text=compare_text)


TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 18, \"sky\": \"clear\"}"},
]

CASES: list[Case] = [
    # -- endpoints without a model run ---------------------------------------------------------
    Case("models", "/v1/models"),
    Case("version", "/version"),
    Case("tokenize prompt", "/tokenize", {"model": MODEL, "prompt": "Hello world"}),
    Case("tokenize prompt, token strings", "/tokenize",
         {"model": MODEL, "prompt": "Hello world", "return_token_strs": True}),
    Case("tokenize messages", "/tokenize", {"model": MODEL, "messages": HELLO, "add_generation_prompt": True}),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": [19556, 905]}),
    # -- completions ------------------------------------------------------------------------------
    _completion("completion"),
    _completion("completion, prompt list", prompt=["One, two,", "Red, green,"]),
    _completion("completion, token ids", prompt=[504, 3575, 282, 4649, 314]),
    _completion("completion, n=2 sampled", n=2, temperature=0.8, seed=7, compare_text=False),
    _completion("completion, logprobs=2", logprobs=2),
    _completion("completion, stop string", stop=[","], prompt="One, two, three"),
    _completion("completion, penalties", frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.2),
    _completion("completion, logit_bias", logit_bias={"28": -100}),
    _completion("completion, min_tokens + ignore_eos", min_tokens=4, ignore_eos=True),
    _completion("completion, stream", stream=True),
    _completion("completion, stream + usage", stream=True, stream_options={"include_usage": True}),
    _completion("completion, stream + logprobs", stream=True, logprobs=1),
    # -- chat ----------------------------------------------------------------------------------------
    _chat("chat"),
    _chat("chat, system + user", messages=[{"role": "system", "content": "You are terse."}, *HELLO]),
    _chat("chat, content parts", messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]),
    _chat("chat, max_completion_tokens", max_tokens=None, max_completion_tokens=6),
    _chat("chat, logprobs + top_logprobs=3", logprobs=True, top_logprobs=3),
    _chat("chat, n=2 sampled", n=2, temperature=0.9, seed=3, compare_text=False),
    _chat("chat, stop_token_ids", stop_token_ids=[30]),
    _chat("chat, min_p + top_k + top_p", min_p=0.1, top_k=20, top_p=0.9),
    _chat("chat, stream", stream=True),
    _chat("chat, stream + usage", stream=True, stream_options={"include_usage": True}),
    _chat("chat, stream + logprobs", stream=True, logprobs=True, top_logprobs=2),
    # -- structured output --------------------------------------------------------------------------
    _chat("chat, json_object", compare_text=False, max_tokens=40,
          messages=[{"role": "user", "content": "Give a JSON object about a cat."}],
          response_format={"type": "json_object"}),
    _chat("chat, json_schema", compare_text=False, max_tokens=40,
          messages=[{"role": "user", "content": "Describe a person as JSON."}],
          response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                                  "strict": True}}),
    _completion("completion, json_schema", compare_text=False, max_tokens=40, prompt="A person as JSON:",
                response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                        "schema": PERSON_SCHEMA}}),
    # -- tools ----------------------------------------------------------------------------------------
    _chat("tools, required", compare_text=False, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL],
          tool_choice="required", messages=[{"role": "user", "content": "Weather in Paris?"}]),
    _chat("tools, named", compare_text=False, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL],
          tool_choice={"type": "function", "function": {"name": "get_weather"}},
          messages=[{"role": "user", "content": "Weather in Paris?"}]),
    _chat("tools, auto (text)", max_tokens=12, tools=[WEATHER_TOOL], tool_choice="auto"),
    _chat("tools, none", max_tokens=12, tools=[WEATHER_TOOL], tool_choice="none"),
    _chat("tools, tool message round trip", max_tokens=16, tools=[WEATHER_TOOL], messages=TOOL_TURNS),
    _chat("tools, required, stream", stream=True, compare_text=False, max_tokens=60, tools=[WEATHER_TOOL],
          tool_choice="required", messages=[{"role": "user", "content": "Weather in Paris?"}]),
    # -- refusals -------------------------------------------------------------------------------------
    _chat("error: unknown model", model="no-such-model"),
    _chat("error: temperature 3", temperature=3),
    _chat("error: max_tokens past the context", max_tokens=100_000),
    _chat("error: top_logprobs without logprobs", top_logprobs=2),
    _chat("error: top_logprobs 21", logprobs=True, top_logprobs=21),
    _chat("error: n=0", n=0),
    _chat("error: unknown field", frobnicate=1),
    _chat("error: bad role", messages=[{"role": "wizard", "content": "hi"}]),
    _chat("error: tool message without tool_call_id", messages=[*HELLO, {"role": "tool", "content": "x"}]),
    _chat("error: tool_choice names an unknown tool", tools=[WEATHER_TOOL],
          tool_choice={"type": "function", "function": {"name": "nope"}}),
    _chat("error: bad json_schema", response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
    _completion("error: empty prompt", prompt=""),
    _completion("error: logit_bias token out of range", logit_bias={"999999": 5}),
    Case("error: messages missing", "/v1/chat/completions", {"model": MODEL}),
    Case("error: malformed JSON", "/v1/chat/completions", raw=b"{\"model\": \"smol\", \"messages\": [",
         headers={"content-type": "application/json"}),
    Case("error: unknown path", "/v1/nothing-here"),
]
