"""`iterserve bench`: argparse front end of the load generator, and `iterserve bench compare`.

Only argparse is imported at module level: `iterserve --help` must not pay for httpx, rich or
matplotlib. Exit status: 0 done, 1 no request succeeded (or an unexpected failure; partial results
are still written), 2 bad arguments or an unusable server, 130 interrupted (partial results written).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from iterserve.bench.workload import SHAPES  # stdlib only: cheap to import


def register(sub) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible server and report latency figures",
                       description="Send a seeded workload to an OpenAI-compatible server (closed loop, "
                                   "Poisson arrivals or a sweep) and report throughput, TTFT/TPOT/ITL/E2E "
                                   "percentiles, goodput and the server's own metrics.")
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the server's first model)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument("--admin-token", help="read the knobs from GET /admin/scheduler (else from /metrics)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random", choices=SHAPES,
                   help="request shape (default random; jsonl needs --jsonl)")
    w.add_argument("--input-len", help="prompt tokens: 128, uniform:32:256 or lognormal:MEDIAN:SIGMA")
    w.add_argument("--output-len", help="output tokens (max_tokens), same forms as --input-len")
    w.add_argument("--jsonl", help='prompts file for --workload jsonl: {"prompt": ..., "max_tokens": N} per line')
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prefix-len", type=int, default=1024,
                   help="system-prompt, multi-turn, shared-mix: tokens of each shared prefix (default 1024)")
    w.add_argument("--num-prefixes", type=int, default=4,
                   help="distinct system prompts, or conversations under way at once (default 4)")
    w.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation (default 4)")
    w.add_argument("--prompt-token-range", default="32:127", help="LO:HI token ids of synthetic prompts")
    w.add_argument("--tokenizer", help="tokenizer.json (or a model directory) for exact-length text prompts, "
                                       "used with --endpoint chat or a server that takes no token ids")
    w.add_argument("--max-model-len", type=int, help="clip prompt + output to this (default: from /v1/models)")
    w.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early")
    w.add_argument("--temperature", type=float, default=0.0)
    ld = p.add_argument_group("load")
    ld.add_argument("--requests", type=int, help="requests per load level (default 100, or no limit with "
                                                 "--duration)")
    ld.add_argument("--duration", type=float, help="stop sending after this many seconds per load level")
    ld.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    ld.add_argument("--rate", help="open loop: requests/s (Poisson arrivals; inf: all at once)")
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    ld.add_argument("--sweep", help="concurrency=1,4,16 or rate=1,2,4: run each in turn")
    ld.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    o = p.add_argument_group("report")
    o.add_argument("--out", help="directory for results.json and the plots")
    o.add_argument("--slo", default="", help="goodput SLOs in ms, e.g. ttft=500,itl=100 (also tpot, e2e)")
    o.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                   help="a server setting the server does not report (e.g. policy=static), kept for compare")
    o.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)
    csub = p.add_subparsers(dest="bench_command")
    c = csub.add_parser("compare", help="two bench results side by side",
                        description="Print two bench results side by side with B/A ratios; warn when more "
                                    "than one server setting (or the workload or load) differs.")
    c.add_argument("a", help="results.json (or its directory) of run A")
    c.add_argument("b", help="results.json (or its directory) of run B")
    c.add_argument("--plot", help="also write throughput vs p99 latency of both to this PNG")
    c.add_argument("--name-a"), c.add_argument("--name-b")
    c.set_defaults(run=run_compare)


def _fail(message: str) -> int:
    print(f"iterserve bench: error: {message}", file=sys.stderr)
    return 2


def config_from_args(args: argparse.Namespace):
    """BenchConfig from the command line; ValueError (incl. WorkloadError) names the option."""
    from iterserve.bench.load import SWEEP_PARAMS, BenchConfig
    from iterserve.bench.report import parse_slo
    from iterserve.bench.workload import WorkloadSpec, parse_length

    if not args.url or not args.out:
        raise ValueError("--url and --out are required")
    try:
        lo, hi = (int(x) for x in args.prompt_token_range.split(":"))
    except ValueError:
        raise ValueError(f"--prompt-token-range: write LO:HI, got {args.prompt_token_range!r}") from None
    workload = WorkloadSpec(
        shape=args.workload, seed=args.seed, jsonl_path=args.jsonl, token_range=(lo, hi),
        input_len=parse_length(args.input_len, "--input-len") if args.input_len else None,
        output_len=parse_length(args.output_len, "--output-len") if args.output_len else None,
        max_model_len=args.max_model_len, ignore_eos=not args.no_ignore_eos, tokenizer_path=args.tokenizer,
        prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, num_turns=args.num_turns)
    concurrency, rate = args.concurrency, _rate(args.rate)
    sweep: tuple[float, ...] = ()
    if args.sweep:
        name, sep, values = args.sweep.partition("=")
        if not sep or name not in SWEEP_PARAMS:
            raise ValueError(f"--sweep: write concurrency=1,4,16 or rate=1,2,4, got {args.sweep!r}")
        if concurrency is not None or rate is not None:
            raise ValueError("--sweep sets the load itself: drop --concurrency/--rate")
        sweep = tuple(_rate_value(v) for v in values.split(","))
        if name == "concurrency":
            concurrency = int(sweep[0])
        else:
            rate = sweep[0]
    settings = {}
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--setting: write KEY=VALUE, got {item!r}")
        settings[key] = value
    num_requests = args.requests if args.requests is not None else (None if args.duration else 100)
    return BenchConfig(url=args.url, workload=workload, model=args.model, endpoint=args.endpoint,
                       num_requests=num_requests, duration_s=args.duration, concurrency=concurrency, rate=rate,
                       burstiness=args.burstiness, sweep=sweep, timeout_s=args.timeout, api_key=args.api_key,
                       admin_token=args.admin_token, metrics_interval_s=args.metrics_interval,
                       slo_ms=parse_slo(args.slo), settings=settings, temperature=args.temperature)


def _rate(text: str | None) -> float | None:
    return None if text is None else _rate_value(text)


def _rate_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise ValueError(f"--rate/--sweep: {text!r} is not a number of requests/s")
    return value


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        return _fail(str(e))
    from iterserve.bench.console import run_cli

    return run_cli(config, Path(args.out), plots=not args.no_plots, progress=not args.no_progress)


def run_compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from iterserve.bench.compare import render
    from iterserve.bench.result import load_result

    paths = [Path(p) / "results.json" if Path(p).is_dir() else Path(p) for p in (args.a, args.b)]
    try:
        a, b = (load_result(p) for p in paths)
    except ValueError as e:
        return _fail(str(e))
    render(a, b, args.name_a or str(paths[0]), args.name_b or str(paths[1]), Console(width=140))
    if args.plot:
        from iterserve.bench.plots import plot_sweep

        plot_sweep([(args.name_a or "A", a), (args.name_b or "B", b)], Path(args.plot))
        print(f"wrote {args.plot}")
    return 0
