"""Turn an OpenAI completion or chat request into engine requests, and run them.

One HTTP request becomes len(prompts) x n engine requests ("choices"), choice index
`prompt_index * n + i` as in OpenAI's API. Every choice is validated before any is queued, so a
refused request leaves nothing behind in the engine. Outputs of all choices are merged into one
stream; whoever stops reading it (a client that went away) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from iterserve.server.api.errors import APIError, from_invalid_request
from iterserve.server.api.protocol import SEED_MAX, ChatCompletionRequest, CompletionRequest
from iterserve.server.engine.core_client import EngineClient
from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.sampling_params import InvalidRequestError, SamplingParams

MAX_CHOICES = 1024  # prompts x n of one HTTP request: more is a batch job, not one request


@dataclass
class ServerState:
    """Everything the routes share: the engine, the served name and the admission settings."""

    engine: EngineClient
    model_name: str
    max_queue: int | None = None  # refuse with 429 when this many requests wait
    api_key: str | None = None
    admin_token: str | None = None
    draining: bool = False
    drain_started: float | None = None
    metrics: object | None = None  # api.metrics.Metrics
    created: int = field(default_factory=lambda: int(time.time()))

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


def check_admission(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is shutting down; retry on another replica", code="draining",
                       headers={"Retry-After": "1"})
    if state.max_queue is not None and state.engine.snapshot()["num_waiting"] >= state.max_queue:
        raise APIError(429, f"the waiting queue is full ({state.max_queue} requests); retry later",
                       code="queue_full", headers={"Retry-After": "1"})


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


def prepare_completion(state: ServerState, req: CompletionRequest) -> Job:
    check_model(state, req.model)
    prompts = _completion_prompts(state, req.prompt)
    return _make_job(state, req, "cmpl", "prompt", prompts, req.max_tokens, default_max_tokens=16,
                     top_logprobs=req.logprobs)


def prepare_chat(state: ServerState, req: ChatCompletionRequest) -> Job:
    check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer and so no chat template; use /v1/completions "
                       "with token ids", param="messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    # the template already writes any BOS it wants: adding special tokens again would double it
    ids = tokenizer.encode(text, add_special_tokens=False)
    return _make_job(state, req, "chatcmpl", "messages", [ids], max_tokens,
                     default_max_tokens=None,
                     top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
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
              max_tokens: int | None, *, default_max_tokens: int | None, top_logprobs: int | None) -> Job:
    """top_logprobs: None for no logprobs, else how many alternatives to list per token (0: none)."""
    engine = state.engine
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{prompt_param}: {len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} "
                       f"completions; at most {MAX_CHOICES} per request", param=prompt_param)
    max_len = engine.max_model_len
    job_id = f"{prefix}-{uuid.uuid4().hex}"
    choices = []
    for p_index, ids in enumerate(prompts):
        if len(ids) >= max_len:
            raise APIError(400, f"{prompt_param}: the prompt has {len(ids)} tokens; the context length "
                           f"(max_model_len) is {max_len}, which leaves no room to generate",
                           param=prompt_param, code="context_length_exceeded")
        wanted = max_tokens if max_tokens is not None else (default_max_tokens or max_len - len(ids))
        if max_tokens is None:
            wanted = min(wanted, max_len - len(ids))
        if len(ids) + wanted > max_len:
            raise APIError(400, f"max_tokens: the prompt ({len(ids)} tokens) plus max_tokens ({wanted}) is "
                           f"{len(ids) + wanted} tokens, over the context length (max_model_len) {max_len}",
                           param="max_tokens", code="context_length_exceeded")
        for i in range(req.n):
            params = _sampling_params(req, wanted, i, top_logprobs)
            choice = Choice(p_index * req.n + i, f"{job_id}-{p_index * req.n + i}", p_index, ids, params)
            try:  # validates token ids, stops, priority; queues nothing
                engine.make_request(None, params, prompt_token_ids=ids, request_id=choice.request_id,
                                    priority=req.priority)
            except InvalidRequestError as e:
                raise from_invalid_request(e) from None
            choices.append(choice)
    opts = req.stream_options
    return Job(job_id, choices, [len(p) for p in prompts], req.priority, req.stream,
               include_usage=bool(opts and opts.include_usage),
               continuous_usage=bool(opts and opts.continuous_usage_stats))


def _sampling_params(req, max_tokens: int, i: int, top_logprobs: int | None) -> SamplingParams:
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
        )
    except InvalidRequestError as e:
        raise from_invalid_request(e) from None


def start(state: ServerState, job: Job) -> list[asyncio.Queue]:
    """Queue every choice; if one cannot be queued, the others are aborted."""
    check_admission(state)
    queues = []
    try:
        for c in job.choices:
            queues.append(state.engine.open_stream(c.request_id, None, c.params,
                                                   prompt_token_ids=c.prompt_token_ids,
                                                   priority=job.priority))
    except InvalidRequestError as e:
        _abort(state, job, len(queues))
        raise from_invalid_request(e) from None
    except BaseException:
        _abort(state, job, len(queues))
        raise
    if state.metrics is not None:
        state.metrics.observe_request(job)
    return queues


def _abort(state: ServerState, job: Job, count: int) -> None:
    for c in job.choices[:count]:
        state.engine.abort(c.request_id)


async def merged_outputs(state: ServerState, job: Job,
                         queues: list[asyncio.Queue]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) for every choice, in the order they arrive. Closing this iterator, or
    cancelling its consumer, aborts every choice not yet finished."""
    if len(queues) == 1:  # the common case: no helper task
        c = job.choices[0]
        async for out in state.engine.stream_outputs(c.request_id, queues[0]):
            yield c.index, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice, queue: asyncio.Queue) -> None:
        try:
            async for out in state.engine.stream_outputs(choice.request_id, queue):
                merged.put_nowait((choice.index, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            merged.put_nowait((choice.index, e))

    tasks = [asyncio.create_task(pump(c, q)) for c, q in zip(job.choices, queues)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for t in tasks:
            t.cancel()  # each pump's stream_outputs aborts its request on the way out


async def collect(state: ServerState, job: Job, queues: list[asyncio.Queue]) -> dict[int, RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, out in merged_outputs(state, job, queues):
        if out.finished:
            final[index] = out
    return final
