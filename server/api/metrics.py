"""Prometheus metrics: vLLM's names, types, labels and buckets (finer for latencies), plus iterserve's own
(docs/metrics.md).

Dashboards, KEDA triggers and routers written against vLLM read these unchanged: every `vllm:` series
carries `model_name` and `engine="0"`, as vLLM v1 labels them. Counters and histograms are fed on the
engine thread after each step (prometheus-client is thread-safe); gauges of current state are read at
scrape time, so an idle server reports its true state, not the last step's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.common import wire
from iterserve.server.engine.core_client import EngineClient, StepInfo

# vLLM's bucket lists (vllm/v1/metrics/loggers.py) ...
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_PER_TOKEN_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0]
# ... with edges added between them where SLOs lie (0.1-10 s), so no bucket there spans more than 1.5x.
# A p99 is interpolated within its bucket: with few samples in a window, one first token at 2.6 s read as
# a p99 of 4.85 s in vLLM's 2.5-5 s bucket, over a 4 s SLO, and the tuner acted on it. Every vLLM edge
# stays, so a query on any `le` written for vLLM still finds its series.
TTFT_BUCKETS = sorted(VLLM_TTFT_BUCKETS + [0.15, 0.2, 0.3, 0.4, 0.6, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 15.0, 30.0])
PER_TOKEN_BUCKETS = sorted(VLLM_PER_TOKEN_BUCKETS + [0.02, 0.03, 0.04, 0.06, 0.125, 0.175, 0.25, 0.35, 0.45, 0.6,
                                                     1.5, 2.0, 3.0, 4.0])
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]
FINISH_REASONS = ("stop", "length", "abort")
CUTOFF_REASONS = ("header_timeout", "body_timeout", "stall_timeout", "reader_behind")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        lv = (model_name, "0")
        tokens = build_1_2_5_buckets(engine.max_model_len)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(*lv)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(*lv)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # in tokens, at each request's first admission (as vLLM counts them: a preempted request's
        # re-admission is not a query)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(*lv, reason) for reason in FINISH_REASONS}
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_gen_tokens = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                   tokens)
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        PER_TOKEN_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", PER_TOKEN_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)

        own = ["model_name"]

        def own_gauge(name, doc):
            return Gauge(name, doc, own, registry=r).labels(model_name)

        self.knob_gauges = {
            k: own_gauge(f"iterserve:{k}", f"Live scheduler knob {k} (changed by PATCH /admin/scheduler).")
            for k in ("max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
        }
        self.kv_cached_free = own_gauge("iterserve:kv_cache_cached_free_perc",
                                        "Share of KV blocks no request uses that hold a cached prefix (evicted "
                                        "only when the pool needs them; not counted in vllm:kv_cache_usage_perc).")
        self.kv_waste = own_gauge("iterserve:kv_cache_waste_ratio",
                                  "Share of allocated KV slots holding no token, averaged over all steps.")
        self.draining = own_gauge("iterserve:draining", "1 while the server drains after SIGTERM, else 0.")
        self.in_flight = own_gauge("iterserve:num_requests_in_flight",
                                   "HTTP-side requests (choices) queued or running, not yet answered.")
        self.prompt_tokens_pending = own_gauge(wire.PROMPT_TOKENS_PENDING,
                                               "Prompt tokens of requests in flight that have no output yet: "
                                               "the prefill ahead of a prompt that arrives now.")
        # 0 for a kernel means the engine runs the slower torch path in its place (no series off CPU fp32)
        cpu_kernels = Gauge("iterserve:cpu_kernels_available",
                            "1 when the C++ CPU kernel serves, 0 when the slower torch path stands in for it.",
                            own + ["kernel"], registry=r)
        for kernel, serving in engine.cpu_kernels.items():
            cpu_kernels.labels(model_name, kernel).set(1 if serving else 0)
        self.knob_changes = Counter("iterserve:knob_changes", "Number of scheduler knob changes applied.",
                                    own, registry=r).labels(model_name)
        self.step_failures = Counter("iterserve:engine_step_failures",
                                     "Engine steps that raised; their requests failed with a 500.",
                                     own, registry=r).labels(model_name)
        self.steps = Counter("iterserve:engine_steps", "Engine steps run.", own, registry=r).labels(model_name)
        self.step_time = Histogram("iterserve:step_duration_seconds", "Wall time of one engine step.", own,
                                   buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
                                   registry=r).labels(model_name)
        self.step_batch = Histogram("iterserve:step_sampled_requests",
                                    "Requests that produced a token in one engine step (the decode batch).", own,
                                    buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512], registry=r).labels(model_name)
        # Every answered /v1 request by status code: the tuner's error rate (429 queue full, 5xx) and
        # the share of refused requests a dashboard needs; per route so a 404 on /v1/models is not a
        # failed completion.
        self.http_responses = Counter("iterserve:http_responses", "HTTP responses to /v1 requests by route and code.",
                                      own + ["route", "code"], registry=r)
        # Connections and streams cut because the client was too slow (api/limits.py): a head or body
        # that did not arrive in time, a response nobody read, a stream whose reader fell too far behind.
        cutoffs = Counter("iterserve:client_cutoffs", "Clients cut off for being too slow, by reason.",
                          own + ["reason"], registry=r)
        self.cutoffs = {reason: cutoffs.labels(model_name, reason) for reason in CUTOFF_REASONS}
        self._seen_knob_changes = 0
        self._seen_failures = 0
        self._last_token_time: dict[str, float] = {}  # engine thread only
        engine.step_observers.append(self.observe_step)

    # -- HTTP side -------------------------------------------------------------------------------

    def observe_request(self, job) -> None:
        prompts = len(job.prompt_lengths)
        for _ in range(prompts):
            self.params_n.observe(len(job.choices) // prompts)
        for c in job.choices:
            self.params_max_tokens.observe(c.params.max_tokens)

    def observe_response(self, route: str, code: int) -> None:
        self.http_responses.labels(self.model_name, route, str(code)).inc()

    def observe_cutoff(self, reason: str) -> None:
        self.cutoffs[reason].inc()

    def render(self, draining: bool) -> bytes:
        snap = self.engine.snapshot()
        self.running.set(snap["num_running"])
        self.waiting.set(snap["num_waiting"])
        self.kv_usage.set(snap["kv_cache_usage"])
        self.kv_cached_free.set(snap["kv_cache_cached_free"])
        self.kv_waste.set(snap["kv_waste"])
        for k, v in snap["knobs"].as_dict().items():
            self.knob_gauges[k].set(v)
        self.knob_changes.inc(snap["num_knob_changes"] - self._seen_knob_changes)
        self._seen_knob_changes = snap["num_knob_changes"]
        self.step_failures.inc(snap["num_step_failures"] - self._seen_failures)
        self._seen_failures = snap["num_step_failures"]
        self.draining.set(1 if draining else 0)
        self.in_flight.set(self.engine.num_in_flight)
        self.prompt_tokens_pending.set(self.engine.num_prompt_tokens_pending)
        return generate_latest(self.registry)

    # -- engine thread ---------------------------------------------------------------------------

    def observe_step(self, info: StepInfo) -> None:
        self.steps.inc()
        self.step_time.observe(info.duration)
        self.prompt_tokens.inc(info.num_prompt_tokens)
        self.generation_tokens.inc(info.num_generation_tokens)
        self.preemptions.inc(info.num_preemptions)
        self.prefix_queries.inc(info.prefix_cache_queries)
        self.prefix_hits.inc(info.prefix_cache_hits)
        if info.num_prompt_tokens + info.num_generation_tokens:
            self.iteration_tokens.observe(info.num_prompt_tokens + info.num_generation_tokens)
        sampled = 0
        last = self._last_token_time
        for out in info.outputs:
            if out.new_token_ids:
                sampled += 1
                previous = last.get(out.request_id)
                if previous is None and out.first_token_time is not None:
                    self.ttft.observe(out.first_token_time - out.arrival_time)
                    last[out.request_id] = out.first_token_time
                elif previous is not None:
                    self.itl.observe(info.end_time - previous)
                    last[out.request_id] = info.end_time
            if out.finished:
                last.pop(out.request_id, None)
                self._observe_finished(out)
        if sampled:
            self.step_batch.observe(sampled)

    def _observe_finished(self, out) -> None:
        reason = out.finish_reason or "abort"
        self.success[reason].inc()
        if reason == "abort" or out.first_token_time is None or out.scheduled_time is None:
            return  # latencies of a request cut short would skew every histogram
        end = out.finished_time or out.first_token_time
        decode = end - out.first_token_time
        self.e2e.observe(end - out.arrival_time)
        self.queue_time.observe(out.scheduled_time - out.arrival_time)
        self.inference_time.observe(end - out.scheduled_time)
        self.prefill_time.observe(out.first_token_time - out.scheduled_time)
        self.decode_time.observe(decode)
        n = len(out.token_ids)
        if n > 1:
            self.tpot.observe(decode / (n - 1))
        self.req_prompt_tokens.observe(len(out.prompt_token_ids))
        self.req_gen_tokens.observe(n)
