"""Turn an OpenAI completion or chat request into engine requests, and run them.

One HTTP request becomes len(prompts) x n engine requests ("choices"), choice index
`prompt_index * n + i` as in OpenAI's API. Every choice is validated before any is queued, so a
refused request leaves nothing behind in the engine; its JSON schemas (`response_format`, forced tool
calls) are checked by the engine core, whose process alone has the grammar engine, as it takes all the
choices or none (`EngineClient.open_streams`): a bad one is still a 400, sent before any response byte.
Parsing, chat templating, tokenization and validation (`prepare`) run in a thread pool, never on the
event loop: a large request must not hold up /health or anyone else's stream. Admission counts sequences
(choices), so `max_queue` bounds the engine's waiting queue whatever the shape of the requests. Outputs
of all choices are merged into one stream (`output_stream`); whoever stops reading it (a client that went
away) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from iterserve.server.api.errors import APIError, from_invalid_request
from iterserve.server.api.limits import ServerLimits
from iterserve.server.api.output_stream import merged_outputs
from iterserve.server.api.protocol import MAX_CHOICES, SEED_MAX, ChatCompletionRequest, CompletionRequest, parse_body
from iterserve.server.api.tool_calls import ToolPlan, plan_tools, template_messages, template_tools
from iterserve.server.engine.core_client import EngineClient
from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.structured_output import SCHEMA_PARAM, StructuredOutput
from iterserve.server.errors import InvalidRequestError

if TYPE_CHECKING:  # prometheus_client only where metrics are on
    from iterserve.server.api.metrics import Metrics


def _prep_pool() -> ThreadPoolExecutor:
    # tokenization releases the GIL, so large prompts are taken in on several cores at once
    return ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="iterserve-prep")


@dataclass
class ServerState:
    """Everything the routes share: the engine, the served name and the admission settings."""

    engine: EngineClient
    model_name: str
    max_queue: int | None = None  # refuse with 429 what would make more sequences than this wait
    api_key: str | None = None
    admin_token: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    scheduling_policy: str = "fcfs"  # "priority" honours the requests' `priority`
    tool_call_parser: str = "auto"  # auto: chosen from the chat template (tool_parsers.detect_parser)
    draining: bool = False
    drain_started: float | None = None
    metrics: Metrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    prep_pool: ThreadPoolExecutor = field(default_factory=_prep_pool)

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()


@dataclass
class Choice:
    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class Job:
    """A validated request, ready to queue."""

    id: str
    choices: list[Choice]
    prompt_lengths: list[int]  # per prompt (usage counts each prompt once, whatever n)
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None  # chat with tools: how the output becomes tool calls (tool_stream)
    # (param, JSON schema) for the engine core to check before it queues the choices
    schema_checks: list[tuple[str, str]] = field(default_factory=list)


def check_admission(state: ServerState, job: Job) -> None:
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", code="draining",
                       headers={"Retry-After": "1", "Connection": "close"})
    if state.max_queue is None:
        return
    waiting = state.engine.snapshot()["num_waiting"]
    if waiting + len(job.choices) > state.max_queue:
        raise APIError(429, f"the waiting queue is full ({waiting} of {state.max_queue} sequences wait; this "
                       f"request adds {len(job.choices)}); retry later", code="queue_full",
                       headers={"Retry-After": "1"})


async def prepare_in_pool(state: ServerState, body: bytes, content_type: str | None, chat: bool) -> Job:
    """`prepare` in the thread pool: the event loop goes on serving while a request is taken in."""
    return await asyncio.get_running_loop().run_in_executor(state.prep_pool, prepare, state, body,
                                                            content_type, chat)


def prepare(state: ServerState, body: bytes, content_type: str | None, chat: bool) -> Job:
    """A request body -> a validated Job (raises the APIError or RequestValidationError to answer)."""
    if chat:
        return prepare_chat(state, parse_body(ChatCompletionRequest, body, content_type))
    return prepare_completion(state, parse_body(CompletionRequest, body, content_type))


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def prepare_completion(state: ServerState, req: CompletionRequest) -> Job:
    check_model(state, req.model)
    _check_request_shape(state, req, "prompt", num_prompts=1 if _single_prompt(req.prompt) else len(req.prompt))
    prompts = _completion_prompts(state, req.prompt)
    return _make_job(state, req, "cmpl", "prompt", prompts, req.max_tokens, default_max_tokens=16,
                     top_logprobs=req.logprobs)


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Job:
    check_model(state, req.model)
    _check_request_shape(state, req, "messages", num_prompts=1)
    if req.top_logprobs and not req.logprobs:
        # as vLLM: alternatives to tokens whose logprobs were not asked for would be silently dropped
        raise APIError(400, "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true",
                       param="top_logprobs", code="invalid_value")
    tokenizer = state.engine.tokenizer
    text = render_chat(state, req.messages, add_generation_prompt=True, tools=req.tools)
    assert tokenizer is not None  # render_chat refused a model without one
    tools = plan_tools(req, tokenizer.chat_template, state.tool_call_parser)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # the template already writes any BOS it wants: adding special tokens again would double it
    ids = tokenizer.encode(text, add_special_tokens=False)
    return _make_job(state, req, "chatcmpl", "messages", [ids], max_tokens,
                     default_max_tokens=None,
                     top_logprobs=(req.top_logprobs or 0) if req.logprobs else None, tools=tools)


def render_chat(state: ServerState, messages, add_generation_prompt: bool, tools=None) -> str:
    """`messages` (and `tools`) through the model's chat template (400 naming `messages` when it cannot be)."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer and so no chat template; use /v1/completions "
                       "with token ids", param="messages")
    dicts = template_messages(messages)
    extra = {"tools": template_tools(tools)} if tools else {}  # HF's convention: absent without tools
    try:
        return tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, **extra)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _single_prompt(prompt) -> bool:
    return isinstance(prompt, str) or bool(prompt and isinstance(prompt[0], int))


