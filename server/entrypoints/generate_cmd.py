"""`iterserve generate`: offline generation for prompts on the command line or in a JSONL file."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.entrypoints.cli_args import add_engine_args, engine_config_from_args
from iterserve.server.errors import InvalidRequestError


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions offline",
                       description="Generate completions for prompts, batched by the engine.")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help='JSONL file, one {"prompt": ...} per line (optional "max_tokens", "temperature", "seed")')
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    add_engine_args(p)
    p.set_defaults(run=run)


def _read_items(args) -> list[dict]:
    items = [{"prompt": p} for p in args.prompt]
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError("prompts_file", f"line {lineno}: invalid JSON ({e.msg})") from None
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise InvalidRequestError("prompts_file", f'line {lineno}: expected {{"prompt": "..."}}')
                items.append(item)
    if not items:
        raise InvalidRequestError("prompt", "give --prompt or --prompts-file")
    return items


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        items = _read_items(args)
        params = [
            SamplingParams(
                max_tokens=item.get("max_tokens", args.max_tokens),
                temperature=item.get("temperature", args.temperature),
                top_p=args.top_p,
                top_k=args.top_k,
                seed=item.get("seed", args.seed),
                stop=args.stop,
                ignore_eos=args.ignore_eos,
            )
            for item in items
        ]
        config = engine_config_from_args(args)
        from iterserve.server.entrypoints.llm import LLM  # imports torch: only once the arguments are good

        llm = LLM(config=config)
        prompts = [item["prompt"] for item in items]
        if args.chat:
            ids = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in prompts]
            outputs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=args.progress)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=args.progress)
    except (InvalidRequestError, FileNotFoundError, ValueError) as e:
        print(f"iterserve generate: error: {e}", file=sys.stderr)
        return 2
    for item, out in zip(items, outputs, strict=True):
        if args.json:
            print(json.dumps({
                "prompt": item["prompt"],
                "text": out.text,
                "token_ids": out.token_ids,
                "num_prompt_tokens": len(out.prompt_token_ids),
                "finish_reason": out.finish_reason,
            }, ensure_ascii=False))
        else:
            print(f"--- {item['prompt']!r} ({out.finish_reason}, {len(out.token_ids)} tokens)\n{out.text}")
    return 0
