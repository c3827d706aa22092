"""`iterserve serve`: the OpenAI-compatible HTTP server (uvicorn), with graceful drain on SIGTERM.

The engine core runs in a child process (engine/core_client.py); this process serves HTTP, tokenizes
and detokenizes, and imports neither torch nor the grammar engine (the core checks response_format's
schemas). The core exits with the server, and a core that dies makes /health fail.

SIGTERM does not stop uvicorn at once: readiness fails, new requests get 503 (the socket stays open,
so a client that still reaches the pod gets an answer, not a refused connection), and the requests in
flight run to completion; when none is left, or --drain-timeout seconds have passed, the server shuts
down and the process exits 0. A second SIGTERM, or SIGINT, stops at once (uvicorn's behaviour).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from iterserve.common import wire
from iterserve.server.api.tool_parsers import PARSERS
from iterserve.server.entrypoints import admin_listener
from iterserve.server.entrypoints.cli_args import add_engine_args, engine_config_from_args
from iterserve.server.entrypoints.serve_args import add_server_limit_args, check_secrets, server_limits_from_args
from iterserve.server.errors import InvalidRequestError

logger = logging.getLogger("iterserve.server")


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server",
                       description="Serve a model over an OpenAI-compatible HTTP API with Prometheus metrics.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=wire.HTTP_PORT)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model path's last part)")
    p.add_argument("--api-key", default=os.environ.get(wire.API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on /v1 (default: env {wire.API_KEY_ENV})")
    p.add_argument("--admin-token", default=os.environ.get(wire.ADMIN_TOKEN_ENV),
                   help=f"token for {wire.ADMIN_SCHEDULER_PATH} "
                        f"(default: env {wire.ADMIN_TOKEN_ENV}; unset: admin off)")
    p.add_argument("--admin-port", type=int, default=None,
                   help="serve /admin/* only on this port, on the same host (default: on --port)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="most sequences (prompts x n) waiting; a request that would make more wait gets 429 "
                        "(default: no limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", *PARSERS],
                   help="the format tool calls of tool_choice=auto are read in (default: auto, from the chat "
                        "template's markers; no known marker: the output stays text)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice=auto is always enabled here")
    add_server_limit_args(p)
    add_engine_args(p)
    p.set_defaults(run=run)


def served_model_name(model: str | None, override: str | None) -> str:
    if override:
        return override
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def _validate(args) -> None:
    if not 0 <= args.port <= 65535:
        raise InvalidRequestError("port", f"must be in [0, 65535], got {args.port}")
    if args.max_queue is not None and args.max_queue < 1:
        raise InvalidRequestError("max_queue", f"must be >= 1, got {args.max_queue}")
    if not args.drain_timeout >= 0:
        raise InvalidRequestError("drain_timeout", f"must be >= 0, got {args.drain_timeout}")
    check_secrets(args.api_key, args.admin_token)
    admin_listener.validate(args.port, args.admin_port, args.admin_token)


def build_server_state(engine, model_name: str, *, max_queue: int | None = None, api_key: str | None = None,
                       admin_token: str | None = None, limits=None, scheduling_policy: str = "fcfs",
                       tool_call_parser: str = "auto"):
    """The metrics and shared state of one server around a started EngineClient (also used by the tests)."""
    from iterserve.server.api.limits import ServerLimits
    from iterserve.server.api.metrics import Metrics
    from iterserve.server.api.serving import ServerState

    check_secrets(api_key, admin_token)
    state = ServerState(engine, model_name, max_queue=max_queue, api_key=api_key, admin_token=admin_token,
                        limits=limits or ServerLimits(), scheduling_policy=scheduling_policy,
                        tool_call_parser=tool_call_parser)
    state.metrics = Metrics(engine, model_name)
    return state


def make_uvicorn_server(app, state, *, host: str, port: int, drain_timeout: float, log_level: str = "info"):
    import uvicorn

    from iterserve.server.api.http_protocol import guarded_h11_protocol

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and not state.draining:
                # not recorded as a captured signal: uvicorn would re-raise it on exit (status -15)
                state.begin_drain()
                logger.info("SIGTERM: draining %d in-flight requests (at most %.0f s)",
                            state.engine.num_in_flight, drain_timeout)
                # A client's keep-alive connection would bring its next request here, where it gets a 503,
                # although the Service no longer sends anything new to this pod. As uvicorn's own shutdown
                # does: idle connections close now, busy ones once their response is sent, so the client's
                # next request opens a connection, through the Service, to a pod that stays.
                for connection in list(self.server_state.connections):
                    connection.shutdown()
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if state.draining and not self.should_exit:
                idle = state.engine.num_in_flight == 0
                if idle or time.monotonic() - state.drain_started >= drain_timeout:
                    if not idle:
                        # answer them (503) rather than leave uvicorn to cut their connections
                        n = state.engine.abort_all("the server shut down before this request finished "
                                                   f"(drain timeout {drain_timeout:g} s)")
                        logger.warning("drain timeout: %d requests still in flight were aborted", n)
                    self.should_exit = True
            return await super().on_tick(counter)

    limits = state.limits
    protocol = guarded_h11_protocol(limits.header_timeout, limits.stall_timeout,
                                    state.metrics.observe_cutoff if state.metrics else None)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False, lifespan="off", http=protocol,
                            timeout_keep_alive=limits.keep_alive_timeout)
    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        _validate(args)
        limits = server_limits_from_args(args)
        config = engine_config_from_args(args)
        from iterserve.server.engine.core_client import EngineClient  # heavy imports: only once args are good

        engine = EngineClient(config, log_level=args.log_level)
        engine.start()
    except (InvalidRequestError, FileNotFoundError, ValueError) as e:
        print(f"iterserve serve: error: {e}", file=sys.stderr)
        return 2
    from iterserve.server.api.app import create_app

    logger.info(engine.kv_cache_report)
    if missing := [kernel for kernel, serving in engine.cpu_kernels.items() if not serving]:
        logger.warning("C++ CPU kernels not serving: %s; the slower torch path runs instead (the engine core's "
                       "log above says why; iterserve:cpu_kernels_available shows it)", ", ".join(missing))
    state = build_server_state(engine, served_model_name(args.model, args.served_model_name),
                               max_queue=args.max_queue, api_key=args.api_key, admin_token=args.admin_token,
                               limits=limits, scheduling_policy=args.scheduling_policy,
                               tool_call_parser=args.tool_call_parser)
    app, admin = admin_listener.split(create_app(state), host=args.host, admin_port=args.admin_port,
                                      log_level=args.log_level)
    server = make_uvicorn_server(app, state, host=args.host, port=args.port,
                                 drain_timeout=args.drain_timeout, log_level=args.log_level)
    logger.info("serving %s on http://%s:%d", state.model_name, args.host, args.port)
    try:
        admin_listener.run(server, admin)
    finally:
        state.engine.shutdown()
        state.prep_pool.shutdown(wait=False, cancel_futures=True)
    return 0