def _check_request_shape(state: ServerState, req, prompt_param: str, num_prompts: int) -> None:
    """What can be refused before any tokenizing: priority without priority scheduling, too many
    choices, and more sequences than the whole queue may hold (such a request could never be admitted)."""
    if req.priority != 0 and state.scheduling_policy != "priority":
        raise APIError(400, "priority: this server schedules first come, first served and does not honour "
                       "priority; start it with --scheduling-policy priority", param="priority", code="invalid_value")
    choices = num_prompts * req.n
    param = "n" if req.n > 1 else prompt_param
    shape = f"{num_prompts} prompt{'s' if num_prompts > 1 else ''} x n={req.n} is {choices} sequences"
    if choices > MAX_CHOICES:
        raise APIError(400, f"{param}: {shape}; at most {MAX_CHOICES} per request", param=param,
                       code="invalid_value")
    if state.max_queue is not None and choices > state.max_queue:
        raise APIError(400, f"{param}: {shape}, more than the server ever queues (--max-queue {state.max_queue}); "
                       "send fewer prompts or a smaller n per request", param=param, code="invalid_value")


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if _single_prompt(prompt):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    tokenizer = state.engine.tokenizer
    ids = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
            p = tokenizer.encode(p)
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        ids.append(list(p))
    return ids


