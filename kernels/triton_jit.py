"""`lazy_jit`: a Triton kernel decorated on its first launch instead of at import.

`triton.jit` decides at decoration time whether a kernel runs compiled or under the interpreter
(`TRITON_INTERPRET=1`, which the CPU tests use). Decorating lazily makes the kernel modules safe to
import in any order: the choice follows the environment as it is when a kernel first runs.
"""

from __future__ import annotations


class LazyJit:
    def __init__(self, fn, do_not_specialize: tuple[str, ...] = ()):
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self.jitted = None

    def jit(self):
        if self.jitted is None:
            import inspect

            import triton

            options = {}
            if self.do_not_specialize:
                # integer arguments that change from step to step: compiling a variant for each value
                # class (== 1, divisible by 16) would cost seconds in the middle of serving
                names = list(self.do_not_specialize)
                options["do_not_specialize"] = names
                if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
                    options["do_not_specialize_on_alignment"] = names
            self.jitted = triton.jit(self.fn, **options)
            # A kernel resolves the functions it calls through its module's globals at compile time:
            # there every lazy name (its own, and helpers imported from other modules) must be jitted.
            module_globals = self.fn.__globals__
            for name, value in list(module_globals.items()):
                if isinstance(value, LazyJit):
                    module_globals[name] = value.jit()
        return self.jitted

    def __getitem__(self, grid):
        return self.jit()[grid]


def lazy_jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """`@lazy_jit` or `@lazy_jit(do_not_specialize=("arg", ...))`."""
    if fn is None:
        return lambda f: LazyJit(f, do_not_specialize)
    return LazyJit(fn)


def interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
