"""`iterserve serve`'s own process, the API server, imports neither torch, transformers nor xgrammar: they are
the engine core's (the model; the grammar engine, which also checks response_format's schemas), and each
would cost the server seconds of CPU at start and hundreds of MB.

The server runs as the command runs it (`cli.main`, in a process of its own); a thread in that process waits
for /ready, sends a request of every kind that could pull one of them in (JSON schemas good and bad,
streamed or not, json_object, a forced tool call, tokenize, metrics), prints the answers' statuses and the
heavy modules the process then holds, and ends the server with a SIGTERM (its drain)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.server_support import ROOT, free_port

HEAVY = ("torch", "transformers", "xgrammar")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


def fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# name -> (path, body or None for a GET, the status it must get)
REQUESTS = {
    "schema": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "response_format": fmt(SCHEMA)}, 200),
    "schema, streamed": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "stream": True,
                                                  "response_format": fmt(SCHEMA)}, 200),
    "bad schema": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                            "response_format": fmt({"type": "nothing"})}, 400),
    "bad schema, streamed": ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stream": True,
                                                 "response_format": fmt({"type": "nothing"})}, 400),
    "json_object": ("/v1/completions", {"prompt": "hi", "max_tokens": 8,
                                        "response_format": {"type": "json_object"}}, 200),
    "forced tool call": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "tools": TOOLS,
                                                  "tool_choice": "required"}, 200),
    "tokenize": ("/tokenize", {"messages": MESSAGES}, 200),
    "metrics": ("/metrics", None, 200),
}

PROBE = r"""
import json, os, signal, sys, threading, time, urllib.error, urllib.request

from iterserve.server.entrypoints.cli import main

url, requests, heavy = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])


def call(path, body):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def probe():
    while call("/ready", None)[0] != 200:
        time.sleep(0.1)
    answers = {name: call(path, body) for name, (path, body, _) in requests.items()}
    print("PROBE " + json.dumps({"answers": answers, "imported": [m for m in heavy if m in sys.modules]}),
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


threading.Thread(target=probe, daemon=True).start()
sys.exit(main(sys.argv[4:]))
"""


def test_the_api_server_process_imports_no_torch_transformers_or_xgrammar(tiny_dir):
    port = free_port()
    argv = [sys.executable, "-c", PROBE, f"http://127.0.0.1:{port}", json.dumps(REQUESTS), json.dumps(HEAVY),
            "serve", "--model", tiny_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--kv-cache-memory", "8MiB", "--log-level", "warning"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    report = json.loads(lines[0][len("PROBE "):])
    statuses = {name: status for name, (status, _) in report["answers"].items()}
    assert statuses == {name: status for name, (_, _, status) in REQUESTS.items()}, report["answers"]
    bad = json.loads(report["answers"]["bad schema"][1])["error"]
    assert bad["param"] == "response_format.json_schema.schema"
    assert bad["message"].startswith("response_format.json_schema.schema: this JSON schema is not supported: ")
    assert report["imported"] == [], f"the API server's process imported {report['imported']}"
