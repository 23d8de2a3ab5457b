"""Generation speed on the multi-turn tree workload training runs: one collected batch, one engine.

    python benchmarks/engine_tree_workload.py --model smollm2-135m                      # hf engine
    scripts/vllm_cpu_server.sh "$(python -c 'from trace_rl.models import convert_smollm2; print(convert_smollm2())')" 8000 &
    python benchmarks/engine_tree_workload.py --model smollm2-135m --url http://127.0.0.1:8000   # vllm-cpu
    python benchmarks/engine_tree_workload.py --quick      # `make bench`: the tiny model, 2 tasks, 8 leaves

A TRACE batch on `multihop` (bare rollouts, then continuations from intermediate prefixes, tools in
the loop) with the given model, untrained for the tools (its turns are mostly malformed, which the env
answers with error observations, so every rollout still runs its turns). Prints one JSON object
(`common.emit`): generated tokens, tokens the engine prefilled, generation time and tokens/s. It times
one engine, so its `baseline` is null: the same command with `--url` runs the same workload through an
OpenAI-compatible server (vLLM / SGLang), whose prefix cache plays the part of the hf engine's, and
`real_lm_step.py --vllm` runs both in one run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from common import arguments, emit, parse_args

from trace_rl.agent.env import ToolEnv
from trace_rl.agent.tasks import load_taskset
from trace_rl.engine.hf import HFEngine
from trace_rl.engine.openai_server import OpenAIEngine
from trace_rl.models import load_policy
from trace_rl.predictor import HashedNgramPredictor
from trace_rl.rollout.collector import RolloutConfig, TreeRolloutCollector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--url", help="an OpenAI-compatible server serving the same model (default: the hf engine)")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-cache-mb", type=float, default=1024.0, help="hf engine only (0: off)")
    parser.add_argument("--precision", default="fp32", choices=("auto", "fp32", "bf16"), help="hf engine only")
    args = parse_args(parser, argv, model="tiny", tasks=2, budget=8, max_new_tokens=16, threads=1)
    torch.set_num_threads(args.threads)
    taskset = load_taskset("multihop", split="train", num_tasks=args.tasks, seed=0)
    env = ToolEnv.for_taskset(taskset, max_turns=4, topk=2, max_observation_chars=1500)
    policy = load_policy(args.model, seed=0)
    if args.url:
        engine = OpenAIEngine(args.url, model="policy")
    else:
        engine = HFEngine.from_policy(policy, prefix_cache_mb=args.prefix_cache_mb, precision=args.precision)
    config = RolloutConfig(method="trace", budget=args.budget, max_new_tokens=args.max_new_tokens, max_context_tokens=2048)
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, HashedNgramPredictor(), config, seed=0)
    begin = time.perf_counter()
    batch = collector.collect(taskset.tasks)
    wall = time.perf_counter() - begin
    stats = batch.stats
    emit(
        "engine_tree_workload",
        config=arguments(args),
        results={
            "engine": "openai" if args.url else "hf",
            "precision": None if args.url else engine.precision,
            "leaves": stats["rollout/leaves"],
            "tokens_generated": stats["rollout/tokens_generated"],
            "tokens_prefill": stats["rollout/tokens_prefill"],
            "tokens_prompt_and_observation": stats["rollout/tokens_prompt"] + stats["rollout/tokens_observation"],
            "gen_s": round(stats["timing_s/gen"], 3),
            "wall_s": round(wall, 3),
            "gen_tokens_per_s": round(stats["rollout/tokens_generated"] / stats["timing_s/gen"], 1),
        },
        baseline=None,
        speedup=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
