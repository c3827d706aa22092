"""Schemathesis against the running server's own /openapi.json: generated requests, valid and not,
for every route; none may get a 5xx.

The operations are driven through hypothesis directly (`as_strategy`) rather than schemathesis'
pytest plugin, which does not load under the pytest this project pins.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.server_support import InProcessServer


def test_no_server_errors(tiny_dir):
    model = tiny_dir
    # a short context keeps every generated request's generation short
    with InProcessServer(model, model_name="test-model", max_model_len=64,
                         admin_token="admin-token-for-schemathesis") as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        paths = {op.path for op in operations}
        assert {"/v1/completions", "/v1/chat/completions", "/admin/scheduler", "/v1/models"} <= paths
        # negative cases need something to break: only the operations with a body have one
        runs = [(op, GenerationMode.POSITIVE) for op in operations]
        runs += [(op, GenerationMode.NEGATIVE) for op in operations if len(op.body) > 0]
        for op, mode in runs:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            def check(case):
                case.call_and_validate(checks=[not_a_server_error])

            check()
        assert srv.state.engine.is_running
        assert srv.engine.snapshot()["num_generated_tokens"] > 0  # valid bodies got through to the engine
