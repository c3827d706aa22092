"""GET/PATCH /admin/scheduler: the tuner's hand on the live knobs.

A PATCH is validated as a whole (the engine's LiveKnobs refuses the entire change if any field is
bad), applied between two steps, and logged with the old and the new values. Ranges: every knob is an
integer >= 1; max_num_batched_tokens must also cover one block of prefill work, and the values above
which a knob can have no effect are reported as `max` (a larger value is accepted and harmless).
"""

from __future__ import annotations

import logging

from iterserve.common import wire
from iterserve.server.api.errors import APIError
from iterserve.server.api.protocol import KnobsPatch
from iterserve.server.api.serving import ServerState
from iterserve.server.errors import InvalidRequestError

logger = logging.getLogger("iterserve.admin")

def ranges(state: ServerState) -> dict[str, dict[str, int]]:
    max_len = state.engine.max_model_len
    return {
        "max_num_seqs": {"min": 1, "max": wire.KNOB_LIMIT},
        "max_num_batched_tokens": {"min": 1, "max": wire.KNOB_LIMIT},
        "prefill_chunk_size": {"min": 1, "max": max(wire.KNOB_LIMIT, max_len)},
    }


def describe(state: ServerState) -> dict:
    return {"knobs": state.engine.knobs.as_dict(), "ranges": ranges(state),
            "num_changes": state.engine.snapshot()["num_knob_changes"]}


async def apply(state: ServerState, patch: KnobsPatch) -> dict:
    changes = patch.model_dump(exclude_none=True)
    if not changes:
        raise APIError(400, f"give at least one of {', '.join(wire.KNOB_NAMES)}",
                       param=None, code="invalid_value")
    limits = ranges(state)
    for name, value in changes.items():
        lo, hi = limits[name]["min"], limits[name]["max"]
        if not lo <= value <= hi:
            raise APIError(400, f"{name}: must be in [{lo}, {hi}], got {value}", param=name, code="invalid_value")
    old = state.engine.knobs
    try:
        new = await state.engine.update_knobs(**changes)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    diff = {k: (getattr(old, k), v) for k, v in new.as_dict().items() if getattr(old, k) != v}
    if diff:
        logger.info("scheduler knobs changed: %s",
                    ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()))
    return {**describe(state), "changed": {k: {"old": a, "new": b} for k, (a, b) in diff.items()}}
