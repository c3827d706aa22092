"""The C++ CPU kernels as an image carries them: built ahead of time per -march level
(`python -m iterserve.kernels.prebuild`), loaded from ITERSERVE_CPU_KERNELS_DIR by a process that has no
compiler and builds nothing; and a server that says, in its log and in /metrics, when the slower torch
path stands in for a kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from iterserve.kernels import cpu_extension
from iterserve.kernels.cpu_extension import prebuilt_path, supported_marches
from tests.server_support import metric_value, start_subprocess

V3_FLAGS = {"sse4_2", "ssse3", "popcnt", "cx16", "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe",
            "xsave"}
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# what the loader reports, run where neither g++ nor ninja can be found and HOME is empty
LOAD = """
import logging, torch
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
from iterserve.kernels import cpu_layer_ops, cpu_paged_attention
from iterserve.server.model.llama import TorchLayerOps
print("available", cpu_paged_attention.available(), cpu_layer_ops.available())
if cpu_layer_ops.available():
    x = torch.randn(5, 256)
    torch.testing.assert_close(cpu_layer_ops.CpuLayerOps.silu_mul(x), TorchLayerOps.silu_mul(x))
    y = x.bfloat16()  # bf16 through the portable conversions (no avx512_bf16 at any -march level)
    torch.testing.assert_close(cpu_layer_ops.CpuLayerOps.silu_mul(y), TorchLayerOps.silu_mul(y.float()).bfloat16(),
                               atol=1e-6, rtol=2**-7)
    print("matches torch")
"""


@pytest.mark.parametrize("flags, machine, expected", [
    (V4_FLAGS | {"avx512_bf16"}, "x86_64", ["x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "x86-64-v2"]),
    (V4_FLAGS, "x86_64", ["x86-64-v4", "x86-64-v3", "x86-64-v2"]),
    (V3_FLAGS | {"avx512_bf16"}, "x86_64", ["x86-64-v3", "x86-64-v2"]),
    (V3_FLAGS, "x86_64", ["x86-64-v3", "x86-64-v2"]),
    (V4_FLAGS - {"avx512vl"}, "x86_64", ["x86-64-v3", "x86-64-v2"]),  # every flag of a level, or not it
    (set(), "x86_64", []),
    (V4_FLAGS, "aarch64", []),
])
def test_march_levels_are_those_the_cpu_runs_best_first(monkeypatch, flags, machine, expected):
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_extension.platform, "machine", lambda: machine)
    assert supported_marches() == expected


@pytest.mark.parametrize("march, flags", [
    ("x86-64-v4-bf16", ["-march=x86-64-v4", "-mavx512bf16"]),
    ("x86-64-v3", ["-march=x86-64-v3"]),
    ("native", ["-march=native"]),
])
def test_a_level_is_its_compiler_flags(march, flags):
    assert cpu_extension.march_flags(march) == flags


def run_without_compiler(tmp_path: Path, kernels_dir: Path) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**os.environ, "ITERSERVE_CPU_KERNELS_DIR": str(kernels_dir), "HOME": str(home), "PATH": "/nonexistent"}
    for var in ("ITERSERVE_CPU_ATTENTION", "ITERSERVE_CPU_LAYER_OPS", "CXX", "CC"):
        env.pop(var, None)
    result = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert not list(home.rglob("*.so"))  # nothing was built (without a compiler, nothing could be)
    return result


@pytest.mark.skipif(not supported_marches(), reason="prebuilt kernels target x86-64")
def test_prebuilt_kernels_load_without_a_compiler(tmp_path):
    march = supported_marches()[-1]  # the lowest level: what older CPUs load
    kernels = tmp_path / "kernels"
    # one kernel of the three (a build takes about a minute): the other shows the per-kernel fallback
    subprocess.run([sys.executable, "-m", "iterserve.kernels.prebuild", str(kernels), march,
                    "--kernels", "iterserve_cpu_layer_ops"], check=True, timeout=900)
    assert prebuilt_path(kernels, march, "iterserve_cpu_layer_ops").stat().st_size > 0
    assert not prebuilt_path(kernels, march, "iterserve_paged_decode_attention").exists()
    result = run_without_compiler(tmp_path, kernels)
    assert "available False True" in result.stdout and "matches torch" in result.stdout
    assert f"C++ CPU layer ops: prebuilt for {march}" in result.stderr
    assert "C++ CPU paged attention: nothing prebuilt" in result.stderr
    assert "C++ CPU paged attention unavailable, using the torch path" in result.stderr


def test_nothing_prebuilt_and_no_compiler_falls_back_to_torch_saying_so(tmp_path):
    result = run_without_compiler(tmp_path, tmp_path / "empty")
    assert "available False False" in result.stdout
    assert "nothing prebuilt" in result.stderr and "unavailable, using the torch path" in result.stderr


def test_server_exports_and_logs_a_kernel_the_torch_path_replaces(tiny_dir):
    proc, url = start_subprocess("--model", tiny_dir, "--kv-cache-memory", "8MiB", "--threads", "1",
                                 env={"ITERSERVE_CPU_LAYER_OPS": "torch"})
    try:
        metrics = httpx.get(url + "/metrics").text
        assert metric_value(metrics, "iterserve:cpu_kernels_available", kernel="layer_ops") == 0
        # the other kernel serves (built here, or found in the cache)
        assert metric_value(metrics, "iterserve:cpu_kernels_available", kernel="paged_attention") == 1
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    assert "C++ CPU kernels not serving: layer_ops" in log, log