def _make_job(state: ServerState, req, prefix: str, prompt_param: str, prompts: list[list[int]],
              max_tokens: int | None, *, default_max_tokens: int | None, top_logprobs: int | None,
              tools: ToolPlan | None = None) -> Job:
    """top_logprobs: None for no logprobs, else how many alternatives to list per token (0: none)."""
    engine = state.engine
    max_len = engine.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= max_len:
        raise APIError(400, f"{prompt_param}: the prompt has {longest} tokens; the context length "
                       f"(max_model_len) is {max_len}, which leaves no room to generate",
                       param=prompt_param, code="context_length_exceeded")
    total, limit = sum(len(p) for p in prompts) * req.n, state.limits.prompt_token_limit(max_len)
    if total > limit:
        raise APIError(400, f"{prompt_param}: the prompts come to {total} tokens to compute (each counted once per "
                       f"choice); at most {limit} per request (--max-prompt-tokens-per-request)",
                       param=prompt_param, code="invalid_value")
    job_id = f"{prefix}-{uuid.uuid4().hex}"
    logit_bias = _logit_bias(req, engine.vocab_size)
    structured: StructuredOutput | None
    if tools is not None and tools.structured:
        structured, schema_checks = tools.structured, tools.schema_checks
    else:
        structured = _structured_output(state, req)
        schema = structured.json_schema if structured is not None else None
        schema_checks = [] if schema is None else [(SCHEMA_PARAM, schema)]
    choices = []
    for p_index, ids in enumerate(prompts):
        wanted = max_tokens if max_tokens is not None else (default_max_tokens or max_len - len(ids))
        if max_tokens is None:
            wanted = min(wanted, max_len - len(ids))
        if len(ids) + wanted > max_len:
            raise APIError(400, f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens ({wanted}) is "
                           f"{len(ids) + wanted} tokens, over the context length (max_model_len) {max_len}",
                           param="max_tokens", code="context_length_exceeded")
        for i in range(req.n):
            params = _sampling_params(req, wanted, i, top_logprobs, logit_bias, structured)
            choice = Choice(p_index * req.n + i, f"{job_id}-{p_index * req.n + i}", p_index, ids, params)
            if i == 0:  # token ids, stops and priority are the same for every choice of a prompt
                try:  # validates; queues nothing
                    engine.make_request(None, params, prompt_token_ids=ids, request_id=choice.request_id,
                                        priority=req.priority)
                except InvalidRequestError as e:
                    raise from_invalid_request(e) from None
            choices.append(choice)
    opts = req.stream_options
    return Job(job_id, choices, [len(p) for p in prompts], req.priority, req.stream,
               include_usage=bool(opts and opts.include_usage),
               continuous_usage=bool(opts and opts.continuous_usage_stats), tools=tools, schema_checks=schema_checks)


def _sampling_params(req, max_tokens: int, i: int, top_logprobs: int | None,
                     logit_bias: dict[int, float], structured: StructuredOutput | None) -> SamplingParams:
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    seed = req.seed
    if seed is not None and i:
        # each of n choices draws differently, yet reproducibly (vLLM does the same)
        seed = seed + i if seed + i <= SEED_MAX else seed - i
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=-1 if not req.top_k else req.top_k,
            seed=seed,
            stop=req.stop or [],
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=top_logprobs is not None,
            top_logprobs=top_logprobs or 0,
            frequency_penalty=float(req.frequency_penalty or 0.0),
            presence_penalty=float(req.presence_penalty or 0.0),
            repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
            logit_bias=logit_bias,
            min_tokens=req.min_tokens,
            min_p=float(req.min_p or 0.0),
            structured_output=structured,
        )
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None


def _structured_output(state: ServerState, req) -> StructuredOutput | None:
    """`response_format` -> what the engine enforces (its schema is checked in the core, as it is queued)."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if state.engine.tokenizer is None:
        raise APIError(400, "response_format: structured output needs the model's tokenizer; this model has none",
                       param="response_format", code="invalid_value")
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    schema = fmt.json_schema.schema_
    if schema is None:
        schema = {}  # OpenAI's default: any JSON value
    return StructuredOutput(json_schema=json.dumps(schema))


def _logit_bias(req, vocab_size: int) -> dict[int, float]:
    """OpenAI's `logit_bias` ({"token id": bias}) with ids checked against the model's vocabulary."""
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias: {key!r} is not a token id of this model (0..{vocab_size - 1})",
                           param="logit_bias", code="invalid_value")
        bias[int(key)] = float(value)
    return bias


async def start(state: ServerState, job: Job) -> list[asyncio.Queue]:
    """Queue every choice, or none: a choice refused, or a schema the engine core cannot take, is a 400."""
    check_admission(state, job)
    try:
        queues = await state.engine.open_streams(
            [(c.request_id, c.prompt_token_ids, c.params) for c in job.choices], priority=job.priority,
            schema_checks=job.schema_checks)
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None
    if state.metrics is not None:
        state.metrics.observe_request(job)
    return queues


def job_outputs(state: ServerState, job: Job, queues: list[asyncio.Queue]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) for every choice of a started job, in the order they arrive; closing it
    aborts every choice not yet finished (`output_stream.merged_outputs`)."""
    on_stall = None
    metrics = state.metrics
    if metrics is not None:
        def on_stall() -> None:
            metrics.observe_cutoff("reader_behind")
    return merged_outputs(state.engine, job.choices, queues, state.limits.max_buffered_tokens, on_stall)


async def collect(state: ServerState, job: Job, queues: list[asyncio.Queue]) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, out in job_outputs(state, job, queues):
        if out.finished:
            final[index] = out
    return final
