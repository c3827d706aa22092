"""iterserve's OpenAI API against vLLM's, request by request: every difference in status, shape or fields.

    python benchmarks/api_conformance.py [--out report.json] [--show-same]
    python benchmarks/api_conformance.py --iterserve-url http://127.0.0.1:8000 --vllm-url http://127.0.0.1:8001

Starts both servers (unless given their URLs) on the bundled model in fp32, with one tools-aware chat
template (tests/chat_templates/qwen2_5.jinja, Hermes format; vLLM with `--enable-auto-tool-choice
--tool-call-parser hermes`), served as `smol`; sends every request of `api_conformance_suite.py` to
both, and prints, per request, what differs:

- the HTTP status;
- the JSON's shape: a field one side has and the other lacks, or of another type (null included),
  recursively (lists by their first element);
- the values of fields whose value is part of the contract (`object`, `finish_reason`, `role`, `type`,
  usage counts) and, for greedy requests, the generated text;
- for streams: the shapes of the first chunk, of the chunks that carry text, of the chunk that ends each
  choice and of the usage chunk, the `[DONE]` terminator, and the text put together.

Differences listed in INTENDED are marked with the reason (docs/api-conformance.md gives them all). The
exit status is 0 either way: this is a report, not a test. vLLM comes from the venv that
`python benchmarks/peer_vllm.py --install` makes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks.*`, run as a file

from benchmarks.api_conformance_suite import CASES, MODEL, Case  # noqa: E402

VOLATILE = {"id", "created", "system_fingerprint", "message", "prompt_logprobs", "kv_transfer_params"}
VALUE_FIELDS = {"object", "finish_reason", "role", "type", "prompt_tokens", "completion_tokens", "total_tokens",
                "count", "max_model_len", "tokens", "index"}
TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "chat_templates" / "qwen2_5.jinja"

# (case name or "*", the difference's path prefix) -> why it stays. Keep docs/api-conformance.md in step.
INTENDED: dict[tuple[str, str], str] = {
    ("error: unknown field", "status"): "unknown fields are refused (400), as OpenAI refuses them",
    ("error: bad role", "status"): "a message role OpenAI does not define is refused (400), as OpenAI does",
    ("error: unknown path", "$."): "every error, a 404 of an unknown path included, has OpenAI's error shape",
    ("*", "$.error.type"): "error types are OpenAI's names (invalid_request_error, ...)",
    ("*", "$.error.code"): "error codes are OpenAI's (a string or null); vLLM repeats the HTTP status",
    ("*", "$.error.param"): "param names the field at fault (null when the body is not JSON at all)",
    ("*", "$.usage.prompt_tokens_details"): "cached_tokens is always reported (vLLM: only with "
                                            "--enable-prompt-tokens-details)",
    ("*", "usage chunk: $.usage.prompt_tokens_details"): "cached_tokens is always reported",
    ("*", "$.system_fingerprint"): "no system_fingerprint (OpenAI's field is optional)",
    ("*", "finishing chunk: $.system_fingerprint"): "no system_fingerprint (OpenAI's field is optional)",
    ("*", "usage chunk: $.system_fingerprint"): "no system_fingerprint (OpenAI's field is optional)",
    ("models", "$.data[0].permission"): "no permission list (not in OpenAI's model object)",
    ("*", "first: $.usage"): "with include_usage every chunk carries usage: null until the last, as OpenAI's do",
    ("*", "text chunk: $.usage"): "with include_usage every chunk carries usage: null, as OpenAI's do",
    ("*", "finishing chunk: $.usage"): "with include_usage every chunk carries usage: null, as OpenAI's do",
    ("*", "text chunk: $.choices[0].stop_reason"): "stop_reason is on every chunk (null until the end)",
}
NULL_FIELD = "a field vLLM sends as null and iterserve leaves out: the same None to OpenAI's client"
UNCOMPARED_VALUES = ("finish_reason", "completion_tokens", "total_tokens")  # when the text is not compared


def shape(value):
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


def diff(ours, theirs, path: str = "$") -> list[tuple[str, str, str]]:
    """(path, ours, theirs) for every field that one side lacks or types differently, and every differing
    value of a contract field."""
    out: list[tuple[str, str, str]] = []
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs)):
            sub = f"{path}.{key}"
            if key not in theirs:
                out.append((sub, f"{shape(ours[key])}", "(absent)"))
            elif key not in ours:
                out.append((sub, "(absent)", f"{shape(theirs[key])}"))
            elif key not in VOLATILE:
                if key in VALUE_FIELDS and not isinstance(ours[key], (dict, list)) and ours[key] != theirs[key]:
                    out.append((sub, repr(ours[key]), repr(theirs[key])))
                else:
                    out.extend(diff(ours[key], theirs[key], sub))
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        if ours and theirs:
            return diff(ours[0], theirs[0], f"{path}[0]")
        return [] if not ours and not theirs else [(path, f"{len(ours)} items", f"{len(theirs)} items")]
    if shape(ours) != shape(theirs):  # a scalar's type, or a dict against a list (cut short to print)
        return [(path, json.dumps(shape(ours))[:80], json.dumps(shape(theirs))[:80])]
    return []


def generated_text(body) -> list[str]:
    """Each choice's text (completions) or message content (chat), in order."""
    return [c.get("text") if "text" in c else (c.get("message") or {}).get("content")
            for c in (body.get("choices") or [])] if isinstance(body, dict) else []


