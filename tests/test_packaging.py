"""The top-level operator/ folder must never shadow the stdlib `operator` module, however we run.

`import operator` must give the stdlib module and `iterserve.operator` our package: under
`python -m pytest` (the repo root first on sys.path), plain `pytest`, a spawned child process, and a
regular (non-editable) install.
"""

import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = textwrap.dedent("""
    import operator, sys
    assert operator.eq(1, 1) and hasattr(operator, "itemgetter"), operator.__file__
    import iterserve.operator.constants as c
    assert c.PLURAL == "llmservices"
    import iterserve.server.engine.scheduler, iterserve.kernels.paged_attention_torch
    print("ok", operator.__file__)
""")


def _stdlib_operator_ok() -> str:
    import operator

    assert operator.eq(1, 1)
    import iterserve.operator.constants  # noqa: F401

    return operator.__file__


def test_python_c_from_repo_root():
    # `python -c` / `python -m` put the working directory first on sys.path, like `python -m pytest`.
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout and str(ROOT / "operator") not in r.stdout


def test_pytest_both_ways(tmp_path):
    test_file = tmp_path / "test_shadow.py"
    test_file.write_text("def test_it():\n" + textwrap.indent(CHECK, "    "))
    for cmd in ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
                [str(Path(sys.executable).parent / "pytest"), "-q", "-p", "no:cacheprovider", str(test_file)]):
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_spawned_child():
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        path = pool.apply(_stdlib_operator_ok)
    assert not path.startswith(str(ROOT))


def test_regular_install(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr
    # every sub-package made it into the wheel
    for sub in ("server/engine", "server/model", "server/runner", "server/entrypoints", "server/api", "operator", "kernels"):
        assert list((target / "iterserve" / sub).glob("*.py")), sub
    assert not (target / "operator").exists()
    # the C++ kernels' sources ship too: kernels/cpu_extension.py builds them on first use
    for source in (ROOT / "kernels" / "csrc").iterdir():  # the headers they include too
        assert (target / "iterserve" / "kernels" / "csrc" / source.name).is_file(), source.name
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=target, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert str(target / "iterserve") in subprocess.run(
        [sys.executable, "-c", "import iterserve.server.config as m; print(m.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True).stdout


def test_the_in_process_engine_needs_neither_msgspec_nor_zeromq():
    """The GPU benchmark's machines carry torch and triton and cannot install anything: the offline engine
    and the GPU benchmark's imports must work where only the server's process split needs msgspec and
    pyzmq."""
    check = textwrap.dedent("""
        import sys
        sys.modules["msgspec"] = None  # an import of either now fails
        sys.modules["zmq"] = None
        from iterserve.server.entrypoints.llm import LLM
        from iterserve.server.engine.engine_factory import build_engine
        import iterserve.kernels.triton_backend
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
