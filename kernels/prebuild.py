"""Builds the C++ CPU kernels ahead of time into a directory that ITERSERVE_CPU_KERNELS_DIR points at.

    python -m iterserve.kernels.prebuild DIR [MARCH ...]     (default: x86-64-v3 x86-64-v4 x86-64-v4-bf16)

Run at image build time (manifests/Dockerfile.server): the image then serves with the kernels although
it has no compiler and a read-only root filesystem. Each kernel is built once per -march level into
DIR/<torch version>/<march>/<name>.so and imported as it is built, so a build that does not load fails
the image build rather than a pod (the builder's CPU must run every level asked for).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from iterserve.kernels import cpu_bf16_linear, cpu_decode_stack, cpu_layer_ops, cpu_paged_attention
from iterserve.kernels.cpu_extension import prebuilt_path, supported_marches

EXTENSIONS = {e.name: e for e in (cpu_paged_attention._extension, cpu_paged_attention._prefill_extension,
                                  cpu_layer_ops._extension, cpu_bf16_linear._extension,
                                  cpu_decode_stack._extension)}
DEFAULT_MARCHES = ("x86-64-v3", "x86-64-v4", "x86-64-v4-bf16")


def build_one(name: str, march: str, root: Path) -> Path:
    """Compile one kernel for one level into root (torch's loader imports it as it builds it)."""
    target = prebuilt_path(root, march, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as build_dir:
        EXTENSIONS[name].compile(Path(build_dir), march)
        shutil.copyfile(Path(build_dir) / f"{name}.so", target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m iterserve.kernels.prebuild", description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("marches", nargs="*", default=list(DEFAULT_MARCHES), help="-march levels to build for")
    ap.add_argument("--kernels", default=",".join(EXTENSIONS), help="which, comma-separated (default: all)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one kernel and level, in a child process
    args = ap.parse_args(argv)
    if args.one:
        build_one(args.one, args.marches[0], args.dir)
        return 0
    # One child per build: torch's JIT loader renames a module it already built in this process with
    # other flags (name_v1), and a process can import a given module name only once.
    if unsupported := [m for m in args.marches if m not in supported_marches()]:
        print(f"warning: this CPU does not run {', '.join(unsupported)}: their builds are imported anyway",
              file=sys.stderr)
    for march in args.marches:
        for name in args.kernels.split(","):
            if name not in EXTENSIONS:
                ap.error(f"unknown kernel {name!r}; known: {', '.join(EXTENSIONS)}")
            subprocess.run([sys.executable, "-m", "iterserve.kernels.prebuild", "--one", name, str(args.dir), march],
                           check=True)
            target = prebuilt_path(args.dir, march, name)
            print(f"built {target} ({target.stat().st_size // 1024} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
