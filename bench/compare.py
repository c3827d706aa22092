"""`iterserve bench compare A.json B.json`: two runs side by side with B/A ratios.

A comparison is only a measurement of one change when one thing changed: it is flagged when more
than one server setting differs (knobs, model, the user's declared settings such as the policy), and
when the workload or the load differs, since each of those moves every figure on its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from iterserve.bench.result import BenchResult

if TYPE_CHECKING:  # rich is imported where the table is drawn
    from rich.console import JustifyMethod

# (label, path into a run's summary or server figures, True when higher is better)
FIGURES = (
    ("requests/s", ("summary", "request_throughput"), True),
    ("output tokens/s", ("summary", "output_throughput"), True),
    ("goodput requests/s", ("summary", "goodput", "request_rate"), True),
    ("error rate", ("summary", "error_rate"), False),
    ("timeout rate", ("summary", "timeout_rate"), False),
    *((f"{name} {q} ms", ("summary", f"{key}_ms", q), False)
      for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
      for q in ("mean", "p50", "p90", "p99")),
    ("server queue p99 ms", ("server_metrics", "histograms", "queue", "p99_ms"), False),
    ("preemptions", ("server_metrics", "preemptions"), False),
    ("KV usage max", ("server_metrics", "kv_cache_usage", "max"), False),
)
LOAD_KEYS = ("endpoint", "num_requests", "duration_s", "concurrency", "rate", "burstiness", "sweep", "temperature")


def _dig(obj, path):
    for key in path:
        if not isinstance(obj, dict) or obj.get(key) is None:
            return None
        obj = obj[key]
    return obj


def differences(a: dict, b: dict) -> dict[str, tuple]:
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def warnings(a: BenchResult, b: BenchResult) -> list[str]:
    out = []
    settings = differences(a.server.get("settings", {}), b.server.get("settings", {}))
    if len(settings) > 1:
        out.append(f"{len(settings)} server settings differ ({', '.join(settings)}): this comparison "
                   "does not isolate one change")
    workload = differences(a.config.get("workload", {}), b.config.get("workload", {}))
    workload.pop("max_model_len", None)  # filled from the server: a consequence, not a choice
    if workload:
        out.append(f"the workloads differ ({', '.join(workload)})")
    load = differences({k: a.config.get(k) for k in LOAD_KEYS}, {k: b.config.get(k) for k in LOAD_KEYS})
    if load:
        out.append(f"the load differs ({', '.join(load)})")
    for name, result in (("A", a), ("B", b)):
        if result.interrupted:
            out.append(f"{name} was interrupted: its figures cover only part of the run")
    if len(a.runs) != len(b.runs):
        out.append(f"A has {len(a.runs)} load levels and B {len(b.runs)}: only the first "
                   f"{min(len(a.runs), len(b.runs))} are compared")
    return out


def ratio(va, vb) -> float | None:
    if va is None or vb is None or not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
        return None
    if va == 0:
        return None if vb == 0 else math.inf
    return vb / va


def rows(a: BenchResult, b: BenchResult) -> list[tuple[str, str, object, object, float | None, str]]:
    """(load level, figure, A, B, B/A, which is better) for every figure both runs have."""
    out = []
    for run_a, run_b in zip(a.runs, b.runs, strict=False):
        ja, jb = run_a.to_json(a.slo), run_b.to_json(b.slo)
        level = run_a.label if run_a.label == run_b.label else f"{run_a.label} | {run_b.label}"
        for label, path, higher_better in FIGURES:
            va, vb = _dig(ja, path), _dig(jb, path)
            if va is None and vb is None:
                continue
            r = ratio(va, vb)
            better = ""
            if r is not None and r != 1:
                better = "B" if (r > 1) == higher_better else "A"
            out.append((level, label, va, vb, r, better))
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def render(a: BenchResult, b: BenchResult, name_a: str, name_b: str, console) -> list[str]:
    """Print the comparison with rich; returns the warnings (also printed)."""
    from rich.table import Table

    settings = differences(a.server.get("settings", {}), b.server.get("settings", {}))
    table = Table(title=f"A = {name_a}    B = {name_b}")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("load", "left"), ("figure", "left"), ("A", "right"),
                                                     ("B", "right"), ("B/A", "right"), ("better", "center"))
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for level, label, va, vb, r, better in rows(a, b):
        table.add_row(level, label, _fmt(va), _fmt(vb), "-" if r is None else f"{r:.3f}", better)
    console.print(table)
    if settings:
        console.print("server settings that differ: " + "; ".join(
            f"{k}: {_fmt(va)} -> {_fmt(vb)}" for k, (va, vb) in settings.items()))
    else:
        console.print("server settings: identical")
    found = warnings(a, b)
    for w in found:
        console.print(f"[bold yellow]warning:[/] {w}")
    return found
