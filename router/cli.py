"""`iterserve router`: the load-aware router in front of a service's pods (flags, then router/serve.py).

Only argparse is imported at module level: `iterserve --help` must not pay for aiohttp.
"""

from __future__ import annotations

import argparse
import logging

from iterserve.common import wire

# router/policy.py's POLICIES, without importing it here
POLICY_CHOICES = ("least-load", "least-requests", "prefix-hash", "round-robin")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def register(sub) -> None:
    p = sub.add_parser("router", help="route OpenAI API requests across a service's pods by load or prefix",
                       description="Proxy the OpenAI API to a set of iterserve (or vLLM) pods, choosing each "
                                   "request's pod by load (least-load) or by its prompt's prefix with bounded "
                                   "load (prefix-hash, consistent hashing as KubeAI's CHWBL); round-robin, "
                                   "blind to load as a Kubernetes Service, is the baseline to compare them with.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=wire.HTTP_PORT)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", help="comma-separated pod base URLs, e.g. http://a:8000,http://b:8000")
    where.add_argument("--dns-name", help="a headless Service's DNS name: its A records are the ready pods")
    p.add_argument("--backend-port", type=int, default=wire.HTTP_PORT, help="the pods' port, with --dns-name")
    p.add_argument("--policy", default="least-load", choices=POLICY_CHOICES)
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="prefix-hash: a pod takes a key while its in-flight requests stay under this x the "
                        "average (default 1.25; at least 1)")
    p.add_argument("--request-tokens", type=_positive(float), default=32,
                   help="least-load: what one request on a pod weighs against the prompt tokens still to prefill "
                        "there (default 32; larger spreads requests more evenly, smaller follows the prefill)")
    p.add_argument("--prefix-chars", type=_positive(int), default=256,
                   help="prefix-hash: how many characters of the prompt (chat messages rendered as text) are hashed")
    p.add_argument("--scrape-interval", type=_positive(float), default=0.2,
                   help="seconds between scrapes of each pod's /metrics (its load and health)")
    p.add_argument("--scrape-failure-threshold", type=_positive(int), default=3,
                   help="failed /metrics scrapes in a row that take a pod out of routing (default 3)")
    p.add_argument("--connect-timeout", type=_positive(float), default=2.0,
                   help="seconds to connect to a pod before trying another")
    p.add_argument("--backend-keep-alive-timeout", type=_positive(float), default=60.0,
                   help="seconds an idle connection to a pod is kept for a later request (default 60); keep it "
                        "below the pods' own keep-alive (`iterserve serve --keep-alive-timeout`, 75 by default; "
                        "vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 by default) so that the router closes idle "
                        "connections, not the pod")
    p.add_argument("--workers", type=_positive(int), default=1,
                   help="router processes sharing the port (SO_REUSEPORT), each with its own pod scrapes and "
                        "in-flight counts; one carries thousands of requests/s (docs/router.md)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds open requests (streams) get to finish after SIGTERM, while no new connection "
                        "is taken (default 30, as `iterserve serve`'s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(run=run)


def build_router(args):
    from iterserve.router.pods import Discovery, PodSet
    from iterserve.router.policy import make_policy
    from iterserve.router.proxy import Router

    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()] if args.endpoints else None
    discovery = Discovery(endpoints, args.dns_name, port=args.backend_port)
    pods = PodSet(discovery, interval=args.scrape_interval, failure_threshold=args.scrape_failure_threshold)
    policy = make_policy(args.policy, args.load_factor, args.request_tokens)
    return Router(pods, args.policy, policy, prefix_chars=args.prefix_chars,
                  connect_timeout=args.connect_timeout, idle_timeout=args.backend_keep_alive_timeout)


def run(args) -> int:
    import functools
    import sys

    from iterserve.router.serve import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
        build_router(args)  # bad flags fail here, once, before any worker starts
    except ValueError as e:
        print(f"iterserve router: {e}", file=sys.stderr)
        return 2
    # built again in the running loop of each worker (aiohttp binds its sessions to that loop)
    return serve(functools.partial(build_router, args), args.host, args.port, args.workers, args.drain_timeout)
