"""The tuning benchmark's verdict and table: repeats folded into medians, the best static setting, the
ratio against the targets, and the printed side-by-side table (pure functions of the runs' figures).

With `--repeats R` every setting and the tuned run are played R times, interleaved (see
benchmarks/tuning.py), and compared on their medians: on a shared 2-core machine two runs of one
setting can differ by a quarter of their good requests, so a single run cannot resolve the 10% the
target asks for. Each round also gives its own tuned / best-static ratio, whose spread is printed.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.tuning_load import num_good_before, share_decided
from benchmarks.tuning_runs import START_KNOBS

GOODPUT_TARGET = 1.1
WINDOWS_TARGET = 0.99
# a run whose unloaded median gap lies further than this from the calibration's ran on a machine whose
# speed moved enough to make a fixed SLO clearly harder (or easier) to meet
DRIFT = 0.1
# the figures a setting's repeats are summarised by (their medians)
MEDIAN_KEYS = ("num_good", "goodput_rps", "windows_within_slo", "ttft_p99_ms", "itl_p99_ms",
               "windows_within_slo_after_convergence", "convergence_s")


def median_or_none(values: list) -> float | None:
    """Median of the known values; None when fewer than half of them are known (e.g. a tuner that did not
    converge in most rounds has no convergence time)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and 2 * len(known) >= len(values) else None


def fold_repeats(runs: list[dict]) -> dict:
    """One setting's runs as one row: a single run as it is; several as the medians of MEDIAN_KEYS, the
    first run's identity (knobs, request count, trajectory), the load average over all of them, and every
    run under `repeats`."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    out = {k: v for k, v in first.items() if k not in ("requests", "windows", "ticks")}
    for key in MEDIAN_KEYS:
        if key in first:
            out[key] = median_or_none([r[key] for r in runs])
    out["load_average"] = [first["load_average"][0], runs[-1]["load_average"][1]]
    out["repeats"] = runs
    return out


def setting(run: dict) -> tuple[int, int]:
    return run["max_num_seqs"], run["prefill_chunk_size"]


def best_static(grid: list[dict]) -> dict:
    """Highest goodput; ties go to the larger share of windows within SLO."""
    return max(grid, key=lambda g: (g["goodput_rps"], g["windows_within_slo"] or 0.0))


def round_ratios(rounds: list[dict], best: tuple[int, int]) -> list[float]:
    """Per round, the tuned run's good requests over those of the best static setting's run of that round:
    runs of one round are minutes apart, so these pair off most of the machine's drift."""
    out = []
    for r in rounds:
        static = next(g for g in r["grid"] if setting(g) == best)
        out.append(r["tuned"]["num_good"] / static["num_good"] if static["num_good"] else math.inf)
    return out


def phase_spans(phases: list[dict]) -> list[tuple[float, float]]:
    """[start, end) of each phase of a load's description."""
    spans, start = [], 0.0
    for phase in phases:
        spans.append((start, start + phase["duration_s"]))
        start += phase["duration_s"]
    return spans


def attainable(rnd: dict, best: tuple[int, int], spans: list[tuple[float, float]]) -> dict:
    """What switching among the grid's settings could reach in one round, read off its static runs: the
    most good requests any setting got in each phase, summed, over the best static setting's good requests
    (a tuner that switched to each phase's best setting the instant the phase began, for free); and the
    share of windows in which some static setting met the SLO, over all windows and over those after the
    round's tuned run converged. A target above these cannot be met by turning these knobs on this load:
    the gap is the load's and the machine's, not the tuner's."""
    grid = rnd["grid"]
    per_phase = sum(max(sum(q["good"] for q in run["requests"] if lo <= q["start_s"] < hi) for run in grid)
                    for lo, hi in spans)
    static = next(run["num_good"] for run in grid if setting(run) == best)
    some_met = [any(run["windows"][i]["within_slo"] for run in grid)
                if any(run["windows"][i]["within_slo"] is not None for run in grid) else None
                for i in range(len(grid[0]["windows"]))]
    conv = rnd["tuned"].get("convergence_s")
    after = [m for m, w in zip(some_met, grid[0]["windows"], strict=True) if conv is not None and w["start_s"] >= conv]
    return {"goodput_ratio": per_phase / static if static else math.inf, "num_good": per_phase,
            "windows": share_decided(some_met), "windows_after_convergence": share_decided(after)}


