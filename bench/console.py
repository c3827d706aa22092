"""The command-line run: a live progress bar, Ctrl-C that keeps what was measured, the results JSON,
the plots and a summary table.

Whatever happens once load has started (Ctrl-C, a server that dies, a bug here), results.json is
written with every record collected so far; a failure before any load (unreachable server, refused
request) is one line on stderr and nothing is written.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import traceback
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichBar
from rich.table import Table

from iterserve.bench.client import BenchError, RequestRecord
from iterserve.bench.load import BenchConfig, Progress, arun_bench
from iterserve.bench.result import BenchResult


class BarProgress(Progress):
    def __init__(self, console: Console):
        self.bar = RichBar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TextColumn("{task.fields[errors]} failed"), console=console,
                           transient=False)
        self.task: TaskID | None = None
        self.errors = 0

    def start_run(self, label: str, total: int | None) -> None:
        if self.task is None:
            self.bar.start()  # only once load begins: an early error stays a single line
        else:
            self.bar.stop_task(self.task)
        self.errors = 0
        self.task = self.bar.add_task(label, total=total, errors=0)

    def finish_request(self, record: RequestRecord) -> None:
        self.errors += not record.ok
        assert self.task is not None  # requests finish only in a run start_run began
        self.bar.update(self.task, advance=1, errors=self.errors)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


def run_cli(config: BenchConfig, out_dir: Path, *, plots: bool = True, progress: bool = True) -> int:
    err = Console(stderr=True)
    result = BenchResult(config=config.describe())
    stop = threading.Event()
    bar = BarProgress(err) if progress else Progress()
    status = 0

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C quits at once
            err.print("interrupted: cancelling the requests in flight and writing what was measured")

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        await arun_bench(config, stop, bar, result)

    try:
        try:
            asyncio.run(main())
        finally:
            if isinstance(bar, BarProgress):
                bar.close()
    except BenchError as e:
        print(f"iterserve bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        result.interrupted = True
    except Exception as e:  # noqa: BLE001 - keep the measurements whatever broke
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "error.log").write_text(traceback.format_exc())
        print(f"iterserve bench: error: {type(e).__name__}: {e} (traceback in {out_dir / 'error.log'})",
              file=sys.stderr)
        result.interrupted, status = True, 1
    if stop.is_set():
        result.interrupted = True
    if not result.runs:
        return status or 130
    path = result.save(out_dir)
    print_summary(result, Console() if sys.stdout.isatty() else Console(width=160))
    print(f"results: {path}")
    if plots:
        _write_plots(result, out_dir)
    if result.interrupted:
        return status or 130
    if not any(r.ok for run in result.runs for r in run.records):
        print("iterserve bench: error: no request succeeded (see top_errors in the results)", file=sys.stderr)
        return 1
    return status


def _write_plots(result: BenchResult, out_dir: Path) -> None:
    from iterserve.bench.plots import write_plots

    try:
        for p in write_plots(result, out_dir):
            print(f"plot: {p}")
    except Exception as e:  # noqa: BLE001 - a plot must not cost the results already written
        print(f"iterserve bench: warning: plots not written: {type(e).__name__}: {e}", file=sys.stderr)


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_summary(result: BenchResult, console: Console) -> None:
    table = Table(title=f"{result.server.get('model', '?')} at {result.server.get('url', '?')}")
    columns = ["load", "done/sent", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
               "E2E p50/p99 ms"]
    if result.slo:
        columns.append("goodput req/s")
    for col in columns:
        table.add_column(col, justify="left" if col == "load" else "right")
    for run in result.runs:
        s = run.summary(result.slo)
        row = [run.label + (" (interrupted)" if run.interrupted else ""), f"{s['num_completed']}/{s['num_requests']}",
               _f(s["request_throughput"], 2), _f(s["output_throughput"])]
        row += [f"{_f(s[k]['p50'])} / {_f(s[k]['p99'])}" for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")]
        if result.slo:
            row.append(_f(s["goodput"]["request_rate"], 2))
        table.add_row(*row)
    console.print(table)
    for run in result.runs:
        s = run.summary(result.slo)
        if s["top_errors"]:
            console.print(f"[yellow]{run.label}: {s['num_failed']} failed[/]; most common: {s['top_errors'][0][0]}")
    for problem in result.problems:
        console.print(f"[yellow]note:[/] {problem}")
