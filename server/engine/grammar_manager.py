"""The engine core's grammars: compiled off the engine loop, one matcher per request, the batch's bitmask.

    add(request)          a request with structured output: its grammar compiles in a background thread
                          (xgrammar releases the GIL; a cache keyed by the schema text makes a repeat free),
                          and the scheduler admits it once `ready` (others overtake it meanwhile)
    bitmask(out)          when the step is scheduled: one int32 bitmask row per sampling request with a
                          grammar, filled on the mask thread while the model runs (xgrammar's fill is C++
                          that releases the GIL; vLLM and SGLang overlap it the same way); the runner waits
                          for it only where it applies it, after the forward pass. None (no cost at all)
                          while no live request has a grammar
    accept(id, token)     after sampling (the step's fill is done: accept waits for it, so a matcher never
                          advances while it is read): advance the matcher on the accepted token; True once
                          the grammar reached its end state (the request then stops, as vLLM's)
    free(ids)             finished or aborted requests drop their matcher

Preemption needs nothing here: a matcher has seen exactly the request's accepted output tokens, which
recomputing the KV cache does not change; a prompt chunk that does not sample gets no mask row.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from iterserve.server.engine.structured_output import StructuredOutput, checked_grammar_text

if TYPE_CHECKING:  # xgrammar loads with the first grammar
    import xgrammar

logger = logging.getLogger("iterserve.grammar")


@dataclass
class GrammarBitmask:
    """One step's token masks, being filled: row i (bit t of word t // 32) allows token t for request_ids[i].
    The scheduler output carries it as data; `result()` is where the runner waits for the fill."""

    request_ids: list[str]
    fill: Future[torch.Tensor]  # -> [len(request_ids), ceil(vocab / 32)] int32, on the CPU

    def result(self) -> torch.Tensor:
        return self.fill.result()


class GrammarManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, fill_threads: int = 1):
        """tokenizer: the model's (server/model/tokenizer.py); its vocabulary is read on the first grammar.
        fill_threads: xgrammar's threads for a step's masks, which run alongside the forward pass (one where
        the model computes on the CPU's cores, more where it runs on a GPU and the cores are free)."""
        self.tokenizer = tokenizer
        self.fill_threads = max(1, fill_threads)
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        # one thread: compiles use xgrammar's own threads, and the engine loop keeps a core of its own
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-grammar")
        self._compiler = None  # built in the pool on first use (reading the vocabulary takes ~1 s)
        self._compiling: dict[str, Future] = {}  # request id -> its compiled grammar, until it has a matcher
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}  # request id -> its matcher
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        # its own thread, not the compile pool's: a step's masks must not queue behind a long compile; one
        # thread, so a step's fill never overlaps the previous step's
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-grammar-mask")
        self._last_fill: Future[torch.Tensor] | None = None

    # -- requests --------------------------------------------------------------------------------

    def add(self, request_id: str, spec: StructuredOutput) -> None:
        self._compiling[request_id] = self._pool.submit(self._compile, spec)

    def ready(self, request_id: str) -> bool:
        """Whether the request may be scheduled: its grammar compiled (or failed: see take_failures)."""
        future = self._compiling.get(request_id)
        return future is None or (future.done() and future.exception() is None)

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, reason) of grammars that failed to compile since the last call; each is forgotten."""
        failed = []
        for request_id, future in list(self._compiling.items()):
            if future.done() and future.exception() is not None:
                del self._compiling[request_id]
                failed.append((request_id, str(future.exception())))
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes (an engine with nothing else to do)."""
        pending = [f for f in list(self._compiling.values()) if not f.done()]
        if pending:
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def free(self, request_ids) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._compiling.pop(request_id, None)

    @property
    def num_live(self) -> int:
        return len(self._matchers) + len(self._compiling)

    # -- one step --------------------------------------------------------------------------------

    def bitmask(self, sampling_ids: list[str]) -> GrammarBitmask | None:
        """Masks for the requests among `sampling_ids` (this step's sampling requests) that have a grammar."""
        if not self.num_live:
            return None
        ids = [r for r in sampling_ids if r in self._matchers or r in self._compiling]
        if not ids:
            return None
        matchers = [self._matcher(r) for r in ids]  # on this thread: they come from the compile pool
        self._last_fill = self._mask_pool.submit(self._fill, ids, matchers)
        return GrammarBitmask(ids, self._last_fill)

    def _fill(self, ids: list[str], matchers: list) -> torch.Tensor:
        """On the mask thread: the rows of `matchers`, as the model runs."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(ids), self.vocab_size)
        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=self.fill_threads)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        # numpy, not torch: a torch op on this thread would start an OpenMP team of its own beside the model's
        dead = (~bitmask.numpy().any(axis=1)).nonzero()[0].tolist()
        for row in dead:
            # no token continues the text (a byte sequence the grammar took but cannot finish): all -inf would
            # leave nothing to sample, so let the request end on EOS (its matcher refuses it: it stops)
            logger.warning("request %s: its grammar allows no next token; ending it", ids[row])
            for t in self.eos_token_ids:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32 if bit >= 1 << 31 else 0)  # as an int32
        return bitmask

    def accept(self, request_id: str, token_id: int) -> bool | None:
        """Advance the request's matcher on its sampled token: None when it has no grammar, else whether the
        grammar ended (its end state). A token the grammar refuses (it was masked, so only a runner that
        ignores masks produces one) also ends it, with a warning, rather than produce invalid output."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return None
        if self._last_fill is not None:  # done already when the runner applied it; a runner that ignores
            self._last_fill.result()     # masks must still not advance a matcher the fill is reading
            self._last_fill = None
        if not matcher.accept_token(token_id):
            logger.warning("request %s sampled token %d, which its grammar does not allow", request_id, token_id)
            return True
        return matcher.is_terminated()

    # -- internals -------------------------------------------------------------------------------

    def _matcher(self, request_id: str):
        matcher = self._matchers.get(request_id)
        if matcher is None:
            import xgrammar

            compiled = self._compiling.pop(request_id).result()  # ready: the scheduler admitted it
            matcher = self._matchers[request_id] = xgrammar.GrammarMatcher(compiled)
        return matcher

    def _compile(self, spec: StructuredOutput):
        # the text from the schema's check (the core checked it before it queued the request)
        return self._get_compiler().compile_grammar(checked_grammar_text(spec.json_schema))

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
            # the compiler's cache is keyed by the grammar's text: a repeated schema compiles once
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=True,
                                                      cache_limit_bytes=512 << 20)
        return self._compiler

    def warm_up(self) -> None:
        """Import xgrammar now (~1-3 s: it imports transformers) and read the vocabulary in the background,
        rather than in the first request with structured output. The import stays on the calling thread:
        a server core whose startup imported it on a second thread at times never came up."""
        import xgrammar  # noqa: F401

        self._pool.submit(self._get_compiler)


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar's view of the vocabulary, from the `tokenizers` backend (as its from_huggingface does,
    without transformers): token strings by id, and how they encode bytes (byte-level, byte-fallback).
    Special tokens are given as "", which xgrammar never allows in text: the detokenizer drops them, so the
    grammar must not count them as the characters of their name."""
    import xgrammar

    backend = tokenizer.backend
    vocab = [""] * vocab_size
    specials = {idx for idx, t in backend.get_added_tokens_decoder().items() if t.special}
    for token, idx in backend.get_vocab(with_added_tokens=True).items():
        if idx < vocab_size and idx not in specials:
            vocab[idx] = token
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgrammar.TokenizerInfo(vocab, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=eos_token_ids, add_prefix_space=metadata["add_prefix_space"])
