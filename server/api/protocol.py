"""Request bodies of the OpenAI-compatible API, as pydantic models.

Scalars are strict (`"5"` is not an integer, `true` is not a number) and unknown fields are refused:
a silently ignored parameter is a wrong answer the client cannot see. A field that OpenAI clients send
by default but this server does not implement (echo) is accepted only at its neutral value. Text must be valid Unicode
(a lone surrogate or an undecodable byte is refused, naming the field).
Counts that would cost the server work out of proportion to a request (prompts, messages, stop token ids)
are capped here; range checks that depend on the model or the deployment (max_tokens against
max_model_len, total prompt tokens) live in `serving`.

Bodies are parsed by `parse_body`, off the event loop, rather than by FastAPI on it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)


def _number(value):
    # JSON has one number type: an integer is a valid float; a string or a bool is not
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if isinstance(value, int) and abs(value) > 2**53:
        raise ValueError("number out of range")
    return value


def _unicode(value: str) -> str:
    # JSON can carry a lone surrogate (\ud800), and `parse_body` maps undecodable bytes to lone
    # surrogates; neither can be tokenized or written back out as UTF-8
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"invalid Unicode at character {e.start} (a lone surrogate or a byte that is "
                             "not UTF-8); send UTF-8 text") from None
    return value


Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict(), AfterValidator(_unicode)]
Float = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_CHOICES = 1024  # prompts x n of one request: more is a batch job, not one request
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256  # text parts of one message
MAX_LOGPROBS = 20  # OpenAI's limit on logprobs / top_logprobs
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_TOOLS = 128  # OpenAI's limit on tools per request (also on tool calls per message here)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(_Model):
    """OpenAI's `response_format.json_schema`. The schema is always enforced (`strict` or not), as vLLM does."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Str = Field(max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Str | None = None
    schema_: dict | Bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Model):
    """`{"type": "text"}` (the default), `{"type": "json_object"}` or `{"type": "json_schema", "json_schema": ...}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`json_schema` is required when type is json_schema")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"`json_schema` is given only with type json_schema, not {self.type}")
        return self


class _Common(_Model):
    model: Str | None = None  # None: the one served model
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=-1)
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = Field(default=None,
                                                                               max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: Bool = False
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    user: Str | None = None
    frequency_penalty: Float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: Float | None = Field(default=None, ge=-2, le=2)
    logit_bias: Annotated[dict[Str, Float], Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id -> bias
    # vLLM's extra sampling parameters
    repetition_penalty: Float | None = Field(default=None, gt=0)
    min_tokens: Int = Field(default=0, ge=0)
    min_p: Float | None = Field(default=None, ge=0, le=1)
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v


TokenIds = list[Annotated[int, Strict(), Field(ge=0)]]


def _prompt_count(value):
    # checked before the union is tried, so that too many prompts is said as such, not as a type error
    if isinstance(value, list) and len(value) > MAX_CHOICES and isinstance(value[0], (str, list)):
        raise ValueError(f"{len(value)} prompts; at most {MAX_CHOICES} per request")
    return value


class CompletionRequest(_Common):
    prompt: Annotated[Str | TokenIds | list[Str] | list[TokenIds], BeforeValidator(_prompt_count)]
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: Bool = Field(default=False, description="only false is supported")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        if v:
            raise ValueError("echo is not supported")
        return v


class TextPart(_Model):
    type: Literal["text"]
    text: Str


FunctionName = Annotated[str, Strict(), Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for names


class FunctionDefinition(_Model):
    name: FunctionName
    description: Str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments (OpenAI's default)
    strict: Bool | None = None  # arguments are always enforced when a call is forced (`tool_calls.py`)


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Model):
    name: Str
    arguments: Str  # JSON text, as OpenAI's clients send it back


class ToolCall(_Model):
    id: Str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # assistant messages
    tool_call_id: Str | None = None  # tool messages: the call they answer

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"`tool_calls` is given only in assistant messages, not in a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"`tool_call_id` is given only in tool messages, not in a {self.role} message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True


class TokenizeCompletionRequest(_Model):
    """POST /tokenize with a prompt, as vLLM's."""

    model: Str | None = None
    prompt: Str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(_Model):
    """POST /tokenize with messages, rendered through the model's chat template, as vLLM's."""

    model: Str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False  # the template writes the special tokens it wants
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # rendered as for a chat request
    return_token_strs: Bool = False


class DetokenizeRequest(_Model):
    model: Str | None = None
    tokens: TokenIds


class KnobsPatch(_Model):
    """PATCH /admin/scheduler: any subset of the live knobs."""

    max_num_seqs: Int | None = None
    max_num_batched_tokens: Int | None = None
    prefill_chunk_size: Int | None = None


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], body: bytes, content_type: str | None) -> Body:
    """A request body -> `model`, or RequestValidationError in FastAPI's own shape (so the same handler
    answers it). Bytes that are not UTF-8 become lone surrogates, which the text fields refuse by name."""
    if content_type and not _is_json(content_type):
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                       "msg": "Input should be a valid dictionary or object"}])
    try:
        data = json.loads(body.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an integer of 4300+ digits, deep nesting
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e) or type(e).__name__
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "ctx": {"error": reason + where}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors: list[dict[str, Any]] = [{**err, "loc": ("body", *err["loc"])}
                  for err in e.errors(include_url=False, include_input=False, include_context=False)]
        # a union (prompt, stop, content) reports every branch it tried: what is wrong with the value
        # (invalid Unicode, too many items) says more than "should be a list" from a branch that never fit
        errors.sort(key=lambda err: err["type"].endswith("_type"))
        raise RequestValidationError(errors) from None


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def openapi_body(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra` declaring `model` as its JSON body: the routes read the body themselves
    (`parse_body`), so FastAPI cannot derive it. The schema is inlined, as `$defs` would not resolve there."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref[len("#/$defs/"):]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
