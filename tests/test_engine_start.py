"""`EngineClient.start(while_core_loads=...)`: the server's own start-up work (the grammar engine's import)
runs while the engine core's process loads the weights, not after it; in-process, once the core is built.
Either way it gets the tokenizer the server then uses."""

from __future__ import annotations

import pytest

from iterserve.server.config import EngineConfig
from iterserve.server.engine.core_client import EngineClient


@pytest.mark.parametrize("in_process", [False, True])
def test_the_callers_work_overlaps_the_cores_load(tiny_dir, in_process):
    engine = EngineClient(EngineConfig(model=tiny_dir, max_model_len=64), in_process=in_process)
    seen = []

    def while_core_loads(tokenizer):
        core_process_running = engine._proc is not None and engine._proc.poll() is None
        seen.append((tokenizer, engine.is_running, core_process_running))

    engine.start(while_core_loads=while_core_loads)
    try:
        assert len(seen) == 1
        tokenizer, running, core_process_running = seen[0]
        assert tokenizer is engine.tokenizer and tokenizer is not None
        assert not running  # called before the client took the core's Ready
        assert core_process_running == (not in_process)  # the core's process was already loading
        assert engine.is_running
    finally:
        engine.shutdown()
