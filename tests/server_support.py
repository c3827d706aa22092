"""Helpers for the server tests: a tokenizer for the tiny random models, and real servers to talk to.

`InProcessServer` runs the real app under uvicorn in a thread (no signal handling: the engine core in
its own process and the HTTP stack are the production ones); `start_subprocess` runs `iterserve serve`
itself, for SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from iterserve.server.config import EngineConfig
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tiny_tokenizer(src_model_dir: str, dst_dir: Path, vocab_size: int = 320) -> str:
    """Copy a tiny model and give it a byte-level tokenizer covering its whole vocabulary: ids 0-255
    are the bytes, then <|im_start|>, <|im_end|> and filler special tokens up to vocab_size, so any id
    the random model samples decodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    shutil.copytree(src_model_dir, dst_dir, dirs_exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(vocab_size - 258)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(dst_dir / "tokenizer.json"))
    (dst_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TINY_CHAT_TEMPLATE}))
    return str(dst_dir)


def with_special_eos(src_dir: str, dst_dir: Path, eos: int = 257) -> str:
    """A copy of a tiny model directory whose EOS is a special token (<|im_end|>, left out of the text), not
    the random model's default, id 2, which the byte-level tokenizer decodes to '#'."""
    shutil.copytree(src_dir, dst_dir, dirs_exist_ok=True)
    config = json.loads((dst_dir / "config.json").read_text())
    config["eos_token_id"] = eos
    (dst_dir / "config.json").write_text(json.dumps(config))
    return str(dst_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """`core_in_process`: the engine core in a thread of this process instead of its own process, so a
    test can reach into it (`.core`, e.g. to inject a fault); everything else is the same."""

    def __init__(self, model: str | None, *, model_name: str = "test-model", max_queue=None, api_key=None,
                 admin_token=None, drain_timeout: float = 10.0, limits=None, scheduling_policy: str = "fcfs",
                 core_in_process: bool = False, tool_call_parser: str = "auto", **engine_options):
        from iterserve.server.api.app import create_app
        from iterserve.server.engine.core_client import EngineClient
        from iterserve.server.entrypoints.serve_cmd import build_server_state, make_uvicorn_server

        engine_options.setdefault("kv_cache_memory", "8MiB")
        engine_options.setdefault("dtype", "float32")  # as tests/conftest.py's make_engine, for the same reason
        self.engine = EngineClient(EngineConfig(model=model, **engine_options), in_process=core_in_process)
        self.engine.start()
        self.core = self.engine.core
        self.state = build_server_state(self.engine, model_name, max_queue=max_queue, api_key=api_key,
                                        admin_token=admin_token, limits=limits, scheduling_policy=scheduling_policy,
                                        tool_call_parser=tool_call_parser)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_uvicorn_server(create_app(self.state), self.state, host="127.0.0.1", port=self.port,
                                          drain_timeout=drain_timeout, log_level="warning")
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self.state.engine.shutdown()
        self.state.prep_pool.shutdown(wait=False, cancel_futures=True)


def answers(url: str) -> bool:
    """`url` answers 200 (False while nothing listens there yet)."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def exited(proc: subprocess.Popen | None):
    """A `fail_if` for wait_until: the process's exit, once it has exited."""
    return lambda: None if proc is None or proc.poll() is None else f"the process exited with {proc.returncode}"


def wait_ready(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    wait_until(lambda: answers(f"{url}/ready"), timeout=timeout, what=f"{url} to be ready", interval=0.1,
               fail_if=exited(proc))


def wait_idle(url: str, timeout: float = 60.0) -> str:
    """Poll /metrics until nothing runs, waits or holds KV blocks; returns the last scrape."""
    def idle():
        text = httpx.get(url + "/metrics", timeout=10).text
        state = [metric_value(text, n) for n in
                 ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")]
        return text if state == [0, 0, 0] else None

    return wait_until(idle, timeout=timeout, what=f"{url} to be idle (nothing running, waiting or in KV)",
                      interval=0.1)


def start_subprocess(*args: str, env: dict | None = None, ready_timeout: float = 120.0
                     ) -> tuple[subprocess.Popen, str]:
    """`iterserve serve` in fp32 unless `args` name a --dtype: the tests size KV pools in bytes for fp32
    blocks (a pool that must preempt, a usage the scrape must see), and "auto" is bf16 on CPUs with it."""
    port = free_port()
    dtype = [] if any(a == "--dtype" or a.startswith("--dtype=") for a in args) else ["--dtype", "float32"]
    cmd = [sys.executable, "-m", "iterserve.server.entrypoints.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", *dtype, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout=ready_timeout, proc=proc)
    except BaseException:
        proc.kill()
        print(proc.communicate()[0])
        raise
    return proc, url


def metric_value(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (summed over series matching `labels`)."""
    from prometheus_client.parser import text_string_to_metric_families

    total, found = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(name)
    return total


def run_concurrent_clients(url: str, fn, n: int = 200, timeout: float = 120) -> None:
    """Run `await fn(client, i)` for i in range(n) at once, over one async OpenAI client."""
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=n + 50), timeout=timeout))
        try:
            await asyncio.gather(*(fn(client, i) for i in range(n)))
        finally:
            await client.close()

    asyncio.run(main())
