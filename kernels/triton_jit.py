"""`lazy_jit`: a Triton kernel decorated on its first launch instead of at import.

`triton.jit` decides at decoration time whether a kernel runs compiled or under the interpreter
(`TRITON_INTERPRET=1`, which the CPU tests use). Decorating lazily makes the kernel modules safe to
import in any order: the choice follows the environment as it is when a kernel first runs.
"""

from __future__ import annotations


class LazyJit:
    def __init__(self, fn):
        self.fn = fn
        self.jitted = None

    def jit(self):
        if self.jitted is None:
            import triton

            self.jitted = triton.jit(self.fn)
            # A kernel resolves the functions it calls through its module's globals at compile time:
            # there every lazy name (its own, and helpers imported from other modules) must be jitted.
            module_globals = self.fn.__globals__
            for name, value in list(module_globals.items()):
                if isinstance(value, LazyJit):
                    module_globals[name] = value.jit()
        return self.jitted

    def __getitem__(self, grid):
        return self.jit()[grid]


def lazy_jit(fn) -> LazyJit:
    return LazyJit(fn)


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
