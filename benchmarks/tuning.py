"""SLO-driven live tuning against the best static configuration, side by side in one run (issue 7).

    python benchmarks/tuning.py [--rates 0.2,0.8,0.2] [--phase-s 40 | 40,20,40] [--grid-seqs 4,8,64]
                                [--grid-chunks 32,64,256] [--slo-ttft-ms MS --slo-itl-ms MS] [--quick]
                                [--repeats R] [--out benchmarks/results/tuning.json]   # ~23 minutes x R here

1. One `iterserve serve` (default model, `--threads 2`) at the default knobs (max_num_seqs 64,
   prefill_chunk_size 256, max_num_batched_tokens 512). SLOs scaled to this CPU: a few requests one
   at a time give the unloaded TTFT of a long prompt and the median inter-token gap; the p99 TTFT SLO
   is `--ttft-factor` times the first, the p99 ITL SLO `--itl-factor` times the second (or give both).
   The rates are scaled by the same measurement (`REFERENCE_ITL_MS` / the median gap; `--fixed-rates`
   turns that off), so a machine slowed down by its other users is not simply swamped.
2. Grid: every static (max_num_seqs, prefill_chunk_size) of the grid runs the step load (Poisson,
   low -> high -> low, one seed: the same requests at the same offsets every run); knobs are set by
   PATCH /admin/scheduler on the same server once it is idle (no restart between runs).
3. Tuned, in the middle of the grid (so a drift in the machine's speed favours neither side): the same
   load from the default knobs, with the operator's `Tuner` in auto mode ticking every `--tick-s` on the
   server's /metrics (`PodScraper`), bounds = the grid's range.
   With `--repeats R` the grid and the tuned run are played R times, interleaved (every other round
   backwards), and compared on their medians (benchmarks/tuning_report.py).
4. The table: goodput (requests meeting both SLOs per second of load; benchmarks/tuning_load.py says
   exactly how) and the share of windows within SLO, per configuration; the best static; the tuned run
   with its convergence and knob trajectory; the ratio and PASS/MISS against the targets (1.1x, 99%);
   and what switching among the grid's settings could reach on this load at all (each phase's best
   static run; the windows in which some static setting met the SLO), so a miss says whose it is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tuning_load import Phase, StepLoad, run_figures, send_load, share_within
from benchmarks.tuning_report import fold_repeats, json_safe, noise_check, print_table, row_text, setting, verdict
from benchmarks.tuning_runs import START_KNOBS, Server, calibrate, convergence_s, run_tuned
from iterserve.operator.tuning.policy import TuningPolicy

ROOT = Path(__file__).resolve().parents[1]
# the unloaded median inter-token gap of the default model on this 2-core machine when idle; --rates are
# the rates for that speed, scaled by REFERENCE_ITL_MS / the measured gap so a busier machine gets less load
REFERENCE_ITL_MS = 110.0
# --quick: a smoke test of the whole script in about two minutes (its figures mean little)
QUICK = dict(phase_s=[8.0], window_s=4.0, drain_s=10.0, grid_seqs=[4, 64], grid_chunks=[64, 256], tick_s=1.0,
             tuner_window_s=3.0)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--rates", type=floats, default=[0.2, 0.8, 0.2],
                    help="requests/s of each phase, in order, on an idle machine (see --fixed-rates)")
    ap.add_argument("--phase-s", type=floats, default=[40.0],
                    help="seconds each phase lasts: one figure for all, or one per phase in order")
    ap.add_argument("--output", type=ints, default=[16, 48], help="output tokens MIN,MAX (uniform, ignore_eos)")
    ap.add_argument("--long-output", type=ints, default=None,
                    help="long prompts' output tokens MIN,MAX (default: --output)")
    ap.add_argument("--long-prompt", type=ints, default=[280, 320], help="long prompts' tokens MIN,MAX")
    ap.add_argument("--short-prompt", type=ints, default=[20, 40], help="short prompts' tokens MIN,MAX")
    ap.add_argument("--long-share", type=float, default=0.5, help="share of the requests with a long prompt")
    ap.add_argument("--long-shares", type=floats, default=None,
                    help="the long-prompt share of each phase, in order (default: --long-share throughout)")
    ap.add_argument("--window-s", type=float, default=10.0, help="window of the within-SLO figure")
    ap.add_argument("--grid-seqs", type=ints, default=[4, 8, 64])
    ap.add_argument("--grid-chunks", type=ints, default=[32, 64, 256])
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="p99 TTFT SLO (default: calibrated)")
    ap.add_argument("--slo-itl-ms", type=float, default=None, help="p99 ITL SLO (default: calibrated)")
    ap.add_argument("--ttft-factor", type=float, default=3.0, help="TTFT SLO / unloaded TTFT of a long prompt")
    ap.add_argument("--itl-factor", type=float, default=5.0, help="ITL SLO / unloaded median inter-token gap")
    ap.add_argument("--fixed-rates", action="store_true",
                    help=f"send --rates as given (default: x {REFERENCE_ITL_MS:g} ms / the unloaded median ITL)")
    ap.add_argument("--tick-s", type=float, default=2.0, help="the tuner's interval")
    ap.add_argument("--tuner-window-s", type=float, default=12.0, help="the tuner's window (and cooldown)")
    ap.add_argument("--min-samples", type=int, default=3, help="first tokens a tuner window needs")
    ap.add_argument("--drain-s", type=float, default=20.0, help="after the load, requests get this long")
    ap.add_argument("--repeats", type=int, default=1,
                    help="play the grid and the tuned run this many times, interleaved, and compare medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: phases of 8 s, a 2x2 grid, short windows and drains (figures mean little)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tuning.json")
    if ap.parse_known_args(argv)[0].quick:  # shorter defaults; flags given explicitly still win
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    if len(args.phase_s) not in (1, len(args.rates)):
        ap.error(f"--phase-s: give one duration, or one per phase ({len(args.rates)} rates), got {len(args.phase_s)}")
    if args.long_shares is not None and len(args.long_shares) != len(args.rates):
        ap.error(f"--long-shares: give one share per phase ({len(args.rates)} rates), got {len(args.long_shares)}")
    if args.repeats < 1:
        ap.error(f"--repeats: must be at least 1, got {args.repeats}")
    return args


def make_policy(args, slo: dict[str, float]) -> TuningPolicy:
    return TuningPolicy(ttft_p99_ms=slo["ttft"], itl_p99_ms=slo["itl"], mode="auto",
                        max_num_seqs_bounds=(min(args.grid_seqs), max(args.grid_seqs)),
                        prefill_chunk_size_bounds=(min(args.grid_chunks), max(args.grid_chunks)),
                        interval_s=args.tick_s, window_s=args.tuner_window_s, min_samples=args.min_samples)


def round_ms(ms: float) -> float:
    """A calibrated SLO, rounded to tens of ms, or to 0.1 ms for a model so fast (a tiny one in the smoke
    test) that tens would round it to 0."""
    return round(ms, -1) if ms >= 100 else max(0.1, round(ms, 1))


def scale_to_cpu(args, cal: dict) -> tuple[dict[str, float], float]:
    """The SLOs (given, or factors of the unloaded figures) and the factor the rates are multiplied by."""
    slo = {"ttft": args.slo_ttft_ms or round_ms(args.ttft_factor * cal["long_ttft_ms"]),
           "itl": args.slo_itl_ms or round_ms(args.itl_factor * cal["itl_median_ms"])}
    speed = 1.0 if args.fixed_rates else REFERENCE_ITL_MS / cal["itl_median_ms"]
    return slo, speed


def after_convergence(figures: dict, start_s: float | None) -> float | None:
    if start_s is None:
        return None
    return share_within([w for w in figures["windows"] if w["start_s"] >= start_s])


def make_load(args, speed: float = 1.0) -> StepLoad:
    shares = args.long_shares or [None] * len(args.rates)
    durations = args.phase_s * len(args.rates) if len(args.phase_s) == 1 else args.phase_s
    phases = zip(args.rates, durations, shares, strict=True)  # main() refused lists of other lengths
    return StepLoad(tuple(Phase(round(r * speed, 3), d, share) for r, d, share in phases),
                    long_prompt=tuple(args.long_prompt), short_prompt=tuple(args.short_prompt),
                    long_share=args.long_share, output=tuple(args.output),
                    long_output=tuple(args.long_output) if args.long_output else None, seed=args.seed)


def tuned_run(server: Server, load: StepLoad, policy: TuningPolicy, args) -> dict:
    records, log = run_tuned(server, load, policy, START_KNOBS, args.drain_s)
    figures = run_figures(records, load, args.window_s, policy_slo(policy))
    trajectory = log.trajectory(START_KNOBS)
    conv = convergence_s(trajectory, args.window_s, load.duration_s, policy)
    figures.update(trajectory=trajectory, convergence_s=conv, ticks=log.ticks, tuner_errors=log.errors[:20],
                   windows_within_slo_after_convergence=after_convergence(figures, conv))
    print(f"tuned: {row_text(figures)}; converged at {conv} s; trajectory "
          + " -> ".join(f"{k['max_num_seqs']}/{k['prefill_chunk_size']}@{k['t_s']:.0f}s" for k in trajectory),
          flush=True)
    return figures


def policy_slo(policy: TuningPolicy) -> dict[str, float]:
    return {"ttft": policy.ttft_p99_ms, "itl": policy.itl_p99_ms}


def static_run(server: Server, load: StepLoad, seqs: int, chunk: int, args, slo: dict[str, float]) -> dict:
    server.set_knobs(START_KNOBS.replace(max_num_seqs=seqs, prefill_chunk_size=chunk))
    idle_s = server.wait_idle()
    figures = run_figures(send_load(server.url, load, args.drain_s), load, args.window_s, slo)
    print(f"static {seqs}/{chunk}: {row_text(figures)}", flush=True)
    return {"max_num_seqs": seqs, "prefill_chunk_size": chunk, "idle_wait_s": round(idle_s, 1), **figures}


def run_all(args) -> dict:
    engine_args = ["--threads", str(args.threads), "--max-model-len", str(args.max_model_len),
                   "--kv-cache-memory", args.kv_cache_memory, *(["--model", args.model] if args.model else [])]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    server = Server(engine_args, args.out.with_suffix(".server.log"))
    try:
        cal = calibrate(server, make_load(args))
        slo, speed = scale_to_cpu(args, cal)
        load = make_load(args, speed)
        policy = make_policy(args, slo)
        print(f"unloaded at the default knobs: long-prompt TTFT {cal['long_ttft_ms']:.0f} ms, median ITL "
              f"{cal['itl_median_ms']:.0f} ms; SLO p99 TTFT {slo['ttft']:g} ms, p99 ITL {slo['itl']:g} ms; rates x "
              f"{speed:.2f} -> {[p.rate for p in load.phases]} req/s for {[p.duration_s for p in load.phases]} s, "
              f"{len(load.schedule())} requests; server {server.url}, {args.threads} threads", flush=True)
        configs = [(s, c) for s in args.grid_seqs for c in args.grid_chunks]
        rounds = [play_round(server, load, policy, configs, args, slo, i) for i in range(args.repeats)]
    finally:
        server.stop()
    grid = [fold_repeats([next(g for g in r["grid"] if setting(g) == config) for r in rounds]) for config in configs]
    tuned = fold_repeats([r["tuned"] for r in rounds])
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "noise_check": noise_check(rounds[0]["tuned"], rounds[0]["grid"]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": args.threads},
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "load": load.describe(), "num_requests": len(load.schedule()), "slo_ms": slo, "calibration": cal,
            "rate_scale": speed,
            "policy": {k: str(v) if not isinstance(v, (int, float, str)) else v for k, v in vars(policy).items()},
            "tuned": tuned, "grid": grid, "verdict": verdict(tuned, grid, rounds, load.describe()["phases"]),
            "rounds": [{"order": r["order"]} for r in rounds] if len(rounds) > 1 else None,
            "elapsed_s": round(time.monotonic() - t_start, 1)}


def play_round(server: Server, load: StepLoad, policy: TuningPolicy, configs: list[tuple[int, int]], args,
               slo: dict[str, float], index: int) -> dict:
    """Every static setting and the tuned run once. The tuned run goes in the middle of the grid, and
    every other round plays the whole order backwards, so a machine whose speed drifts favours neither
    side and no setting always runs first or last."""
    half = len(configs) // 2
    order = [*configs[:half], "tuned", *configs[half:]]
    if index % 2:
        order.reverse()
    if args.repeats > 1:
        print(f"round {index + 1} of {args.repeats}", flush=True)
    grid, tuned = [], None
    for item in order:
        if item == "tuned":
            tuned = with_machine_state(tuned_run, server, load, policy, args)
        else:
            grid.append(with_machine_state(static_run, server, load, *item, args, slo))
    return {"grid": grid, "tuned": tuned, "order": [i if i == "tuned" else f"{i[0]}/{i[1]}" for i in order]}


def with_machine_state(run, server: Server, load: StepLoad, *args) -> dict:
    """`run(server, load, *args)` with what the machine was like around it: the unloaded median
    inter-token gap right before it (calibrate's figure, against which the SLO was set: the machine's
    speed drifts, by 15-20% between the two rounds of one run, and a fixed SLO moves with it)
    and the 1-minute load average before and after it (others share the cores)."""
    unloaded_itl_ms = calibrate(server, load)["itl_median_ms"]
    before = os.getloadavg()[0]
    figures = run(server, load, *args)
    return {**figures, "unloaded_itl_ms": round(unloaded_itl_ms, 2),
            "load_average": [round(before, 2), round(os.getloadavg()[0], 2)]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = run_all(args)
    print_table(result)
    args.out.write_text(json.dumps(json_safe(result), indent=1))
    print(f"\nwritten: {args.out} ({result['elapsed_s']:.0f} s in all)")
    return result


if __name__ == "__main__":
    # a `kill` must stop the server too: SystemExit runs the `finally` that terminates it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
