"""Per-request sampling and stopping parameters, validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.server.engine.structured_output import StructuredOutput
from iterserve.server.errors import InvalidRequestError

GREEDY_BELOW = 1e-5
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 disables
    seed: int | None = None  # a seeded request samples the same tokens whatever else is batched with it
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token
    top_logprobs: int = 0  # also return this many most likely tokens per position (0..20); implies logprobs
    skip_special_tokens: bool = True
    # logits processing before the choice (greedy included), as vLLM's: penalties over the request's
    # tokens, a per-token bias, no stop before min_tokens; min_p filters the random draw
    frequency_penalty: float = 0.0  # minus this x the token's count among the outputs so far
    presence_penalty: float = 0.0  # minus this when the token is among the outputs so far
    repetition_penalty: float = 1.0  # prompt and output tokens: logit / this when > 0, x this when < 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens were generated
    min_p: float = 0.0  # drop tokens less probable than min_p x the most probable one
    # the output must match this grammar (a JSON schema, or any JSON object): tokens it does not allow are
    # masked before the choice, and the request stops when the grammar ends
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        self.logprobs = bool(self.logprobs or self.top_logprobs)

    @property
    def greedy(self) -> bool:
        # vLLM's threshold; dividing logits by a smaller temperature overflows to inf/NaN
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_int("top_logprobs", self.top_logprobs, minimum=0)
        if self.top_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be <= {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=-(2**63))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError("stop", f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, minimum=0)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token, minimum=0)
            _check_number("logit_bias", bias)
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError("logit_bias", f"biases must be in [-100, 100], got {bias} for {token}")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the choice (the sampler then needs the request's tokens)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidRequestError(name, f"must be >= {minimum}, got {value}")


def _check_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise InvalidRequestError(name, f"must be a number, got {value!r}")
