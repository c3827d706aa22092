"""Build-on-first-use for the C++ CPU kernels of csrc/: one `CppExtension` per source file.

Each is JIT-built with `torch.utils.cpp_extension.load` (g++ and ninja, `-O3 -march=native`) on first
use, under ~/.cache/iterserve/torch_extensions/<torch version>/<CPU tag>/<name>; torch's file lock
serializes concurrent builds from several processes, and later processes only load the cached library.
When the build fails (no compiler, say), `available()` is False, the reason is logged once, and the
caller's torch path serves. An environment variable set to `torch` forces that path without building
anything: the A/B comparison against the kernel, and a kill switch. It is read on every call, so it can
be flipped in-process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("iterserve.kernels")

CSRC = Path(__file__).parent / "csrc"


def _cpu_tag() -> str:
    """-march=native code can crash on another CPU: a home directory shared by several machines must
    not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


class CppExtension:
    """One C++ source built into one torch extension module, at most once per process."""

    def __init__(self, name: str, source: str, env_var: str, what: str, extra_cflags: tuple[str, ...] = ()):
        """name: the extension module's name; source: a file of csrc/; env_var: its kill switch;
        what: how the warning names it when the build fails."""
        self.name = name
        self.source = CSRC / source
        self.env_var = env_var
        self.what = what
        self.extra_cflags = list(extra_cflags)
        self.module: ModuleType | None = None
        self.failed = False
        self._lock = threading.Lock()

    def _build(self) -> ModuleType:
        from torch.utils.cpp_extension import load

        # One directory per extension: torch writes a single build.ninja per directory, and ninja drops
        # the log entries of outputs its current build.ninja does not name, which would make two
        # extensions sharing a directory rebuild each other in turn.
        build_dir = (Path.home() / ".cache" / "iterserve" / "torch_extensions" / torch.__version__
                     / _cpu_tag() / self.name)
        build_dir.mkdir(parents=True, exist_ok=True)
        # -fopenmp: at::parallel_for runs on torch's OpenMP pool only when the including code is compiled
        # with OpenMP (the soname resolves to the libgomp torch already loaded); it also enables `omp simd`.
        flags = ["-O3", "-march=native", "-fopenmp", *self.extra_cflags]
        return load(name=self.name, sources=[str(self.source)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir))

    def available(self) -> bool:
        """Whether the kernel serves: not forced off by `env_var`=torch, and built/loaded.

        The first call builds (or loads the cached build), which takes a while; later calls are cheap.
        """
        if os.environ.get(self.env_var) == "torch":
            return False
        if self.module is not None or self.failed:
            return self.module is not None
        with self._lock:
            if self.module is None and not self.failed:
                try:
                    self.module = self._build()
                except Exception as e:  # any build or load failure leaves the torch path serving
                    self.failed = True
                    logger.warning("%s unavailable, using the torch path: %s", self.what, e)
        return self.module is not None
