"""What the server and the operator must agree on, spelled once: the live knobs (names in both
spellings, defaults, limit), the ports, the env vars the pods read, the admin path and the metric names
the tuner reads. Standard library only, so each side imports it without the other's dependencies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

HTTP_PORT = 8000  # OpenAI API, /metrics, /health, /ready
ADMIN_PORT = 8001  # /admin/* alone on the operator's pods (`iterserve serve --admin-port`)
ADMIN_SCHEDULER_PATH = "/admin/scheduler"  # GET the live knobs, PATCH some of them

# secrets the server reads from its environment when the flag is not given
API_KEY_ENV = "ITERSERVE_API_KEY"
ADMIN_TOKEN_ENV = "ITERSERVE_ADMIN_TOKEN"

KNOB_LIMIT = 2**20  # every knob's upper bound: far above any useful value, it keeps a typo out of the scheduler


@dataclass(frozen=True)
class Knob:
    """One live scheduler knob: the server's snake_case name (flag, PATCH field, env var stem), the
    LLMService's camelCase one, and its default."""

    name: str
    camel: str
    default: int
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The env var the operator's pods expand into the knob's flag (`$(VAR)`), from the knobs' ConfigMap."""
        return "ITERSERVE_" + self.name.upper()


KNOBS = (
    Knob("max_num_seqs", "maxNumSeqs", 64, "most requests in the running batch"),
    # vLLM's CPU server starts at a 2,048-token step too: a prompt in one step (not 4-8 chunks, each paying a
    # whole decode step's weight reads again) gives lower TTFT p50/p99 at the same TPOT and tok/s on the
    # served mixed load (docs/benchmarks.md); the tuner lowers the chunk where ITL needs it
    Knob("max_num_batched_tokens", "maxNumBatchedTokens", 2048, "token budget of one step (decodes count 1 each)"),
    Knob("prefill_chunk_size", "prefillChunkSize", 2048,
         "most prompt tokens computed in one step, all requests together"),
)
KNOB_NAMES = tuple(k.name for k in KNOBS)
KNOB_DEFAULTS = {k.name: k.default for k in KNOBS}
KNOB_CAMEL = {k.name: k.camel for k in KNOBS}


class KnobError(ValueError):
    """A knob value out of range, or a name that is no knob. `param` names it: the server answers with it
    as OpenAI's `param` (InvalidRequestError), the operator reports it in a condition."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True, order=True)
class Knobs:
    """A value of the three live knobs, validated: what the scheduler reads each step, what a PATCH of
    /admin/scheduler sets, and what the operator's tuner decides. Frozen, so a change replaces it whole."""

    max_num_seqs: int = KNOB_DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = KNOB_DEFAULTS["max_num_batched_tokens"]
    prefill_chunk_size: int = KNOB_DEFAULTS["prefill_chunk_size"]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KnobError(f.name, f"must be an integer >= 1, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        """snake_case, as the server's flags and PATCH /admin/scheduler take them."""
        return dataclasses.asdict(self)

    def as_camel(self) -> dict[str, int]:
        """camelCase, as the LLMService spec and status spell them."""
        return {KNOB_CAMEL[k]: v for k, v in self.as_dict().items()}

    def replace(self, **changes: int) -> Knobs:
        """These knobs with `changes` (snake_case), validated; KnobError names an unknown one."""
        unknown = set(changes) - set(KNOB_NAMES)
        if unknown:
            raise KnobError(sorted(unknown)[0], "unknown scheduler knob")
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (f"max_num_seqs={self.max_num_seqs}, prefill_chunk_size={self.prefill_chunk_size}, "
                f"max_num_batched_tokens={self.max_num_batched_tokens}")

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> Knobs:
        """From snake_case or camelCase keys (unknown keys are an error, missing ones take the defaults)."""
        snake = {v: k for k, v in KNOB_CAMEL.items()}
        out = {}
        for key, value in values.items():
            name = key if key in KNOB_CAMEL else snake.get(key)
            if name is None:
                raise KnobError(key, f"not a scheduler knob (expected one of {', '.join(KNOB_CAMEL)})")
            out[name] = value
        return cls(**out)

# The metrics the tuner reads from each pod's /metrics (or Prometheus), as the server exports them
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
INFERENCE_TIME = "vllm:request_inference_time_seconds"  # a request's time in the batch
REQUESTS = "vllm:request_success_total"  # every finished request, summed over finished_reason
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
STEP_FAILURES = "iterserve:engine_step_failures_total"  # each failed step answered its requests with a 500
HTTP_RESPONSES = "iterserve:http_responses_total"  # by route and code; the tuner reads only the 5xx series
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
PROMPT_TOKENS_PENDING = "iterserve:num_prompt_tokens_pending"  # the router's least-load reads it
