"""Response bodies and SSE chunks in OpenAI's exact shapes (completions and chat), with usage.

Streams are `data: {json}\\n\\n` events ending in `data: [DONE]\\n\\n`. A chat stream opens each choice
with a `{"role": "assistant", "content": ""}` delta; text deltas follow as the engine produces them;
the choice's last chunk carries its finish_reason. With stream_options.include_usage every chunk has
`"usage": null` and one last chunk with no choices carries the totals. Usage counts each prompt once,
whatever n, and `prompt_tokens_details.cached_tokens` the prompt tokens found in the prefix cache (per
prompt, the fewest any of its choices found).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from iterserve.server.api.output_stream import StalledReaderError
from iterserve.server.api.serving import Job, ServerState, job_outputs
from iterserve.server.api.tool_stream import ToolCallStream, message
from iterserve.server.engine.core_client import EngineStepError, EngineStoppedError
from iterserve.server.engine.outputs import RequestOutput


def usage(job: Job, completion_tokens: int, cached: dict[int, int]) -> dict:
    """`cached`: prompt tokens each choice (by index) found in the prefix cache, as far as known."""
    prompt_tokens = sum(job.prompt_lengths)
    per_prompt: dict[int, int] = {}
    for c in job.choices:
        n = cached.get(c.index, 0)
        per_prompt[c.prompt_index] = min(per_prompt.get(c.prompt_index, n), n)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())}}


def _cached(final: dict[int, RequestOutput]) -> dict[int, int]:
    return {index: out.num_cached_tokens for index, out in final.items()}


def _token_texts(state: ServerState, ids: list[int]) -> list[str]:
    tok = state.engine.tokenizer
    if tok is None:
        return [f"token_id:{t}" for t in ids]
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def completion_logprobs(state: ServerState, ids: list[int], logprobs: list[float] | None,
                        top: list[list[tuple[int, float]]] | None, text_offset: int = 0) -> dict | None:
    """OpenAI's legacy format: top_logprobs maps each alternative's text to its logprob; the chosen
    token is always among them, as in vLLM."""
    if logprobs is None:
        return None
    tokens = _token_texts(state, ids)
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        alternatives = {}
        if top:
            alternatives = dict(zip(_token_texts(state, [a for a, _ in top[i]]), [v for _, v in top[i]], strict=True))
        tops.append({**alternatives, t: lp})
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(state: ServerState, ids: list[int], logprobs: list[float] | None,
                  top: list[list[tuple[int, float]]] | None) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(_token_texts(state, ids), logprobs, strict=True)):
        alternatives = []
        if top:
            for text, (_, value) in zip(_token_texts(state, [a for a, _ in top[i]]), top[i], strict=True):
                alternatives.append({"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))})
        content.append({"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": alternatives})
    return {"content": content}


def completion_body(state: ServerState, job: Job, final: dict[int, RequestOutput]) -> dict:
    choices = []
    for c in job.choices:
        out = final[c.index]
        choices.append({
            "index": c.index, "text": out.text,
            "logprobs": completion_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs),
            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
        })
    return {"id": job.id, "object": "text_completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": usage(job, sum(len(o.token_ids) for o in final.values()), _cached(final))}


def chat_body(state: ServerState, job: Job, final: dict[int, RequestOutput]) -> dict:
    choices = []
    for c in job.choices:
        out = final[c.index]
        msg, finish = {"role": "assistant", "content": out.text}, out.finish_reason
        if job.tools is not None:
            msg, finish = message(job.tools, out.text, finish)
        choices.append({
            "index": c.index, "message": msg,
            "logprobs": chat_logprobs(state, out.token_ids, out.logprobs, out.top_logprobs),
            "finish_reason": finish, "stop_reason": out.stop_reason,
        })
    return {"id": job.id, "object": "chat.completion", "created": job.created, "model": state.model_name,
            "choices": choices, "usage": usage(job, sum(len(o.token_ids) for o in final.values()), _cached(final))}


def _tool_chunks(stream: ToolCallStream, out: RequestOutput, logprobs: dict | None, finish: str | None) -> list[dict]:
    """One step's chunks of a choice with tools: its deltas (the step's logprobs on the first, the finish
    on the last). A step whose text is held back sends nothing, unless it carries logprobs or the finish."""
    deltas = stream.feed(out.new_text) + (stream.finish() if out.finished else [])
    if not deltas and (logprobs is not None or finish):
        deltas = [{}]
    parts: list[dict[str, Any]] = [{"delta": d, "logprobs": None, "finish_reason": None, "stop_reason": None}
                                   for d in deltas]
    if parts:
        parts[0]["logprobs"] = logprobs
        if finish:
            parts[-1].update(finish_reason=stream.finish_reason(finish), stop_reason=out.stop_reason)
    return parts


_STREAM_ERRORS = {EngineStepError: (500, "internal_error"), EngineStoppedError: (503, "service_unavailable"),
                  StalledReaderError: (408, "timeout_error")}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream_events(state: ServerState, job: Job, queues, chat: bool) -> AsyncIterator[str]:
    """The SSE body of a streaming request. Cancelling it (client gone) aborts its choices."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": job.id, "object": obj, "created": job.created, "model": state.model_name}
    with_usage = job.include_usage
    num_tokens = 0
    text_offsets: dict[int, int] = {}
    cached: dict[int, int] = {}

    def chunk(choice: dict, extra_usage: dict | None = None) -> str:
        body = {**base, "choices": [choice]}
        if with_usage:
            body["usage"] = extra_usage
        return _sse(body)

    tool_streams = {c.index: ToolCallStream(job.tools) for c in job.choices} if chat and job.tools else {}
    if chat:
        for c in job.choices:
            yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
    try:
        async for index, out in job_outputs(state, job, queues):
            num_tokens += len(out.new_token_ids)
            cached[index] = out.num_cached_tokens
            if not out.new_token_ids and not out.finished:
                continue  # nothing new (vLLM's "don't return empty chunks")
            # ... but a token whose text is held back (part of a character split over byte-level tokens,
            # or a possible stop string) still gets its chunk, with empty text, as in vLLM: the client
            # sees one chunk per token at the engine's pace, not a stall of two steps (a client-side ITL
            # twice the step time) whenever a character spans two tokens
            running_usage = usage(job, num_tokens, cached) if job.continuous_usage else None
            finish = out.finish_reason if out.finished else None
            if chat:
                logprobs = chat_logprobs(state, out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                if index in tool_streams:
                    for part in _tool_chunks(tool_streams[index], out, logprobs, finish):
                        yield chunk({"index": index, **part}, running_usage)
                    continue
                delta = {"content": out.new_text} if out.new_text or not out.finished else {}
                yield chunk({"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish, "stop_reason": out.stop_reason if finish else None},
                            running_usage)
            else:
                at = text_offsets.get(index, 0)
                text_offsets[index] = at + len(out.new_text)
                yield chunk({"index": index, "text": out.new_text,
                             "logprobs": completion_logprobs(state, out.new_token_ids, out.new_logprobs,
                                                             out.new_top_logprobs, at),
                             "finish_reason": finish, "stop_reason": out.stop_reason if finish else None},
                            running_usage)
    except (EngineStepError, EngineStoppedError, StalledReaderError) as e:
        # the status line is long gone: report the failure in the stream, as vLLM does
        code, kind = _STREAM_ERRORS[type(e)]
        yield _sse({"error": {"message": str(e), "type": kind, "param": None, "code": code}})
    if with_usage:
        yield _sse({**base, "choices": [], "usage": usage(job, num_tokens, cached)})
    yield "data: [DONE]\n\n"
