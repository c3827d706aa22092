"""Leader election over a coordination.k8s.io Lease, so that two operator replicas never both act.

Why not kopf's peering: peers of the same priority both keep processing (kopf only logs a warning),
and there are no per-object locks, so two replicas of one Deployment would fight. Here a replica
runs kopf only while it holds the Lease (the `kubernetes` package's LeaderElection with its
LeaseLock, as client-go does it); a standby waits. A leader that cannot renew in time exits at once
(its Deployment restarts it as a standby) rather than risk acting next to a new leader.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

logger = logging.getLogger("iterserve.operator.leader")
LEASE_NAME = "iterserve-operator"


def default_identity() -> str:
    """The pod's name when the Deployment passes it in (a restarted container takes its Lease back at
    once), else host name plus a random suffix."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def timings(lease_seconds: int) -> tuple[int, int, int]:
    """(lease duration, renew deadline, retry period) in the proportions client-go uses (15/10/2 s)."""
    if lease_seconds < 3:
        raise ValueError(f"--lease-seconds must be >= 3, got {lease_seconds}")
    retry = max(1, lease_seconds // 7)
    renew = max(2 * retry, (2 * lease_seconds) // 3)
    return lease_seconds, renew, retry


def run_as_leader(run: Callable[[], None], *, namespace: str, identity: str, lease_seconds: int = 15,
                  name: str = LEASE_NAME, on_lost: Callable[[], None] | None = None,
                  heartbeat: Callable[[], None] | None = None, beat_every: float = 5.0) -> None:
    """Block until this process holds Lease `namespace/name`, then call `run` in this thread.

    `run` must not return while leading (kopf.run does not); when the Lease is lost `on_lost` is called
    from the election thread (default: exit the process with status 1). While waiting, `heartbeat` is
    called every `beat_every` seconds as long as the election thread is alive (operator/health.py)."""
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

    logging.getLogger("leaderelection").setLevel(logging.WARNING)  # it logs every retry at INFO
    duration, renew, retry = timings(lease_seconds)
    leading = threading.Event()

    def lost() -> None:
        logger.error("lost the Lease %s/%s: stopping so that only the new leader acts", namespace, name)
        (on_lost or _exit_now)()

    config = electionconfig.Config(LeaseLock(name, namespace, identity), lease_duration=duration,
                                   renew_deadline=renew, retry_period=retry,
                                   onstarted_leading=leading.set, onstopped_leading=lost)
    thread = threading.Thread(target=leaderelection.LeaderElection(config).run, name="leader-election", daemon=True)
    logger.info("%s: waiting to lead (Lease %s/%s, %d s)", identity, namespace, name, duration)
    thread.start()
    while not leading.wait(beat_every):
        if heartbeat is not None and thread.is_alive():
            heartbeat()
    logger.info("%s: leading", identity)
    run()


def _exit_now() -> None:
    logging.shutdown()
    os._exit(1)