def read_stream(resp: httpx.Response) -> dict:
    """A streamed response as the parts that can be compared: first chunk, text chunks, last chunk of each
    choice, the usage chunk, whether [DONE] ended it, and each choice's text put together."""
    events, done = [], False
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    parts: dict = {"first": events[0] if events else None, "done": done}
    texts: dict[int, str] = {}
    for ev in events:
        for choice in ev.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = choice.get("text") if "text" in choice else delta.get("content")
            if piece:
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                parts.setdefault("text chunk", ev)
            if choice.get("finish_reason"):
                parts.setdefault("finishing chunk", ev)
        if ev.get("usage") and not ev.get("choices"):
            parts["usage chunk"] = ev
    parts["text"] = [texts[i] for i in sorted(texts)]
    return parts


def send(client: httpx.Client, base: str, case: Case) -> tuple[int, object]:
    url = base + case.path
    if case.body is None and case.raw is None:
        resp = client.get(url)
        return resp.status_code, _json(resp)
    content = case.raw if case.raw is not None else json.dumps(
        {k: v for k, v in case.body.items() if v is not None}).encode()
    headers = {"content-type": "application/json", **case.headers}
    if case.stream:
        with client.stream("POST", url, content=content, headers=headers) as resp:
            if resp.status_code != 200:
                resp.read()
                return resp.status_code, _json(resp)
            return resp.status_code, read_stream(resp)
    resp = client.post(url, content=content, headers=headers)
    return resp.status_code, _json(resp)


def _json(resp: httpx.Response):
    try:
        return resp.json()
    except ValueError:
        return {"(not JSON)": resp.text[:80]}


def compare(case: Case, ours: tuple[int, object], theirs: tuple[int, object]) -> list[tuple[str, str, str]]:
    (s1, b1), (s2, b2) = ours, theirs
    found = [] if s1 == s2 else [("status", str(s1), str(s2))]
    if case.stream and s1 == s2 == 200:
        for part in ("first", "text chunk", "finishing chunk", "usage chunk"):
            if (part in b1) != (part in b2):
                found.append((part, "yes" if part in b1 else "no", "yes" if part in b2 else "no"))
            elif part in b1:
                found.extend((f"{part}: {p}", o, t) for p, o, t in diff(b1[part], b2[part])
                             if case.compare_text or not p.endswith(UNCOMPARED_VALUES))
        if b1["done"] != b2["done"]:
            found.append(("[DONE]", str(b1["done"]), str(b2["done"])))
        if case.compare_text and b1["text"] != b2["text"]:
            found.append(("text", repr(b1["text"])[:100], repr(b2["text"])[:100]))
        return found
    if s1 == s2 or (s1 >= 400 and s2 >= 400):
        found.extend(d for d in diff(b1, b2)
                     if case.compare_text or not d[0].endswith(UNCOMPARED_VALUES))
    if s1 == s2 == 200 and case.compare_text and generated_text(b1) != generated_text(b2):
        found.append(("text", repr(generated_text(b1))[:100], repr(generated_text(b2))[:100]))
    return found


def intended(case: Case, path: str, ours: str, theirs: str) -> str | None:
    if ours == "(absent)" and theirs == "null":
        return NULL_FIELD
    for (name, prefix), why in INTENDED.items():
        if name in ("*", case.name) and path.startswith(prefix):
            return why
    return None


def conformance_model_dir(tmp: Path) -> Path:
    """The bundled model with the tools-aware template: links to its files, the template alongside."""
    from benchmarks.prepare_model import prepare_hf_model

    src = prepare_hf_model()
    dst = tmp / "model"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return dst


def run(ours_url: str, vllm_url: str, show_same: bool) -> list[dict]:
    report = []
    with httpx.Client(timeout=300) as client:
        for case in CASES:
            ours, theirs = send(client, ours_url, case), send(client, vllm_url, case)
            diffs = compare(case, ours, theirs)
            report.append({"case": case.name, "status": [ours[0], theirs[0]],
                           "differences": [{"path": p, "iterserve": o, "vllm": t, "intended": intended(case, p, o, t)}
                                           for p, o, t in diffs]})
            if diffs or show_same:
                print(f"{case.name}  [{ours[0]} / {theirs[0]}]" + ("  same" if not diffs else ""))
            for d in report[-1]["differences"]:
                mark = f"   (intended: {d['intended']})" if d["intended"] else ""
                print(f"    {d['path']}: iterserve {d['iterserve']}  vllm {d['vllm']}{mark}")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterserve-url", help="an iterserve server already serving the model as `smol`")
    ap.add_argument("--vllm-url", help="a vLLM server already serving the model as `smol`")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show-same", action="store_true", help="list the requests without differences too")
    ap.add_argument("--out", help="write the report to this JSON file")
    args = ap.parse_args()
    from benchmarks.peer_served import Server

    with tempfile.TemporaryDirectory(prefix="iterserve-conformance-") as tmp:
        servers = []
        try:
            urls = {}
            for name, given in (("iterserve", args.iterserve_url), ("vllm eager", args.vllm_url)):
                if given:
                    urls[name] = given.rstrip("/")
                    continue
                model = conformance_model_dir(Path(tmp)) if not servers else servers[0].model
                server = Server(name, model, 2048, args.threads, Path(tmp),
                                ["--served-model-name", MODEL, "--tool-call-parser", "hermes"],
                                ["--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser",
                                 "hermes"], dtype="float32")
                server.model = model
                servers.append(server)
                server.wait_ready(900)
                urls[name] = server.url
            report = run(urls["iterserve"], urls["vllm eager"], args.show_same)
        finally:
            for server in servers:
                server.stop()
    differing = [r for r in report if r["differences"]]
    open_ = [r for r in differing if any(not d["intended"] for d in r["differences"])]
    print(f"\n{len(report)} requests: {len(report) - len(differing)} the same, {len(differing)} differ "
          f"({len(open_)} with differences not marked intended)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
