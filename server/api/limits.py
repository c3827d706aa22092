"""`ServerLimits`: how much one HTTP request may ask of the server and how long a client may take.

The defaults are the ones a production deployment keeps (the README's flag table). A body over
`max_request_bytes` is refused with 413 (after the API key is checked); a request head must arrive within
`header_timeout` s and its body within `body_timeout` s; a client that reads none of a response for
`stall_timeout` s, or falls `max_buffered_tokens` tokens behind one of its streams, is cut off and its
requests are aborted. The per-request parameter limits that do not depend on the deployment (n, stop
strings, logprobs, ...) are constants in `protocol`.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.server.config import check_positive_int
from iterserve.server.errors import InvalidRequestError

DEFAULT_MAX_PROMPT_TOKENS = 131072  # per request, unless max_model_len is larger
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 4 * 2**20
    # prompt tokens one request makes the engine compute: every prompt, counted once per choice (n);
    # None: the larger of DEFAULT_MAX_PROMPT_TOKENS and max_model_len
    max_prompt_tokens: int | None = None
    header_timeout: float = 10.0  # from the connection's opening, or a kept-alive one's first byte
    body_timeout: float = 30.0  # from the end of the head to the last byte of the body
    # an idle kept-alive connection is closed after this; longer than the router's (and most proxies')
    # 60 s pool, so that a proxy closes its idle connections before the pod does and never sends a request
    # on one the pod is closing (nginx's own default is 75 s too). A partial head still gets header_timeout.
    keep_alive_timeout: float = 75.0
    stall_timeout: float = 30.0  # a response nobody reads for this long is cut off
    max_buffered_tokens: int = 2048  # tokens of one choice waiting for a reader that has stopped reading

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_buffered_tokens"):
            check_positive_int(name, getattr(self, name))
        if self.max_prompt_tokens is not None:
            check_positive_int("max_prompt_tokens", self.max_prompt_tokens)
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "stall_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidRequestError(name, f"must be a number of seconds > 0, got {value!r}")

    def prompt_token_limit(self, max_model_len: int) -> int:
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens
        return max(DEFAULT_MAX_PROMPT_TOKENS, max_model_len)

