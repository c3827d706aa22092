"""`iterserve serve`'s request limits, client timeouts and scheduling policy (flags -> `ServerLimits`),
and the rule its secrets must meet."""

from __future__ import annotations

import argparse

from iterserve.common import wire
from iterserve.server.api.limits import DEFAULT_MAX_PROMPT_TOKENS, SCHEDULING_POLICIES, ServerLimits
from iterserve.server.config import parse_memory
from iterserve.server.errors import InvalidRequestError

MIN_SECRET_LENGTH = 16
_D = ServerLimits()


def add_server_limit_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("request limits and client timeouts")
    g.add_argument("--max-request-bytes", default="4MiB",
                   help="largest request body (e.g. 4MiB); larger ones get 413, after the API key is checked")
    g.add_argument("--max-prompt-tokens-per-request", type=int, default=None,
                   help="prompt tokens one request may make the engine compute, each prompt counted once per "
                        f"choice (default: the larger of {DEFAULT_MAX_PROMPT_TOKENS} and max_model_len)")
    g.add_argument("--header-timeout", type=float, default=_D.header_timeout,
                   help="seconds a client has to send a whole request head; then the connection is closed")
    g.add_argument("--body-timeout", type=float, default=_D.body_timeout,
                   help="seconds a client has to send a whole request body once its head is in (else 408)")
    g.add_argument("--keep-alive-timeout", type=float, default=_D.keep_alive_timeout,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--stall-timeout", type=float, default=_D.stall_timeout,
                   help="seconds a client may read nothing of a response the server is sending before it is "
                        "cut off and its requests aborted")
    g.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs: requests are served in arrival order and a non-zero `priority` is refused; "
                        "priority: lower `priority` first")


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    kind, size = parse_memory(args.max_request_bytes, "max_request_bytes")
    if kind == "fraction" or size != int(size):
        raise InvalidRequestError("max_request_bytes",
                                  f"must be a whole number of bytes, got {args.max_request_bytes!r}")
    return ServerLimits(max_request_bytes=int(size), max_prompt_tokens=args.max_prompt_tokens_per_request,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        keep_alive_timeout=args.keep_alive_timeout, stall_timeout=args.stall_timeout)


def check_secrets(api_key: str | None, admin_token: str | None) -> None:
    """Each secret set must be long enough to resist guessing, and the two must differ: an API key
    holder must not be able to retune the server."""
    for flag, env, value in (("--api-key", wire.API_KEY_ENV, api_key),
                             ("--admin-token", wire.ADMIN_TOKEN_ENV, admin_token)):
        if value is not None and len(value) < MIN_SECRET_LENGTH:
            raise InvalidRequestError(flag, f"(or env {env}) must be at least {MIN_SECRET_LENGTH} characters, got "
                                      f"{len(value)}; use a random one, e.g. `openssl rand -hex 16`")
    if api_key is not None and api_key == admin_token:
        raise InvalidRequestError("--admin-token", "must differ from --api-key: whoever holds the API key could "
                                  "otherwise change the scheduler")
