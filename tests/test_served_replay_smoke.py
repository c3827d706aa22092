"""benchmarks/served_replay.py on the tiny model: every request generates its length, the steps split
into prompt-carrying and decode-only ones account for every token, and the command line writes its JSON."""

import json

from benchmarks.served_replay import main, replay
from iterserve.bench.workload import WorkloadSpec, generate_requests
from iterserve.server.entrypoints.llm import LLM


def test_replay_accounts_for_every_token(tiny_dir):
    llm = LLM(model=tiny_dir, max_model_len=128, dtype="float32", kv_cache_memory="8MiB")
    spec = WorkloadSpec(shape="mixed", seed=3, max_model_len=128)
    requests = list(generate_requests(spec, 10))
    result = replay(llm, spec, 10, 4)
    assert result["requests"] == 10
    assert result["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert result["generated_tokens"] == sum(r.max_tokens for r in requests)
    steps = result["steps"]
    assert steps["prompt"]["count"] >= 1 and steps["decode"]["count"] >= 1
    # a step's tokens are those it fed the model: every prompt token, and every generated token but
    # each request's last (no prefix is shared: the prompts are random)
    assert steps["prompt"]["tokens"] + steps["decode"]["tokens"] == (result["prompt_tokens"]
                                                                     + result["generated_tokens"] - 10)
    assert steps["decode"]["tokens"] >= steps["decode"]["count"]  # a decode step generates for each request


def test_command_line_writes_json(tiny_dir, tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert main(["--model", tiny_dir, "--requests", "6", "--concurrency", "3", "--max-model-len", "128",
                 "--threads", "1", "--dtype", "float32", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["requests"] == 6 and figures["args"]["concurrency"] == 3
    assert "prompt steps" in capsys.readouterr().out
