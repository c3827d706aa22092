"""A queueing-style latency model of one continuous-batching server, for closed-loop tests of the tuner.

A step takes `t0 + per_seq x batch + per_prefill_token x chunk` when a prefill chunk rides along, so ITL
grows with the batch and the chunk. A request runs ceil(prompt / chunk) prefill steps and `output` decode
steps; the server is max_num_seqs servers of that service time, so below capacity requests wait as in an
M/M/c queue (Sakasegawa's approximation), and above it a backlog builds up, fills the batch and drains once
capacity returns: TTFT grows with queueing when max_num_seqs is too low for the arrival rate, and with the
number of prefill steps when the chunk is too small. KV demand is running sequences x mean context over
the pool; above `preempt_above` of it the server preempts. The noise is multiplicative on the p99s and
Poisson on the sample count, from a seeded generator.

`exact_prefill` (off for the tuning tests, whose tables were set on the model without it): a step carries
the prompt tokens its requests need on average (each request's prompt over its steps), at most a chunk, not
a whole chunk per prefill step; a request's prefill costs its own prompt's tokens; and a pod finishes no
more prompts than a chunk a step allows. Fitted to real pods (benchmarks/fleet_scenario.py), where prefill
is most of the work, the model without it would let a big batch finish prompts no step has room for.
`slowdown` stretches every step (pods sharing the cores of one machine).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from iterserve.common.wire import Knobs
from iterserve.operator.tuning.observation import Observation


@dataclass(frozen=True)
class Steady:
    batch: float  # mean running sequences
    capacity: float  # requests per second the server can finish
    wait_s: float  # mean queueing before admission (no backlog)
    itl_p99_s: float
    prefill_s: float  # admission to first token
    kv_demand: float  # running tokens / pool


@dataclass
class LatencyModel:
    prompt: int = 200
    output: int = 50
    t0: float = 0.010
    per_seq: float = 0.0006
    per_prefill_token: float = 0.00008
    kv_tokens: int = 16_000
    preempt_above: float = 1.0  # KV demand (share of the pool) above which the server preempts
    noise: float = 0.08
    seed: int = 0
    exact_prefill: bool = False
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.backlog = 0.0  # requests queued beyond what the steady state holds

    def _chunk(self, knobs: Knobs) -> tuple[int, int]:
        chunk = min(knobs.prefill_chunk_size, knobs.max_num_batched_tokens, self.prompt)
        return chunk, math.ceil(self.prompt / chunk)

    def _step(self, batch: float, chunk: int, prefill_steps: int, with_prefill: bool = False) -> float:
        if self.exact_prefill:
            tokens = chunk if with_prefill else min(chunk, batch * self.prompt / (prefill_steps + self.output))
            return self.slowdown * (self.t0 + self.per_seq * batch + self.per_prefill_token * tokens)
        share = 1.0 if with_prefill else min(1.0, batch * prefill_steps / (prefill_steps + self.output))
        return self.slowdown * (self.t0 + self.per_seq * batch + self.per_prefill_token * chunk * share)

    def steady(self, knobs: Knobs, rate: float, saturated: bool = False) -> Steady:
        chunk, prefill_steps = self._chunk(knobs)
        steps, seqs = prefill_steps + self.output, knobs.max_num_seqs
        capacity = seqs / (steps * self._step(seqs, chunk, prefill_steps))
        if self.exact_prefill:  # no more prompts than the steps' prefill room
            capacity = min(capacity, chunk / (self.prompt * self._step(seqs, chunk, prefill_steps)))
        batch = float(seqs)
        if not saturated:
            batch = 0.0
            for _ in range(100):  # the batch sets the step time, which sets how many requests are running
                batch = min(seqs, rate * steps * self._step(batch, chunk, prefill_steps))
        rho = min(rate / capacity, 0.98)
        wait = rho ** (math.sqrt(2 * (seqs + 1)) - 1) / (seqs * (1 - rho)) * (seqs / capacity)
        itl = self._step(batch, chunk, prefill_steps, with_prefill=batch * prefill_steps / steps > 0.01)
        prefill = prefill_steps * self._step(batch, chunk, prefill_steps, with_prefill=True)
        if self.exact_prefill:  # its steps as they run, and its own prompt's tokens
            prefill = (prefill_steps * self._step(batch, chunk, prefill_steps)
                       + self.slowdown * self.per_prefill_token * self.prompt)
        kv = batch * (self.prompt + self.output / 2) / self.kv_tokens
        return Steady(batch, capacity, wait, itl, prefill, kv)

    def meets(self, knobs: Knobs, rate: float, ttft_s: float, itl_s: float) -> bool:
        """Noise-free and in steady state: does this setting meet the SLO without preempting?"""
        s = self.steady(knobs, rate)
        return (s.capacity > rate and 3 * s.wait_s + s.prefill_s <= ttft_s and s.itl_p99_s <= itl_s
                and s.kv_demand <= self.preempt_above)

    def window(self, knobs: Knobs, rate: float, start: float, end: float) -> Observation:
        """Run the server for one window and report what its metrics would show."""
        dt = end - start
        capacity = self.steady(knobs, rate).capacity
        self.backlog = max(0.0, self.backlog + (rate - capacity) * dt)
        s = self.steady(knobs, rate, saturated=self.backlog > 0)
        wait = s.wait_s + self.backlog / capacity
        ttft = 3 * wait + s.prefill_s  # the p99 of an exponential-ish wait is a few times its mean
        finished = min(rate, capacity)
        preempt = max(0.0, s.kv_demand - self.preempt_above) * finished * 5
        jitter = lambda: math.exp(self.rng.gauss(0, self.noise))  # noqa: E731
        return Observation(
            start=start, end=end, num_pods=1, num_samples=_poisson(self.rng, finished * dt),
            ttft_p99_s=ttft * jitter(), itl_p99_s=s.itl_p99_s * jitter(), request_rate=finished,
            prompt_token_rate=finished * self.prompt, generation_token_rate=finished * self.output,
            waiting=rate * wait, running=s.batch, queue_time_mean_s=wait, kv_usage=min(1.0, s.kv_demand),
            preemption_rate=preempt, error_rate=0.0)


def _poisson(rng: random.Random, mean: float) -> int:
    if mean > 50:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    n, p, limit = 0, 1.0, math.exp(-mean)
    while True:
        p *= rng.random()
        if p <= limit:
            return n
        n += 1
