"""POST /tokenize, POST /detokenize and GET /version, shaped as vLLM's (its benchmarks and clients call
them). Tokenizing runs in the request thread pool, as for completions: a large prompt must not hold up
the event loop. They cost the server work, so they are behind the API key like /v1."""

from __future__ import annotations

import asyncio
import json
from importlib import metadata

from iterserve.server.api.errors import APIError
from iterserve.server.api.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, parse_body
from iterserve.server.api.serving import ServerState, check_model, render_chat


def version() -> dict:
    try:
        return {"version": metadata.version("iterserve")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "unknown"}


async def in_pool(state: ServerState, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(state.prep_pool, fn, state, *args)


def tokenize(state: ServerState, body: bytes, content_type: str | None) -> dict:
    tokenizer = _tokenizer(state, "prompt")
    # the body's keys say which request it is, as in vLLM's union of the two
    req: TokenizeChatRequest | TokenizeCompletionRequest
    if _has_messages(body):
        req = parse_body(TokenizeChatRequest, body, content_type)
    else:
        req = parse_body(TokenizeCompletionRequest, body, content_type)
    check_model(state, req.model)
    if isinstance(req, TokenizeChatRequest):
        text = render_chat(state, req.messages, add_generation_prompt=req.add_generation_prompt,
                           tools=req.tools)
    else:
        text = req.prompt
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = [tokenizer.backend.id_to_token(i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, body: bytes, content_type: str | None) -> dict:
    req = parse_body(DetokenizeRequest, body, content_type)
    check_model(state, req.model)
    tokenizer = _tokenizer(state, "tokens")
    vocab = state.engine.vocab_size
    if bad := [t for t in req.tokens if t >= vocab]:
        raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (vocabulary size {vocab})",
                       param="tokens", code="invalid_value")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _tokenizer(state: ServerState, param: str):
    if state.engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", param=param)
    return state.engine.tokenizer


def _has_messages(body: bytes) -> bool:
    # a first look; the real parse refuses what is malformed, in the completion request's terms
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and "messages" in doc