def verdict(tuned: dict, grid: list[dict], rounds: list[dict] | None = None,
            phases: list[dict] | None = None) -> dict:
    best = best_static(grid)
    ratio = tuned["goodput_rps"] / best["goodput_rps"] if best["goodput_rps"] > 0 else math.inf
    after = tuned["windows_within_slo_after_convergence"]
    out = {"best_static": {"max_num_seqs": best["max_num_seqs"], "prefill_chunk_size": best["prefill_chunk_size"]},
           "goodput_ratio": ratio, "goodput_pass": ratio >= GOODPUT_TARGET,
           "windows_after_convergence": after, "windows_pass": after is not None and after >= WINDOWS_TARGET}
    if rounds and len(rounds) > 1:
        out["goodput_ratio_per_round"] = round_ratios(rounds, setting(best))
    if rounds and phases:
        per_round = [attainable(r, setting(best), phase_spans(phases)) for r in rounds]
        out["attainable"] = {key: median_or_none([a[key] for a in per_round]) for key in per_round[0]}
        out["attainable"]["per_round"] = per_round
    return out


def noise_check(tuned: dict, grid: list[dict]) -> dict | None:
    """Until the tuner's first change the tuned run ran the default knobs, as the static run of the
    default knobs did all along: their good requests among those that arrived by then differ by noise
    alone (the machine's speed from one run to the next). None when the grid lacks the default or the
    tuner moved at once."""
    until = next((k["t_s"] for k in tuned["trajectory"][1:]), None)
    default = next((g for g in grid if setting(g) == (START_KNOBS.max_num_seqs, START_KNOBS.prefill_chunk_size)),
                   None)
    if not until or default is None:
        return None
    (tuned_good, n), (static_good, _) = num_good_before(tuned, until), num_good_before(default, until)
    return {"until_s": until, "num_requests": n, "tuned_good": tuned_good, "static_default_good": static_good}


def row_text(f: dict) -> str:
    w = f["windows_within_slo"]
    return (f"goodput {f['goodput_rps']:.3f} req/s ({f['num_good']}/{f['num_requests']} good), "
            f"windows within SLO {'n/a' if w is None else f'{w:.0%}'}, p99 TTFT {f['ttft_p99_ms']} ms, "
            f"p99 ITL {f['itl_p99_ms']} ms")


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def ms(x: float | None) -> str:
    return "n/a" if x is None else "inf" if math.isinf(x) else f"{x:.0f}"


def spread(f: dict, key: str, fmt) -> str:
    """`median (min-max)` over a folded row's repeats; the plain figure for a single run."""
    runs = f.get("repeats")
    if not runs:
        return fmt(f[key])
    known = [r[key] for r in runs if r[key] is not None]
    return f"{fmt(f[key])} ({fmt(min(known))}-{fmt(max(known))})" if known else fmt(None)


