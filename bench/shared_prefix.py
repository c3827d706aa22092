"""Shared-prefix workloads, what prefix caching is for; seeded like every other shape (workload.py).

- `system-prompt`: `num_prefixes` long system prompts of `prefix_len` tokens; each request is one of them
  (drawn at random) followed by a short question of its own (the input length).
- `multi-turn`: conversations of `num_turns` turns. Each opens with a context of its own of `prefix_len`
  tokens; each turn resends the whole history (context, earlier questions and answers) and a new
  question (the input length). The answers are seeded tokens of the output length, as a client storing
  a transcript resends it, so what is resent of an answer is not what the model generated: only
  the earlier prompts can be found cached. `num_prefixes` conversations are under way at once, their
  turns interleaved (turn 1 of each, then turn 2 of each, ...); one that is done, or whose next turn
  would not fit in max_model_len, is replaced by a new one.
- `shared-mix`: both of those mixed with `random` traffic.

`max_prefix_hits` gives a sequence of prompts' best possible prefix cache hits, to read a server's
vllm:prefix_cache_hits against.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

SHARED_SHAPES = ("system-prompt", "multi-turn", "shared-mix")


@dataclass
class _Conversation:
    number: int
    ids: list[int]
    messages: list[dict]
    turns: int = 0
    texts: list[str] = field(default_factory=list)


class SharedPrefixWorkload:
    def __init__(self, spec, tokenizer):
        self.spec = spec
        self.tokenizer = tokenizer
        self.lo, self.hi = spec.token_range
        self.system_prompts = [self._segment(spec.prefix_len, ("system", k)) for k in range(spec.num_prefixes)]
        self.conversations = [self._new_conversation(k) for k in range(spec.num_prefixes)]
        self.next_number = spec.num_prefixes
        self.turn_at = 0  # the conversation whose turn is next

    def _segment(self, n: int, key: tuple) -> tuple[list[int], str]:
        """`n` seeded token ids and a text of about (with a tokenizer: exactly) as many tokens."""
        from iterserve.bench.workload import exact_text_prompt, words_prompt

        seed = int.from_bytes(hashlib.blake2b(repr((self.spec.seed, *key)).encode(), digest_size=4).digest(), "little")
        rng = random.Random(seed)
        ids = [rng.randrange(self.lo, self.hi) for _ in range(n)]
        text = exact_text_prompt(self.tokenizer, n, seed) if self.tokenizer else words_prompt(n, seed)
        return ids, text

    def _new_conversation(self, number: int) -> _Conversation:
        ids, text = self._segment(self.spec.prefix_len, ("conversation", number))
        return _Conversation(number, ids, [{"role": "system", "content": text}], texts=[text])

    def system_prompt_request(self, index: int, rng: random.Random, input_len: int, output_len: int):
        from iterserve.bench.workload import RequestSpec

        ids, text = self.system_prompts[rng.randrange(len(self.system_prompts))]
        q_ids, q_text = self._segment(input_len, ("question", index))
        return RequestSpec(index=index, kind="system-prompt", max_tokens=output_len, prompt_ids=ids + q_ids,
                           prompt_text=f"{text}\n{q_text}", input_len=len(ids) + input_len,
                           messages=[{"role": "system", "content": text}, {"role": "user", "content": q_text}])

    def turn_request(self, index: int, input_len: int, output_len: int):
        from iterserve.bench.workload import RequestSpec

        slot = self.turn_at
        self.turn_at = (self.turn_at + 1) % len(self.conversations)
        conv = self.conversations[slot]
        limit = self.spec.max_model_len
        too_long = limit is not None and len(conv.ids) + input_len + 2 * output_len > limit
        if conv.turns >= self.spec.num_turns or (too_long and conv.turns):
            conv = self.conversations[slot] = self._new_conversation(self.next_number)
            self.next_number += 1
        q_ids, q_text = self._segment(input_len, ("turn", conv.number, conv.turns))
        conv.ids += q_ids
        conv.messages.append({"role": "user", "content": q_text})
        conv.texts.append(q_text)
        spec = RequestSpec(index=index, kind="multi-turn", max_tokens=output_len, prompt_ids=list(conv.ids),
                           prompt_text="\n".join(conv.texts), messages=list(conv.messages), input_len=len(conv.ids))
        # the answer the client stores and resends with the next turn
        a_ids, a_text = self._segment(output_len, ("answer", conv.number, conv.turns))
        conv.ids += a_ids
        conv.messages.append({"role": "assistant", "content": a_text})
        conv.texts.append(a_text)
        conv.turns += 1
        return spec


def generate_shared(spec, classes, counter, rng: random.Random, tokenizer) -> Iterator:
    """The requests of a shared-prefix shape (`classes`: its PRESETS entry)."""
    from iterserve.bench.workload import RequestSpec, _clip, exact_text_prompt

    workload = SharedPrefixWorkload(spec, tokenizer)
    weights = [share for _, share, _, _ in classes]
    for i in counter:
        kind, _, input_dist, output_dist = classes[0] if len(classes) == 1 else rng.choices(classes, weights)[0]
        input_len = (spec.input_len or input_dist).sample(rng)
        output_len = (spec.output_len or output_dist).sample(rng)
        if kind == "system-prompt":
            input_len, output_len = _clip(spec.prefix_len + input_len, output_len, spec.max_model_len)
            yield workload.system_prompt_request(i, rng, max(1, input_len - spec.prefix_len), output_len)
        elif kind == "multi-turn":
            yield workload.turn_request(i, input_len, output_len)
        else:
            input_len, output_len = _clip(input_len, output_len, spec.max_model_len)
            ids = [rng.randrange(workload.lo, workload.hi) for _ in range(input_len)]
            text = exact_text_prompt(tokenizer, input_len, seed=spec.seed * 1_000_003 + i) if tokenizer else None
            yield RequestSpec(index=i, kind=kind, max_tokens=output_len, prompt_ids=ids, prompt_text=text,
                              input_len=input_len)


def max_prefix_hits(prompts, block_size: int = 16) -> tuple[int, int]:
    """(prompt tokens, of which the most a prefix cache could find) for these prompts sent one after
    another to an unbounded cache: each finds the longest prefix, in whole blocks short of its last
    token, that an earlier one computed (vLLM's counting: its queries are prompt tokens)."""
    seen: set[int] = set()
    queries = hits = 0
    for p in prompts:
        queries += len(p)
        chain, h = [], 0
        for i in range(len(p) // block_size):
            h = hash((h, tuple(p[i * block_size:(i + 1) * block_size])))
            chain.append(h)
        found = 0
        while found < (len(p) - 1) // block_size and chain[found] in seen:
            found += 1
        hits += found * block_size
        seen.update(chain)
    return queries, hits
