"""`EngineClient.open_streams` with JSON schemas, over a real engine core process: the core checks them and
adds all the requests or none, and whatever happens on the way (a refused schema, a caller that stops
waiting for the core's answer) leaves nothing behind, here or in the core."""

from __future__ import annotations

import asyncio
import json

import pytest

from iterserve.server.config import EngineConfig
from iterserve.server.engine.core_client import EngineClient
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.engine.structured_output import SCHEMA_PARAM, StructuredOutput
from iterserve.server.errors import InvalidRequestError

GOOD = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
BAD = json.dumps({"type": "integer", "minimum": 5, "maximum": 1})


@pytest.fixture(scope="module")
def engine(tiny_dir):
    engine = EngineClient(EngineConfig(model=tiny_dir, max_model_len=64, kv_cache_memory="8MiB", dtype="float32"))
    engine.start()
    yield engine
    engine.shutdown()


def choices(prefix: str, schema: str) -> list:
    params = SamplingParams(max_tokens=6, structured_output=StructuredOutput(json_schema=schema))
    return [(f"{prefix}-{i}", [40, 41, 42], params) for i in range(2)]


def left_behind(engine: EngineClient, ids) -> dict:
    """What the client still holds of these requests: nothing, once they are done with."""
    held = {"output state": [i for i in ids if engine.output_processor.has_request(i)],
            "in flight": engine.num_in_flight, "prompt tokens pending": engine.num_prompt_tokens_pending}
    return {what: value for what, value in held.items() if value}


async def until_nothing_left(engine: EngineClient, ids) -> None:
    for _ in range(200):
        if not left_behind(engine, ids):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"left behind: {left_behind(engine, ids)}")


def test_a_refused_schema_adds_none_of_the_requests(engine):
    async def main():
        with pytest.raises(InvalidRequestError) as e:
            await engine.open_streams(choices("refused", BAD), schema_checks=[("tools[0].function.parameters", GOOD),
                                                                              (SCHEMA_PARAM, BAD)])
        assert e.value.param == SCHEMA_PARAM and "minimum greater than maximum" in e.value.message
        assert left_behind(engine, ["refused-0", "refused-1"]) == {}
        # their ids are free again, and the same requests with a good schema run to the end
        queues = await engine.open_streams(choices("refused", GOOD), schema_checks=[(SCHEMA_PARAM, GOOD)])
        for i, queue in enumerate(queues):
            outputs = [o async for o in engine.stream_outputs(f"refused-{i}", queue)]
            assert outputs[-1].finished
        assert left_behind(engine, ["refused-0", "refused-1"]) == {}

    asyncio.run(main())


@pytest.mark.parametrize("schema", [GOOD, BAD])
def test_a_caller_that_stops_waiting_for_the_check_leaves_nothing(engine, schema):
    """Added by the core (then aborted) or refused by it (then forgotten), as its answer comes."""
    async def main():
        prefix = f"cancelled-{schema == GOOD}"
        task = asyncio.ensure_future(engine.open_streams(choices(prefix, schema),
                                                         schema_checks=[(SCHEMA_PARAM, schema)]))
        await asyncio.sleep(0)  # it registered the requests and sent them to the core
        assert engine.num_in_flight == 2
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until_nothing_left(engine, [f"{prefix}-0", f"{prefix}-1"])

    asyncio.run(main())
    assert engine.snapshot()["num_running"] == 0


def test_requests_without_schemas_are_added_without_waiting(engine):
    async def main():
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        (queue,) = await engine.open_streams([("plain", [40, 41], params)])
        outputs = [o async for o in engine.stream_outputs("plain", queue)]
        assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 4
        with pytest.raises(InvalidRequestError, match="already in use"):
            await engine.open_streams([("dup", [40], params), ("dup", [41], params)])
        assert left_behind(engine, ["plain", "dup"]) == {}

    asyncio.run(main())
