"""One streaming request -> one `RequestRecord`: start, first token, every token's arrival, end, errors.

Tokens are counted from the stream itself. With `stream_options.continuous_usage_stats` (vLLM and
iterserve) every chunk carries the running `usage.completion_tokens`, so a chunk that holds two tokens
counts two; without it each chunk with text counts one and the final `usage` (`include_usage`) fixes
the total. `probe_target` finds out, with one 1-token request, which of token-id prompts,
`ignore_eos` and continuous usage the server accepts, dropping each one it refuses by name. `HttpSender`
puts the three behind the load loop's `RequestSender` seam (load.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx

from iterserve.bench.workload import RequestSpec

ERROR_KINDS = ("http", "stream", "timeout", "connection", "protocol", "cancelled")


class BenchError(RuntimeError):
    """The benchmark cannot run at all (unreachable server, refused request shape): one line for the user."""


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds since the run started (perf_counter)."""

    index: int
    kind: str
    max_tokens: int
    start: float
    input_len: int | None = None  # the planned prompt length (synthetic prompts)
    prompt_tokens: int | None = None  # what the server counted (usage)
    output_tokens: int = 0
    first_token: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that chunk
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    error_kind: str | None = None  # one of ERROR_KINDS

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    def fail(self, kind: str, message: str, now: float) -> None:
        if self.error is None:  # the first failure is the cause; later ones are its echoes
            self.error_kind, self.error = kind, message
        if self.end is None:
            self.end = now

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        return cls(**d)


def run_clock(t0: float):
    """Seconds since t0, to the microsecond: records hold exactly what their JSON will, so figures
    recomputed from a saved file equal the saved figures."""
    return lambda: round(time.perf_counter() - t0, 6)


@dataclass(frozen=True)
class Target:
    """Where and how to send: the endpoint and the request features this server accepts."""

    url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    token_ids: bool = True
    ignore_eos: bool = True
    continuous_usage: bool = True
    temperature: float = 0.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_body(target: Target, spec: RequestSpec) -> dict:
    body: dict[str, Any] = {"model": target.model, "max_tokens": spec.max_tokens, "temperature": target.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if target.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        body["messages"] = spec.messages or [{"role": "user", "content": spec.text()}]
    elif spec.prompt_ids is not None and target.token_ids:
        body["prompt"] = spec.prompt_ids
    else:
        body["prompt"] = spec.text()
    return body


def error_message(response_body: bytes) -> str:
    """The server's own words: OpenAI's {"error": {"message"}} or FastAPI's {"detail"} or the text."""
    text = response_body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:300] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message", err))[:300]
        if err is not None:
            return str(err)[:300]
    return text[:300]


async def stream_request(client: httpx.AsyncClient, target: Target, spec: RequestSpec, record: RequestRecord,
                         t0: float, timeout: float) -> None:
    """Send `spec`, filling `record` as chunks arrive. Never raises but CancelledError (record kept)."""
    now = run_clock(t0)
    try:
        await asyncio.wait_for(_stream(client, target, spec, record, now), timeout)
    except asyncio.TimeoutError:
        record.fail("timeout", f"no complete answer within {timeout:g} s", now())
    except asyncio.CancelledError:
        record.fail("cancelled", "the run was stopped before this request finished", now())
        raise
    except httpx.TimeoutException as e:
        record.fail("timeout", f"{type(e).__name__}: {e or 'timed out'}", now())
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        record.fail("connection", f"{type(e).__name__}: {e or 'connection lost'}", now())
    except httpx.HTTPError as e:
        record.fail("connection", f"{type(e).__name__}: {e}", now())


