"""A prompt and its parameters -> a validated `Request`, on the caller's side of the engine core.

Shared by the offline `LLMEngine` and the server's `EngineClient`, so both refuse the same inputs with
the same field-named errors, before anything is queued. A JSON schema is checked here only where the
engine core runs in this process (`check_schemas`, offline): the server's core checks its requests'
schemas itself, so the server's process never imports the grammar engine (and torch with it).
"""

from __future__ import annotations

import uuid

from iterserve.server.engine.request import Request
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.structured_output import check_schema
from iterserve.server.errors import InvalidRequestError


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, *, check_schemas: bool = False):
        self.tokenizer = tokenizer
        self.check_schemas = check_schemas
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def make_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                     prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                     priority: int = 0) -> Request:
        """Validate a request without queueing it (raises InvalidRequestError naming the field)."""
        params = sampling_params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        spec = params.structured_output
        if spec is not None and self.tokenizer is None:
            raise InvalidRequestError("response_format", "structured output needs the model's tokenizer (its "
                                      "vocabulary is what the grammar masks); this model has none")
        if spec is not None and spec.json_schema is not None and self.check_schemas:
            check_schema(spec.json_schema)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError("priority", f"must be an integer, got {priority!r}")
        return Request(request_id=request_id or uuid.uuid4().hex, prompt_token_ids=ids, sampling_params=params,
                       priority=priority)

    def _prompt_ids(self, prompt, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt", f"must be a string or token ids, got {type(prompt).__name__}")
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer: pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError("prompt", f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return ids
