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

import pytest

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
    for sub in ("server/engine", "server/model", "server/runner", "server/entrypoints", "server/api", "operator",
                "kernels", "router"):
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


EXTRA_CHECK = textwrap.dedent(r'''
    """Block every installed module that the extra's requirements (and theirs) do not bring, then import
    each module of the code that extra serves: what it imports must come with it."""
    import importlib, importlib.metadata as md, pkgutil, re, sys
    extra, packages = sys.argv[1], sys.argv[2:]

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    def requires(dist, extras):
        for line in md.requires(dist) or []:
            requirement, _, marker = line.partition(";")
            wanted = re.findall(r"""extra\s*==\s*["']([^"']+)""", marker)
            if wanted and not set(wanted) & set(extras):
                continue
            m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", requirement)
            yield norm(m.group(1)), [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]

    closure, todo = set(), list(requires("iterserve", [extra]))
    while todo:
        name, extras = todo.pop()
        if (name, tuple(extras)) in closure:
            continue
        closure.add((name, tuple(extras)))
        try:
            todo += requires(name, extras)
        except md.PackageNotFoundError:  # a requirement whose markers exclude this machine
            pass
    allowed = {name for name, _ in closure} | {"iterserve"}
    blocked = sorted(m for m, dists in md.packages_distributions().items()
                     if m.isidentifier() and m not in sys.stdlib_module_names
                     and not {norm(d) for d in dists} & allowed)
    for module in blocked:
        sys.modules[module] = None  # importing it now raises ImportError
    assert "torch" in blocked or extra == "server", blocked

    imported = 0
    for package in packages:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            # the Triton kernels belong to the cuda extra
            if "triton" in info.name.rsplit(".", 1)[1]:
                continue
            importlib.import_module(info.name)
            imported += 1
    from iterserve.server.entrypoints import extras
    assert extras.missing(extra) == [], extras.missing(extra)
    print("ok", imported, "modules;", len(blocked), "blocked")
''')

EXTRA_CODE = {"server": ["iterserve.server", "iterserve.kernels", "iterserve.common"],
              "operator": ["iterserve.operator", "iterserve.common"],
              "bench": ["iterserve.bench", "iterserve.common"],
              "router": ["iterserve.router", "iterserve.common"]}


@pytest.mark.parametrize("extra", EXTRA_CODE)
def test_each_extra_brings_everything_its_code_imports(extra):
    """The server, operator, bench and router code imports only what `pip install iterserve[extra]` installs:
    with every other installed module blocked, each of its modules imports (torch is blocked for the operator and
    the bench, kopf and matplotlib for the server, ...)."""
    r = subprocess.run([sys.executable, "-c", EXTRA_CHECK, extra, *EXTRA_CODE[extra]], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory):
    """A fresh virtual environment holding iterserve alone: its wheel installed with no index, so any
    requirement of the base package would fail the install."""
    tmp = tmp_path_factory.mktemp("base-venv")
    run = dict(capture_output=True, text=True, timeout=300)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp / "dist"), str(ROOT)], **run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], **run)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(tmp / "venv/bin/python"), "install", "-q",
                        "--no-index", "--find-links", str(tmp / "dist"), "iterserve"], **run)
    assert r.returncode == 0, r.stderr
    return tmp / "venv"


def test_the_base_package_imports_and_runs_with_no_dependencies(base_venv, tmp_path):
    python, cli = str(base_venv / "bin/python"), str(base_venv / "bin/iterserve")
    r = subprocess.run([python, "-c", "import iterserve, sys; print(sorted(iterserve.__all__)); "
                        "assert not {'torch', 'fastapi', 'kopf'} & set(sys.modules)"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "'LLM', 'RequestOutput', 'SamplingParams'" in r.stdout, r.stderr
    r = subprocess.run([cli, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "serve" in r.stdout and "operator" in r.stdout, r.stderr
    # the names and commands that need an extra say which
    r = subprocess.run([python, "-c", "from iterserve import LLM"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 1 and "pip install 'iterserve[server]'" in r.stderr, r.stderr
    for argv, extra in ((["serve"], "server"), (["generate", "--prompt", "hi"], "server"),
                        (["operator"], "operator"), (["bench", "--url", "http://127.0.0.1:9"], "bench"),
                        (["router", "--endpoints", "http://127.0.0.1:9"], "router")):
        r = subprocess.run([cli, *argv], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 2 and f"pip install 'iterserve[{extra}]'" in r.stderr, (argv, r.stderr)
    # run from a checkout's root, the checkout's sub-packages are the ones imported, as for any package
    r = subprocess.run([python, "-c", "import iterserve.server.entrypoints.cli as c; print(c.__file__)"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and str(ROOT / "server") in r.stdout, r.stderr


def test_from_iterserve_import_llm_and_sampling_params(tiny_llama):
    """vLLM's spelling: `from iterserve import LLM, SamplingParams`, greedy outputs equal to HF's."""
    from iterserve import LLM, SamplingParams
    from tests.conftest import hf_greedy

    path, model = tiny_llama
    llm = LLM(path, kv_cache_memory="8MiB")
    prompts = [[5, 17, 42, 99], [7, 8]]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6, temperature=0,
                                                                                  ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 6) for p in prompts]
    import iterserve.server.entrypoints.llm as llm_module
    assert LLM is llm_module.LLM
