"""Clients that e2e/ runs INSIDE the cluster, in a pod of the server image (mounted from a ConfigMap):
they reach a Service's ClusterIP or a pod's IP as an application in the cluster would.

    python in_pod.py bench URL --concurrency C [--stop-file F]   closed-loop `iterserve bench` load until
                                                                 F exists (or --duration s)
    python in_pod.py streams URL --streams N --max-tokens T      N streaming completions at once

Each prints progress lines, then one JSON summary as its last line (the test reads the pod's log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time


def bench(args) -> dict:
    from iterserve.bench.load import BenchConfig, run_bench
    from iterserve.bench.workload import WorkloadSpec, parse_length

    stop = threading.Event()

    def watch() -> None:  # `kubectl exec ... touch F` ends the load
        while not stop.wait(0.5):
            if os.path.exists(args.stop_file):
                stop.set()

    threading.Thread(target=watch, daemon=True).start()
    workload = WorkloadSpec("random", input_len=parse_length(str(args.input_len)),
                            output_len=parse_length(str(args.output_len)), seed=args.seed)
    config = BenchConfig(url=args.url, workload=workload, concurrency=args.concurrency, num_requests=None,
                         duration_s=args.duration, timeout_s=300, metrics_interval_s=2.0)
    print("LOAD STARTED", flush=True)
    result = run_bench(config, stop=stop)
    # the stop cancels what is in flight at that moment: those are the test's doing, not failures
    records = [r for run in result.runs for r in run.records if r.error_kind != "cancelled"]
    failed = [r for r in records if not r.ok]
    return {"requests": len(records), "ok": len(records) - len(failed),
            "errors": [{"status": r.status, "kind": r.error_kind, "error": (r.error or "")[:300]} for r in failed[:10]],
            "problems": result.problems, "seconds": max((r.end or 0) for r in records) if records else 0}


async def one_stream(client, url: str, max_tokens: int, started: asyncio.Event, first: list) -> dict:
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, finish, usage, status = "", None, None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if text and not first[0]:
                first[0] = True
                started.set()
    return {"status": status, "finish_reason": finish,
            "completion_tokens": (usage or {}).get("completion_tokens"), "chars": len(text)}


async def streams(args) -> dict:
    import httpx

    firsts = [[False] for _ in range(args.streams)]
    events = [asyncio.Event() for _ in range(args.streams)]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        tasks = [asyncio.create_task(one_stream(client, args.url, args.max_tokens, e, f))
                 for e, f in zip(events, firsts, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), timeout=300)
        print("STREAMS STARTED", flush=True)  # every stream has its first tokens: the test deletes the pod
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": [r if isinstance(r, dict) else {"error": repr(r)} for r in results]}


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bench")
    b.add_argument("url")
    b.add_argument("--concurrency", type=int, default=2)
    b.add_argument("--duration", type=float, default=None)
    b.add_argument("--stop-file", default="/tmp/stop")
    b.add_argument("--input-len", type=int, default=32)
    b.add_argument("--output-len", type=int, default=16)
    b.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("streams")
    s.add_argument("url")
    s.add_argument("--streams", type=int, default=3)
    s.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    started = time.monotonic()
    summary = bench(args) if args.what == "bench" else asyncio.run(streams(args))
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
