"""Request bodies of the OpenAI-compatible API, as pydantic models.

Scalars are strict (`"5"` is not an integer, `true` is not a number) and unknown fields are refused:
a silently ignored parameter is a wrong answer the client cannot see. Fields that OpenAI clients send
by default but this server does not implement (penalties, echo) are accepted only at their neutral
value. Range checks that depend on the model (max_tokens against max_model_len) live in `serving`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, field_validator


def _number(value):
    # JSON has one number type: an integer is a valid float; a string or a bool is not
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if isinstance(value, int) and abs(value) > 2**53:
        raise ValueError("number out of range")
    return value


Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
Float = Annotated[float, BeforeValidator(_number), Field(allow_inf_nan=False)]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_N = 128
MAX_STOP_STRINGS = 16


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Model):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: usage on every chunk


class _Common(_Model):
    model: Str | None = None  # None: the one served model
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0, le=2)
    top_p: Float | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=-1)
    seed: Int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Str | list[Str] | None = None
    stop_token_ids: list[Annotated[int, Strict(), Field(ge=0)]] | None = None
    ignore_eos: Bool = False
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    user: Str | None = None
    # accepted so default client payloads work; anything but the neutral value is refused
    frequency_penalty: Float | None = Field(default=None, ge=0, le=0)
    presence_penalty: Float | None = Field(default=None, ge=0, le=0)

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


class CompletionRequest(_Common):
    prompt: Union[Str, TokenIds, list[Str], list[TokenIds]]
    logprobs: Int | None = Field(default=None, ge=0, le=20)
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


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    name: Str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)


class KnobsPatch(_Model):
    """PATCH /admin/scheduler: any subset of the live knobs."""

    max_num_seqs: Int | None = None
    max_num_batched_tokens: Int | None = None
    prefill_chunk_size: Int | None = None