def print_table(result: dict) -> None:
    grid, tuned, v = result["grid"], result["tuned"], result["verdict"]
    best = best_static(grid)
    repeats = len(result.get("rounds") or [None])
    what = "medians (min-max) of " + f"{repeats} interleaved runs each" if repeats > 1 else "one run each"
    print(f"\n{what}")
    print(f"{'configuration (max_num_seqs/chunk)':<36} {'good/sent':>16} {'windows in SLO':>16} "
          f"{'p99 TTFT ms':>11} {'p99 ITL ms':>10} {'load avg':>10}")
    rows = [(f"static {g['max_num_seqs']}/{g['prefill_chunk_size']}" + (" (best static)" if g is best else ""), g)
            for g in grid] + [(f"tuned from {START_KNOBS.max_num_seqs}/{START_KNOBS.prefill_chunk_size}", tuned)]
    for name, f in rows:
        good = spread(f, "num_good", lambda x: f"{x:g}") + f"/{f['num_requests']}"
        print(f"{name:<36} {good:>16} {spread(f, 'windows_within_slo', pct):>16} {ms(f['ttft_p99_ms']):>11} "
              f"{ms(f['itl_p99_ms']):>10} {'/'.join(f'{x:.1f}' for x in f['load_average']):>10}")
    for i, run in enumerate(tuned.get("repeats") or [tuned]):
        print(f"tuned trajectory{f' (run {i + 1})' if repeats > 1 else ''} (max_num_seqs/chunk from t): " + ", ".join(
            f"{k['max_num_seqs']}/{k['prefill_chunk_size']} from {k['t_s']:.0f} s" for k in run["trajectory"]))
    conv = tuned["convergence_s"]
    print(f"\nSLO p99 TTFT {result['slo_ms']['ttft']:g} ms, p99 ITL {result['slo_ms']['itl']:g} ms; windows of "
          f"{result['args']['window_s']:g} s; tuner converged at {'never' if conv is None else f'{conv:g} s'}"
          f"{' (median)' if repeats > 1 else ''}")
    check = result["noise_check"]
    if check:
        print(f"noise check: until its first change ({check['until_s']:g} s) the tuned run had the default knobs; of "
              f"the {check['num_requests']} requests sent by then {check['tuned_good']} were good there, "
              f"{check['static_default_good']} in the static {START_KNOBS.max_num_seqs}/"
              f"{START_KNOBS.prefill_chunk_size} run (the same requests and knobs)")
    speed, drifted = machine_speed(result)
    print(speed)
    if drifted:
        print(f"the machine's speed moved more than {DRIFT:.0%} from the calibration before: {', '.join(drifted)} "
              f"(the SLO is fixed when the load starts: a slower machine meets it less, a faster one more)")
    per_round = v.get("goodput_ratio_per_round")
    if per_round:
        print("tuned / best static good requests, round by round: " + ", ".join(f"{x:.2f}x" for x in per_round))
    reach = v.get("attainable")
    if reach:
        print(f"attainable by switching among the grid's settings (each phase's best static run, from the phase's "
              f"first request): {reach['goodput_ratio']:.2f}x the best static ("
              + ", ".join(f"{a['goodput_ratio']:.2f}x" for a in reach["per_round"]) + " round by round); windows "
              f"in which some static setting met the SLO: {pct(reach['windows_after_convergence'])} after "
              f"convergence, {pct(reach['windows'])} in all")
    print(f"tuned / best static goodput: {v['goodput_ratio']:.2f}x (target >= {GOODPUT_TARGET}x) "
          f"{'PASS' if v['goodput_pass'] else 'MISS'}")
    print(f"windows within SLO after convergence: {pct(v['windows_after_convergence'])} "
          f"(target >= {WINDOWS_TARGET:.0%}) {'PASS' if v['windows_pass'] else 'MISS'}")


def machine_speed(result: dict) -> tuple[str, list[str]]:
    """The unloaded median inter-token gap measured right before each run, as a line of text, and the runs
    (by name, with how much slower or faster) where it lay more than DRIFT from the calibration's. Runs
    from before this was measured have none and are left out."""
    calibrated = result["calibration"]["itl_median_ms"]
    rows = [(f"{g['max_num_seqs']}/{g['prefill_chunk_size']}", g) for g in result["grid"]]
    rows.append(("tuned", result["tuned"]))
    parts, drifted = [], []
    for name, row in rows:
        runs = [r for r in row.get("repeats") or [row] if r.get("unloaded_itl_ms") is not None]
        for i, r in enumerate(runs):
            off = r["unloaded_itl_ms"] / calibrated - 1  # a longer gap: a slower machine
            if abs(off) > DRIFT:
                run = f"run {i + 1}, " if len(runs) > 1 else ""
                drifted.append(f"{name} ({run}{abs(off):.0%} {'slower' if off > 0 else 'faster'})")
        if runs:
            parts.append(f"{name} " + "/".join(f"{r['unloaded_itl_ms']:.0f}" for r in runs))
    text = f"unloaded median gap before each run, ms (calibration {calibrated:.0f}): " + ", ".join(parts)
    return text, drifted


def json_safe(x):
    """JSON has no infinity: a request that never got a first token has an infinite TTFT, written "inf"."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
