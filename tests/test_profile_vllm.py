"""benchmarks/profile_vllm.py's sorting of py-spy stacks (the vLLM run itself needs vLLM's venv)."""

import pytest

from benchmarks.profile_vllm import category, shares

ROOT = "worker_main (vllm/v1/executor/multiproc_executor.py:944);WorkerProc.worker_busy_loop (x.py:1)"


@pytest.mark.parametrize("leaf, expected", [
    ("onednn_mm (vllm/_custom_ops.py:3758);0x7f62b16c04d9 (?)", "GEMMs (oneDNN)"),  # JIT code, no symbol
    ("Runner.call (c.py:12);brgemm_matmul_t::compute_kernel (vllm/_C.so);0x7f62f1c1e02a (libgomp.so.1)",
     "GEMMs (oneDNN)"),
    ("Runner.call (c.py:12);0x7f62f1c1e02a (libgomp.so.1)", "OpenMP barriers outside a GEMM"),
    ("Runner.call (c.py:12);cpu_attention::AttentionMainLoop (vllm/_C.so)", "attention (cpu_attention, KV write)"),
    ("Runner.call (c.py:12);kernel_py (k.main.c)", "inductor's fused kernels"),
    ("Sampler.forward (vllm/v1/sample/sampler.py:97)", "sampling"),
    ("MessageQueue.dequeue (vllm/distributed/device_communicators/shm_broadcast.py:984);sched_yield (libc.so.6)",
     "IPC (shared-memory queue, ZeroMQ, pipes)"),
    ("GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:4241)", "Python and the rest"),
])
def test_category(leaf, expected):
    assert category(f"{ROOT};{leaf}") == expected


def test_shares_counts_only_the_stacks_through_the_given_frame():
    raw = [f"{ROOT};a (?) 3\n", f"{ROOT};Sampler.forward (s.py:1) 1\n",
           "thread_main (t.py:1);Condition.wait (t.py:2) 6\n"]
    assert shares(raw, "worker_busy_loop") == (4, [("GEMMs (oneDNN)", 0.75), ("sampling", 0.25)])
    assert shares(raw)[0] == 10
