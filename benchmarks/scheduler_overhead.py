"""What the engine costs around the model: scheduling and input preparation per step, no forward pass.

    python benchmarks/scheduler_overhead.py [--running 256] [--steps 300]

256 requests decode together (a 32-token prompt each, long outputs); each step is timed in three parts:
scheduler.schedule(), prepare_step_inputs() (what the model runner does before the forward pass),
and the rest of the step (appending tokens, stop checks, freeing). Medians over the steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from iterserve.common.wire import Knobs
from iterserve.server.engine.llm_engine import LLMEngine
from iterserve.server.engine.sampling_params import SamplingParams
from iterserve.server.runner.null_runner import NullModelRunner
from iterserve.server.runner.step_inputs import prepare_step_inputs


def measure_overhead(num_running: int = 256, steps: int = 300, block_size: int = 16) -> dict:
    runner = NullModelRunner(block_size, vocab_size=49152, prepare_inputs=False)
    engine = LLMEngine(runner, tokenizer=None, max_model_len=4096, num_blocks=num_running * 64,
                       block_size=block_size, knobs=Knobs(num_running, 32 * num_running, 32),
                       vocab_size=49152)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    for i in range(num_running):
        engine.add_request(prompt_token_ids=[(i * 7 + j) % 49152 for j in range(32)], sampling_params=params)
    while len(engine.scheduler.running) < num_running or engine.scheduler.waiting:
        engine.step()
    engine.step()  # everyone decodes from here on

    schedule_ms, prepare_ms, rest_ms = [], [], []
    device = torch.device("cpu")
    for _ in range(steps):
        t0 = time.perf_counter()
        out = engine.scheduler.schedule()
        t1 = time.perf_counter()
        prepare_step_inputs(out, block_size, device)
        t2 = time.perf_counter()
        engine.output_processor.process(engine.core._update(out, runner.execute_model(out)))
        t3 = time.perf_counter()
        assert len(out.scheduled) == num_running
        schedule_ms.append((t1 - t0) * 1e3)
        prepare_ms.append((t2 - t1) * 1e3)
        rest_ms.append((t3 - t2) * 1e3)
    med = statistics.median
    return {
        "num_running": num_running,
        "steps": steps,
        "schedule_ms_median": med(schedule_ms),
        "prepare_inputs_ms_median": med(prepare_ms),
        "schedule_and_prepare_ms_median": med(s + p for s, p in zip(schedule_ms, prepare_ms, strict=True)),
        "postprocess_ms_median": med(rest_ms),
        "engine_step_ms_median": med(s + p + r for s, p, r in zip(schedule_ms, prepare_ms, rest_ms, strict=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for key, value in measure_overhead(args.running, args.steps).items():
        print(f"{key:<34} {value:.3f}" if isinstance(value, float) else f"{key:<34} {value}")


if __name__ == "__main__":
    main()
