"""Build-on-first-use for the C++ CPU kernels of csrc/: one `CppExtension` per source file.

Each is JIT-built with `torch.utils.cpp_extension.load` (g++ and ninja, `-O3 -march=native`) on first
use, under $XDG_CACHE_HOME/iterserve/torch_extensions/<torch version>/<CPU tag>/<name>-<sources hash>
(XDG_CACHE_HOME defaults to ~/.cache); torch's file lock serializes concurrent builds from several
processes, and later processes only load the cached library.
When the build fails (no compiler, say), `available()` is False, the reason is logged once, and the
caller's torch path serves. An environment variable set to `torch` forces that path without building
anything: the A/B comparison against the kernel, and a kill switch. It is read on every call, so it can
be flipped in-process.

An image carries them prebuilt instead (it has no compiler, and its root filesystem is read-only): set
ITERSERVE_CPU_KERNELS_DIR to a directory that `python -m iterserve.kernels.prebuild DIR` filled at image
build time, one build per torch version and x86-64 microarchitecture level (`-march=x86-64-v3` for AVX2,
`-v4` for AVX-512, and `x86-64-v4-bf16`: -v4 with AVX512-BF16's dot products, which the prefill
attention kernel multiplies bf16 with where the CPU has them). A process loads the best level this CPU
runs and builds nothing; when none fits, it falls back to building (and, without a compiler, to the
torch path, saying so).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("iterserve.kernels")

CSRC = Path(__file__).parent / "csrc"


PREBUILT_ENV = "ITERSERVE_CPU_KERNELS_DIR"
# x86-64 microarchitecture levels a prebuilt kernel may target, best first, with the CPU flags each needs
# (/proc/cpuinfo's names; `abm` is lzcnt). The kernels' own #ifdefs pick AVX-512 or AVX2 code from them.
_V2 = {"sse4_2", "ssse3", "popcnt", "cx16"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
MARCH_LEVELS = (("x86-64-v4-bf16", _V4 | {"avx512_bf16"}), ("x86-64-v4", _V4), ("x86-64-v3", _V3),
               ("x86-64-v2", _V2))
# levels that are not one of GCC's -march values: the level they extend and the flags they add
_MARCH_EXTENSIONS = {"x86-64-v4-bf16": ("x86-64-v4", ("-mavx512bf16",))}


def march_flags(march: str) -> list[str]:
    """The compiler flags of a level (or of `native`)."""
    base, extra = _MARCH_EXTENSIONS.get(march, (march, ()))
    return [f"-march={base}", *extra]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as /proc/cpuinfo names them (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").partition(":")[2].split())
    except OSError:
        return frozenset()


def supported_marches() -> list[str]:
    """The -march levels this CPU runs, best first (none off x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_flags()
    return [march for march, needs in MARCH_LEVELS if needs <= flags]


def prebuilt_path(root: Path, march: str, name: str) -> Path:
    return Path(root) / torch.__version__ / march / f"{name}.so"


def _import_library(name: str, path: Path) -> ModuleType:
    """What torch.utils.cpp_extension.load does once its build is done: import the .so as module `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_root() -> Path:
    """Where iterserve keeps what it builds: $XDG_CACHE_HOME/iterserve, as pip and torch hub read it, or
    ~/.cache/iterserve."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iterserve"


def _cpu_tag() -> str:
    """-march=native code can crash on another CPU: a home directory shared by several machines must
    not hand one machine's build to another."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:12]


def _sources_tag() -> str:
    """A hash of every file of csrc/ (the sources include each other's headers) and of where they are: the
    build.ninja torch writes names the sources' paths, so two checkouts of one version sharing a directory
    would rebuild it in turn."""
    digest = hashlib.sha1(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


# A build takes about a minute here; a lock this old was left by a process killed while it held it.
STALE_LOCK_SECONDS = 600


def _clear_stale_lock(lock: Path) -> None:
    """torch's build lock is a file that a killed builder leaves behind, and every later process then waits
    on it forever (a server that never starts). Remove one older than any build."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_SECONDS:
        logger.warning("removing a stale build lock (%.0f s old, its builder is gone): %s", age, lock)
        lock.unlink(missing_ok=True)


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

    def compile(self, build_dir: Path, march: str = "native") -> ModuleType:
        """Build (or, when nothing changed, load) the extension in build_dir for the level `march`."""
        from torch.utils.cpp_extension import load

        build_dir.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(build_dir / "lock")
        # -fopenmp: at::parallel_for runs on torch's OpenMP pool only when the including code is compiled
        # with OpenMP (the soname resolves to the libgomp torch already loaded); it also enables `omp simd`.
        flags = ["-O3", *march_flags(march), "-fopenmp", *self.extra_cflags]
        return load(name=self.name, sources=[str(self.source)], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir))

    def _prebuilt(self) -> ModuleType | None:
        """The best prebuilt library under $ITERSERVE_CPU_KERNELS_DIR this CPU runs, imported; None when
        the variable is unset or nothing there fits this torch and CPU (logged: the build comes next)."""
        root = os.environ.get(PREBUILT_ENV)
        if not root:
            return None
        for march in supported_marches():
            path = prebuilt_path(Path(root), march, self.name)
            if path.exists():
                module = _import_library(self.name, path)
                logger.info("%s: prebuilt for %s (%s)", self.what, march, path)
                return module
        logger.warning("%s: nothing prebuilt in %s=%s for torch %s on this CPU (%s); building it", self.what,
                       PREBUILT_ENV, root, torch.__version__, ", ".join(supported_marches()) or platform.machine())
        return None

    def _build(self) -> ModuleType:
        if (module := self._prebuilt()) is not None:
            return module
        # One directory per extension: torch writes a single build.ninja per directory, and ninja drops
        # the log entries of outputs its current build.ninja does not name, which would make two
        # extensions sharing a directory rebuild each other in turn. And one per version of the sources:
        # checkouts of different versions (worktrees, CI next to a developer) would otherwise rebuild
        # over each other, and a process waiting on the build lock would load the other's library.
        return self.compile(cache_root() / "torch_extensions" / torch.__version__ / _cpu_tag()
                            / f"{self.name}-{_sources_tag()}")

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

    def loaded(self) -> ModuleType:
        """The built module, for callers that checked available() first."""
        assert self.module is not None, f"{self.name} used before available() said it serves"
        return self.module
