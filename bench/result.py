"""What a benchmark produces: one `RunResult` per load level, in a `BenchResult` that is saved as JSON.

The JSON holds the full configuration, the server's settings, every figure and every raw per-request
record, so figures can be recomputed and two runs compared later (`compare.py`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.bench.client import RequestRecord
from iterserve.bench.report import summarize

FORMAT_VERSION = 1


@dataclass
class RunResult:
    """One load level: `load` is {"concurrency": C} or {"rate": R, "burstiness": B}."""

    label: str
    load: dict
    records: list[RequestRecord] = field(default_factory=list)
    server: dict | None = None  # summarize_scrapes(...) or None without /metrics
    interrupted: bool = False

    def summary(self, slo: dict[str, float] | None) -> dict:
        return summarize(self.records, slo)

    def to_json(self, slo: dict[str, float] | None) -> dict:
        return {"label": self.label, "load": self.load, "interrupted": self.interrupted,
                "summary": self.summary(slo), "server_metrics": self.server,
                "records": [r.to_json() for r in self.records]}

    @classmethod
    def from_json(cls, d: dict) -> RunResult:
        return cls(label=d["label"], load=d["load"], interrupted=d.get("interrupted", False),
                   server=d.get("server_metrics"), records=[RequestRecord.from_json(r) for r in d["records"]])


@dataclass
class BenchResult:
    config: dict
    server: dict = field(default_factory=dict)  # url, model, settings, features, metrics availability
    runs: list[RunResult] = field(default_factory=list)
    started_at: str = ""
    interrupted: bool = False
    problems: list[str] = field(default_factory=list)  # what went wrong but did not stop the run

    @property
    def slo(self) -> dict[str, float]:
        return self.config.get("slo_ms") or {}

    def to_json(self) -> dict:
        return {"format_version": FORMAT_VERSION, "started_at": self.started_at, "interrupted": self.interrupted,
                "problems": self.problems, "config": self.config, "server": self.server,
                "runs": [run.to_json(self.slo) for run in self.runs]}

    @classmethod
    def from_json(cls, d: dict) -> BenchResult:
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"not an iterserve bench result (format_version {d.get('format_version')!r})")
        return cls(config=d["config"], server=d.get("server", {}), started_at=d.get("started_at", ""),
                   interrupted=d.get("interrupted", False), problems=d.get("problems", []),
                   runs=[RunResult.from_json(r) for r in d["runs"]])

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write results.json atomically (a Ctrl-C during the write leaves the old file, not half a file)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "results.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1, allow_nan=False))
        os.replace(tmp, path)
        return path


def load_result(path: str | os.PathLike) -> BenchResult:
    try:
        return BenchResult.from_json(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: cannot read a bench result: {e}") from None
