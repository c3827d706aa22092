"""iterserve: `from iterserve import LLM, SamplingParams`, as with vLLM.

The names load on first use (PEP 562): `import iterserve` and the `iterserve` command stay light and work
with none of the extras installed; the engine's names need `pip install "iterserve[server]"`.
"""

import importlib
import os

# Installed, the sub-packages lie in this folder. In a checkout this folder holds only this file and they are
# its siblings (server/, operator/, kernels/, common/, router/, bench/, without __init__.py: see
# pyproject.toml), so the checkout's root joins the search path: an editable install and `python -m` from
# the root both find them.
if not os.path.isdir(os.path.join(os.path.dirname(__file__), "server")):
    __path__.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_LAZY = {
    "LLM": "iterserve.server.entrypoints.llm",
    "SamplingParams": "iterserve.server.engine.sampling_params",
    "RequestOutput": "iterserve.server.engine.outputs",
    "EngineConfig": "iterserve.server.config",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iterserve' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "iterserve":
            raise
        raise ModuleNotFoundError(f"iterserve.{name} needs the engine, and {e.name!r} is not installed: "
                                  f"pip install 'iterserve[server]'", name=e.name) from e
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