async def _stream(client, target, spec, record, now) -> None:
    seen = 0  # running completion_tokens from continuous usage
    async with client.stream("POST", target.url + target.path, json=build_body(target, spec),
                             headers=target.headers) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.fail("http", f"HTTP {response.status_code}: {error_message(await response.aread())}", now())
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                record.end = now()
                return
            arrival = now()
            try:
                chunk = json.loads(data)
            except ValueError:
                record.fail("protocol", f"unreadable stream chunk: {data[:120]}", arrival)
                return
            if "error" in chunk:
                record.fail("stream", f"error in stream: {error_message(data.encode())}", arrival)
                continue  # the server still ends the stream; keep reading for its usage
            seen = _take_chunk(record, chunk, arrival, seen, target.continuous_usage)
        record.fail("protocol", "the stream ended without data: [DONE]", now())


def _take_chunk(record: RequestRecord, chunk: dict, arrival: float, seen: int, continuous: bool) -> int:
    usage = chunk.get("usage") or None
    choices = chunk.get("choices") or []
    for choice in choices:
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    if continuous and usage is not None and choices:
        new_tokens = usage.get("completion_tokens", seen) - seen
    else:
        new_tokens = sum(1 for c in choices if c.get("text") or (c.get("delta") or {}).get("content"))
    if new_tokens > 0:
        if record.first_token is None:
            record.first_token = arrival
        record.chunk_times.append(arrival)
        record.chunk_tokens.append(new_tokens)
        record.output_tokens += new_tokens
        seen += new_tokens
    if usage is not None:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        if not choices:  # the closing usage chunk: the server's count wins
            record.output_tokens = usage.get("completion_tokens", record.output_tokens)
    return seen


async def fetch_models(client: httpx.AsyncClient, url: str, api_key: str | None) -> list[dict]:
    """GET /v1/models; an unreachable server or a refusal is a BenchError with one clear line."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(url + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {url}: {type(e).__name__}: {e or 'no answer'}") from None
    if r.status_code != 200:
        raise BenchError(f"{url}/v1/models answered HTTP {r.status_code}: {error_message(r.content)}")
    try:
        return list(r.json()["data"])
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models did not answer an OpenAI model list") from None


OPTIONAL_FEATURES = {"continuous_usage_stats": "continuous_usage", "ignore_eos": "ignore_eos",
                     "prompt": "token_ids"}


async def probe_target(client: httpx.AsyncClient, target: Target, spec: RequestSpec) -> Target:
    """Send `spec` with max_tokens=1; when the server refuses a field this client can do without, drop
    it and try again. Any other refusal is a BenchError naming the server's reason."""
    spec = replace(spec, max_tokens=1)
    for _ in range(len(OPTIONAL_FEATURES) + 1):
        record = RequestRecord(index=-1, kind="probe", max_tokens=1, start=0.0)
        await stream_request(client, target, spec, record, time.perf_counter(), timeout=300)
        if record.ok:
            return target
        if record.error_kind != "http" or record.status not in (400, 422):
            raise BenchError(f"the first request to {target.url}{target.path} failed: {record.error}")
        refused = [attr for name, attr in OPTIONAL_FEATURES.items()
                   if name in (record.error or "") and getattr(target, attr)]
        if not refused:
            raise BenchError(f"{target.url}{target.path} refused the request: {record.error}")
        off: dict[str, Any] = {refused[0]: False}
        target = replace(target, **off)
    raise BenchError(f"{target.url}{target.path} refused every request shape tried")


class HttpSender:
    """The `RequestSender` (load.py) of `iterserve bench`: OpenAI's streaming HTTP API through one httpx
    connection pool, which its owner opens and closes in the run's event loop (the load loop shares it
    with its /metrics scrapes)."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def models(self, url: str, api_key: str | None) -> list[dict]:
        return await fetch_models(self.client, url, api_key)

    async def probe(self, target: Target, spec: RequestSpec) -> Target:
        return await probe_target(self.client, target, spec)

    async def send(self, target: Target, spec: RequestSpec, record: RequestRecord, t0: float,
                   timeout: float) -> None:
        await stream_request(self.client, target, spec, record, t0, timeout)
