"""Offline batch inference, in the shape of vLLM's `LLM.generate`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from tqdm import tqdm

from iterserve.server.config import EngineConfig
from iterserve.server.engine.engine_factory import build_engine
from iterserve.server.engine.outputs import RequestOutput
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.errors import InvalidRequestError


class LLM:
    """`LLM(model=None, **engine_options)`; options are EngineConfig's fields (dtype, max_num_seqs, ...).

    `LLM(config=EngineConfig(...))` takes a ready config instead.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **engine_options):
        if config is not None and (model is not None or engine_options):
            raise TypeError("give either config or model/engine options, not both")
        self.engine = build_engine(config or EngineConfig(model=model, **engine_options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        A request that fails validation raises InvalidRequestError (naming the field) before this
        call's other requests run; requests queued by others are not affected.
        """
        inputs = _normalize_prompts(prompts, prompt_token_ids)
        params = _per_request(sampling_params, len(inputs), "sampling_params") or [SamplingParams()] * len(inputs)
        priorities = _per_request(priority, len(inputs), "priority") or [0] * len(inputs)
        requests = []
        for i, ((text, token_ids), p, prio) in enumerate(zip(inputs, params, priorities, strict=True)):
            try:
                requests.append(self.engine.make_request(text, p, prompt_token_ids=token_ids, priority=prio))
            except InvalidRequestError as e:
                raise InvalidRequestError(e.param, f"prompt {i}: {e.message}") from None
        for req in requests:  # all valid: only now does any of them join the queue
            self.engine.enqueue(req)
        return self._run([r.request_id for r in requests], use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise InvalidRequestError("messages", "this model has no tokenizer and so no chat template")
        conversations = cast(list[list[dict]], [messages] if messages and isinstance(messages[0], dict) else messages)
        return self.generate(prompt_token_ids=[self.chat_prompt_ids(c) for c in conversations],
                             sampling_params=sampling_params, use_tqdm=use_tqdm)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # the template already writes any BOS it wants: adding special tokens again would double it
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {len(pending)} requests unfinished")
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
    if (prompts is None) == (prompt_token_ids is None):
        raise InvalidRequestError("prompt", "give exactly one of prompts or prompt_token_ids")
    if prompts is not None:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts:
            raise InvalidRequestError("prompt", "no prompts given")
        return [(p, None) for p in prompts]
    if prompt_token_ids and all(isinstance(t, int) for t in prompt_token_ids):
        prompt_token_ids = [prompt_token_ids]
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "no prompts given")
    return [(None, list(ids)) for ids in prompt_token_ids]


def _per_request(value, n: int, name: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, (SamplingParams, int)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise InvalidRequestError(name, f"has {len(value)} entries for {n} prompts")
    return value
