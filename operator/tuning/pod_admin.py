"""The tuner's hand on a pod: GET/PATCH /admin/scheduler over HTTP with the admin token.

Used by spec edits of engine knobs and by the tuner alike (docs/tuning.md). Knob names are the server's
snake_case ones (`max_num_seqs`, `max_num_batched_tokens`, `prefill_chunk_size`). Every failure (refused
connection, timeout, non-2xx answer, a body that is not JSON) becomes one `PodCallError` whose message
names the pod URL and, when the server answered, its OpenAI-style error message.
"""

from __future__ import annotations

import httpx

from iterserve.common.wire import ADMIN_SCHEDULER_PATH, KNOB_NAMES
from iterserve.operator.tuning.pod_http import pod_client


class PodCallError(Exception):
    """A call to one pod's admin API failed; `status` is the HTTP status when the pod answered."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url = url
        self.status = status
        self.server_message = message


def get_scheduler(base_url: str, admin_token: str, timeout: float = 5.0) -> dict:
    """`{"knobs": {...}, "ranges": {...}, "num_changes": N}` of the pod at `base_url`."""
    return _call("GET", base_url, admin_token, None, timeout)


def patch_scheduler(base_url: str, admin_token: str, knobs: dict[str, int], timeout: float = 5.0) -> dict:
    """Change some live knobs of the pod at `base_url`, all or none; returns the server's answer, which
    holds the knobs now in force and what `changed` ({name: {old, new}})."""
    unknown = sorted(set(knobs) - set(KNOB_NAMES))
    if unknown:
        # refused here so a caller's typo names itself instead of surfacing as the server's 400
        raise ValueError(f"unknown knob(s) {', '.join(unknown)}; expected some of {', '.join(KNOB_NAMES)}")
    return _call("PATCH", base_url, admin_token, dict(knobs), timeout)


def _call(method: str, base_url: str, admin_token: str, body: dict | None, timeout: float) -> dict:
    url = base_url.rstrip("/") + ADMIN_SCHEDULER_PATH
    try:
        response = pod_client().request(method, url, json=body, timeout=timeout,
                                        headers={"Authorization": f"Bearer {admin_token}"})
    except httpx.HTTPError as e:
        raise PodCallError(url, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from e
    if response.is_success:
        try:
            return response.json()
        except ValueError:
            raise PodCallError(url, f"answer is not JSON: {response.text[:200]!r}", response.status_code) from None
    raise PodCallError(url, f"HTTP {response.status_code}: {_server_message(response)}", response.status_code)


def _server_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
