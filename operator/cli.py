"""`iterserve operator`: run the LLMService operator (kopf) against the cluster in KUBECONFIG or in-cluster.

Only argparse here at import time: `iterserve --help` must not pay for kopf and kubernetes.
"""

from __future__ import annotations

import argparse
import os

from iterserve.operator.constants import (
    DEFAULT_MAX_CONCURRENT_SCRAPES,
    DEFAULT_OPERATOR_LABELS,
    DEFAULT_OPERATOR_NAMESPACE,
)


def register(sub) -> None:
    p = sub.add_parser("operator", help="run the LLMService Kubernetes operator",
                       description="Reconcile LLMService resources into serving pods and tune them live. "
                                   "Cluster access from KUBECONFIG, else the in-cluster service account.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch only this namespace (repeatable, or a comma list); the operator then needs "
                            "rights only there (manifests/namespaced/)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--standalone", action="store_true",
                   help="no leader election: only for a single replica (e.g. on a laptop)")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "iterserve-system"),
                   help="namespace of the leader-election Lease (default: env POD_NAMESPACE or iterserve-system)")
    p.add_argument("--lease-seconds", type=int, default=15, help="leader Lease duration; a standby takes over "
                                                                 "this long after the leader dies")
    p.add_argument("--identity", default=None, help="leader-election identity (default: env POD_NAME)")
    p.add_argument("--resync-seconds", type=float, default=None,
                   help="how often each LLMService is fully reconciled to repair drift (default 30)")
    p.add_argument("--workers", type=int, default=None,
                   help="how many LLMServices' change passes run at once (default: env ITERSERVE_OPERATOR_WORKERS, "
                        "else 32); a fleet-wide edit queues a pass per service behind them")
    p.add_argument("--prometheus-url", default=os.environ.get("ITERSERVE_PROMETHEUS_URL"),
                   help="Prometheus the tuner reads p99 latencies from (default: env ITERSERVE_PROMETHEUS_URL)")
    p.add_argument("--metrics-port", type=int, default=os.environ.get("ITERSERVE_OPERATOR_METRICS_PORT"),
                   help="serve the operator's own Prometheus metrics (tuning decisions, knobs per service) on "
                        "this port at /metrics (default: env ITERSERVE_OPERATOR_METRICS_PORT, else not served)")
    p.add_argument("--health-port", type=int, default=os.environ.get("ITERSERVE_OPERATOR_HEALTH_PORT"),
                   help="answer the probes' GET /healthz on this port, leader and standby alike (default: env "
                        "ITERSERVE_OPERATOR_HEALTH_PORT, else not served)")
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE", DEFAULT_OPERATOR_NAMESPACE),
                   help="the namespace the operator's pods run in: each LLMService's NetworkPolicy opens the admin "
                        "port to them alone (default: env POD_NAMESPACE or iterserve-system)")
    p.add_argument("--operator-labels", default=",".join(f"{k}={v}" for k, v in DEFAULT_OPERATOR_LABELS.items()),
                   metavar="K=V,...", help="labels of the operator's pods, for the same rule (default: %(default)s)")
    p.add_argument("--max-concurrent-scrapes", type=int,
                   default=os.environ.get("ITERSERVE_OPERATOR_MAX_CONCURRENT_SCRAPES", DEFAULT_MAX_CONCURRENT_SCRAPES),
                   help="most pods' /metrics the tuners read at once, all services together (default: env "
                        "ITERSERVE_OPERATOR_MAX_CONCURRENT_SCRAPES, else %(default)s)")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(run=run)


def watched_namespaces(values: list[str]) -> list[str]:
    """--namespace given repeatedly and/or as comma lists -> the namespaces, in order, once each."""
    return list(dict.fromkeys(ns.strip() for value in values for ns in value.split(",") if ns.strip()))


def run(args: argparse.Namespace) -> int:
    if args.resync_seconds is not None:
        if args.resync_seconds <= 0:
            print(f"iterserve operator: error: --resync-seconds must be > 0, got {args.resync_seconds}")
            return 2
        os.environ["ITERSERVE_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)  # read by handlers at import
    if args.workers is not None:
        if args.workers < 1:
            print(f"iterserve operator: error: --workers must be >= 1, got {args.workers}")
            return 2
        os.environ["ITERSERVE_OPERATOR_WORKERS"] = str(args.workers)  # read by handlers at import
    import threading

    import kopf
    import prometheus_client

    from iterserve.operator import handlers  # noqa: F401  (registers the handlers)
    from iterserve.operator.builders.networkpolicy import OperatorPeer, parse_labels
    from iterserve.operator.health import Health
    from iterserve.operator.health import serve as serve_health
    from iterserve.operator.leader import default_identity, run_as_leader, timings
    from iterserve.operator.tuning.operator_metrics import OperatorMetrics

    try:
        timings(args.lease_seconds)
    except ValueError as e:
        print(f"iterserve operator: error: {e}")
        return 2
    for flag in ("metrics_port", "health_port"):
        port = getattr(args, flag)
        if port is not None and not 1 <= port <= 65535:
            print(f"iterserve operator: error: --{flag.replace('_', '-')} must be in 1..65535, got {port}")
            return 2
    if int(args.max_concurrent_scrapes) < 1:
        print(f"iterserve operator: error: --max-concurrent-scrapes must be >= 1, got {args.max_concurrent_scrapes}")
        return 2
    try:
        operator_peer = OperatorPeer(args.operator_namespace, parse_labels(args.operator_labels))
    except ValueError as e:
        print(f"iterserve operator: error: --operator-labels: {e}")
        return 2
    kopf.configure(verbose=args.verbose)
    namespaces = watched_namespaces(args.namespace)
    metrics = OperatorMetrics()
    if args.metrics_port is not None:
        # served by every replica, the standby included (its registry stays empty: only the leader tunes)
        prometheus_client.start_http_server(args.metrics_port, registry=metrics.registry)
    health = Health()
    if args.health_port is not None:
        serve_health(args.health_port, health)
    memo = kopf.Memo(prometheus_url=args.prometheus_url, namespaces=namespaces, operator_metrics=metrics,
                     operator_peer=operator_peer, health=health,
                     scrape_limit=threading.BoundedSemaphore(int(args.max_concurrent_scrapes)))

    def operate() -> None:
        kopf.run(standalone=True, clusterwide=not namespaces, namespaces=namespaces, memo=memo)

    if args.standalone:
        operate()
    else:
        import kubernetes

        kubernetes.config.load_config()  # the Lease client uses the default configuration
        run_as_leader(operate, namespace=args.lease_namespace, identity=args.identity or default_identity(),
                      lease_seconds=args.lease_seconds, heartbeat=lambda: health.beat("standing by"))
    return 0
