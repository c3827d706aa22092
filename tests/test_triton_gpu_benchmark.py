"""benchmarks/gpu.py runs end to end in its --smoke mode (toy sizes, CPU, Triton interpreter), so the
script a GPU session runs in one call is known to work before any GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_smoke_run_fills_every_section(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    failed = {k: v["error"][-500:] for k, v in results.items() if isinstance(v, dict) and "error" in v}
    assert not failed, failed
    assert results["kernel_check"]["all_ok"]
    assert results["decode"][0]["max_abs_diff_vs_sdpa"] < 1e-4
    assert results["batch1"]["static_buffers_tok_per_s"] > 0 and results["batch1"]["eager_tok_per_s"] > 0
    for policy in ("throughput", "static"):
        assert results[policy]["generated_tokens"] > 0 and not results[policy]["truncated"]
    assert results["continuous_over_static"] > 0
    assert "results:" in r.stdout  # the printed table


def test_gpu_profile_smoke_run_times_each_part_and_profiles(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_profile.py"), "--smoke", "--out", str(tmp_path),
                        "--steps", "4", "--profile-steps", "2"], capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_profile.json").read_text())
    steps = result["with_prefill"]  # the first steps carry the prompts
    assert steps["steps"] == 4 and steps["runner_ms"] > 0 and steps["schedule_ms"] > 0
    assert abs(steps["schedule_ms"] + steps["runner_ms"] + steps["update_ms"] - steps["step_ms"]) < 1.0
    assert result["profile"]["steps"] == 2 and result["profile"]["top_host_ops"]
    assert (tmp_path / "gpu_profile_trace.json.gz").stat().st_size > 0
