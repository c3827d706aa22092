"""The Service stand-in's pure parts: which pods are endpoints, and the pod-seconds of a timeline."""

from __future__ import annotations

import pytest

from tests.service_standin import is_endpoint, pod_seconds


def pod(ready: bool = True, ip: str | None = "127.0.0.5", deleting: bool = False) -> dict:
    metadata = {"name": "p", **({"deletionTimestamp": "2026-12-04T00:00:00Z"} if deleting else {})}
    status: dict = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": metadata, "status": status}


@pytest.mark.parametrize("p, expected", [
    (pod(), True),
    (pod(ready=False), False),
    (pod(ip=None), False),
    (pod(deleting=True), False),  # terminating: off the endpoints while its preStop hook runs
    ({"metadata": {"name": "p"}, "status": {}}, False),  # just created, not yet bound
    ({"metadata": {"name": "p"}}, False),
])
def test_is_endpoint(p, expected):
    assert is_endpoint(p) is expected


ROTATION = {"iterserve.io/rotation": "in"}


@pytest.mark.parametrize("labels, expected", [
    (ROTATION, True),
    ({"iterserve.io/rotation": "out"}, False),  # the operator took it out of the Service's rotation
    ({}, False),  # the Service's selector asks for the label
])
def test_is_endpoint_only_with_the_rest_of_the_services_selector(labels, expected):
    p = pod()
    p["metadata"]["labels"] = labels
    assert is_endpoint(p, ROTATION) is expected


TIMELINE = [(0.0, 1, 0), (5.0, 1, 1), (10.0, 2, 1), (20.0, 1, 1)]


@pytest.mark.parametrize("start, end, expected", [
    (0, 30, 1 * 10 + 2 * 10 + 1 * 10),
    (5, 25, 1 * 5 + 2 * 10 + 1 * 5),
    (12, 18, 2 * 6),
    (-10, 0, 0),  # before the first pod
    (25, 30, 5),  # after the last change, its count holds
    (10, 10, 0),
])
def test_pod_seconds(start, end, expected):
    assert pod_seconds(TIMELINE, start, end) == pytest.approx(expected)


def test_pod_seconds_of_no_timeline_is_zero():
    assert pod_seconds([], 0, 100) == 0
