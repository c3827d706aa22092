"""PNG plots of a bench result: latency CDFs, TTFT/ITL over time with the server's KV usage, and
throughput against p99 latency across the load levels of a sweep (or of several results)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from iterserve.bench import report  # noqa: E402
from iterserve.bench.result import BenchResult, RunResult  # noqa: E402

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "end-to-end latency"))
MAX_TIMELINE_ROWS = 8


def _latencies_ms(run: RunResult, metric: str) -> np.ndarray:
    ok = [r for r in run.records if r.ok]
    if metric == "itl":
        values = [g for r in ok for g in report.itls(r)]
    else:
        fn = getattr(report, metric)
        values = [v for r in ok if (v := fn(r)) is not None]
    return np.sort(np.asarray(values, dtype=float) * 1000.0)


def plot_latency_cdfs(result: BenchResult, path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (metric, title) in zip(axes.flat, METRICS, strict=True):
        for run in result.runs:
            ms = _latencies_ms(run, metric)
            if ms.size:
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=run.label)
        if metric in result.slo:
            ax.axvline(result.slo[metric], color="red", linestyle="--", linewidth=1, label=f"SLO {metric}")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if metric != "itl" else "fraction of gaps",
               ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(_title(result))
    return _save(fig, path)


def plot_timeline(result: BenchResult, path: Path) -> Path:
    runs = result.runs[:MAX_TIMELINE_ROWS]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        ok = [r for r in run.records if r.ok]
        itl_t = [b for r in ok for b in r.chunk_times[1:]]
        itl_ms = [1000 * g for r in ok for g in report.itls(r)]
        ax.scatter(itl_t, itl_ms, s=3, alpha=0.35, label="ITL (at token arrival)")
        ax.scatter([r.start for r in ok if r.first_token is not None],
                   [1000 * ttft_s for r in ok if (ttft_s := report.ttft(r)) is not None], s=14, marker="x",
                   color="black", label="TTFT (at request start)")
        ax.set(ylabel="ms", title=run.label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        series = (run.server or {}).get("series", {}).get("vllm:kv_cache_usage_perc")
        if series:
            kv = ax.twinx()
            t, v = zip(*series, strict=True)
            kv.plot(t, [100 * x for x in v], color="tab:green", linewidth=1.2, label="KV cache usage")
            kv.set(ylabel="KV usage %", ylim=(0, 105))
            kv.legend(loc="upper right", fontsize=8)
        ax.legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the run started")
    fig.suptitle(_title(result))
    return _save(fig, path)


def plot_sweep(results: list[tuple[str, BenchResult]], path: Path) -> Path:
    """Output throughput against p99 TTFT, ITL and end-to-end latency, one line per result."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for name, result in results:
        summaries = [(run.label, run.summary(result.slo)) for run in result.runs]
        x = [s["output_throughput"] for _, s in summaries]
        for ax, key in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), strict=True):
            y = [s[key]["p99"] if s[key]["p99"] is not None else np.nan for _, s in summaries]
            ax.plot(x, y, marker="o", label=name)
            for (label, _), xi, yi in zip(summaries, x, y, strict=True):
                ax.annotate(label.split("=")[-1], (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, title in zip(axes, ("p99 TTFT", "p99 ITL", "p99 end-to-end"), strict=True):
        ax.set(xlabel="output tokens/s", ylabel="ms", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("throughput vs p99 latency (points labelled with the load level)")
    return _save(fig, path)


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    paths = [plot_latency_cdfs(result, out_dir / "latency_cdf.png"), plot_timeline(result, out_dir / "timeline.png")]
    if len(result.runs) > 1:
        paths.append(plot_sweep([(result.server.get("model", "run"), result)], out_dir / "sweep.png"))
    return paths


def _title(result: BenchResult) -> str:
    workload = result.config.get("workload", {}).get("shape", "?")
    return f"{result.server.get('model', '?')} at {result.server.get('url', '?')} — workload {workload}"


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
