"""The bundled SmolLM2-135M-Instruct GGUF, end to end through `iterserve generate`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def iterserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "iterserve.server.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_answers_a_fact_from_the_default_gguf(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of Germany?", "max_tokens": 24}) + "\n")
    r = iterserve("generate", "--chat", "--prompt", "What is the capital of France?", "--prompts-file", str(prompts),
                  "--max-tokens", "24", "--threads", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert "KV cache:" in r.stderr  # the pool size is reported at start
    france, germany = [json.loads(line) for line in r.stdout.splitlines()]
    assert "Paris" in france["text"], france
    assert "Berlin" in germany["text"], germany
    assert france["finish_reason"] == "stop" and len(france["token_ids"]) < 24  # ended on EOS by itself


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--model", "/nonexistent/model"], "/nonexistent/model"),
    ([], "--prompt"),
])
def test_generate_rejects_bad_input_with_a_clear_message(args, message):
    r = iterserve("generate", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr
