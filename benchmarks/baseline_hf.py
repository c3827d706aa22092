"""Baseline: HF transformers `generate`, fp32, one request at a time (no batching).

Reports the same dict shape as peer_vllm.run_vllm so the harness can tabulate both.
"""

from __future__ import annotations

import argparse
import json
import time


def run_hf_sequential(workload, model_dir, num_threads: int = 2, limit: int | None = None) -> dict:
    """Generate each request alone with greedy decoding; model loading is timed apart and excluded.

    With `limit`, only the first `limit` requests run and every figure (num_requests included)
    covers just those: nothing is extrapolated to the full workload.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(num_threads)
    items = list(workload)[:limit] if limit is not None else list(workload)

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    startup_s = time.perf_counter() - start

    prompt_tokens = generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for item in items:
            inputs = tokenizer(item.prompt, return_tensors="pt")
            # min_new_tokens = max_new_tokens suppresses EOS, the HF equivalent of vLLM's ignore_eos.
            out = model.generate(
                **inputs,
                max_new_tokens=item.max_tokens,
                min_new_tokens=item.max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            prompt_tokens += inputs.input_ids.shape[1]
            generated += out.shape[1] - inputs.input_ids.shape[1]
    seconds = time.perf_counter() - start

    return {
        "engine": "hf-transformers",
        "version": transformers.__version__,
        "num_requests": len(items),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "seconds": seconds,
        "generated_tok_per_s": generated / seconds,
        "startup_s": startup_s,
        "threads": num_threads,
    }


def main() -> None:
    if __package__:
        from .offline_workload import make_workload
        from .prepare_model import prepare_hf_model
    else:  # run as a file: its folder is on sys.path
        from offline_workload import make_workload
        from prepare_model import prepare_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None, help="run only the first N requests of the workload")
    args = parser.parse_args()
    workload = make_workload(args.num_prompts)
    print(json.dumps(run_hf_sequential(workload, prepare_hf_model(), args.threads, args.limit)))


if __name__ == "__main__":
    main()
