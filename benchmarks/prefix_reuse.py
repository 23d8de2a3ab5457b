"""Tree rollouts with prefix reuse against regenerating every continuation from scratch.

Stage 2 continues intermediate prefixes (a prompt plus a few ReAct turns, a few hundred tokens)
k times each. With reuse, the `hf` engine prefills each prefix once and repeats its KV cache for
the k continuations (`generate(prefixes, n=k)`). From scratch, every continuation is its own
prompt and is prefilled separately (`generate(each prefix k times, n=1)`). Both arms decode the
same number of sequences in one batch for the same number of tokens (EOS ignored), and with the
engine's per-sample seeding they even draw the same tokens (`same_samples`).

Prints one JSON object (`common.emit`): generated tokens per second in each arm and their ratio. The tiny
preset (random weights) takes about 15 s on 2 CPU cores; `--model smollm2-135m` about 3 minutes.
On a busy machine `--threads 1` gives steadier timings than torch's default thread count.

    python benchmarks/prefix_reuse.py [--model tiny|smollm2-135m] [--prefixes 4] [--k 8] [--quick]

`--quick` (`make bench`): 2 prefixes of 100-200 tokens, 4 continuations of 16 tokens, one timed run, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from common import arguments, emit, parse_args

from trace_rl.engine.base import SamplingParams
from trace_rl.engine.hf import HFEngine
from trace_rl.models import load_policy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a model folder")
    parser.add_argument("--prefixes", type=int, default=4, help="Stage-2 prefixes per batch")
    parser.add_argument("--k", type=int, default=8, help="continuations per prefix")
    parser.add_argument("--min-len", type=int, default=200, help="shortest prefix, tokens")
    parser.add_argument("--max-len", type=int, default=400, help="longest prefix, tokens")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens per continuation")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per arm (the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parse_args(parser, argv, prefixes=2, k=4, min_len=100, max_len=200, max_new_tokens=16, repeats=1, threads=1)
    if args.threads:
        torch.set_num_threads(args.threads)

    policy = load_policy(args.model, seed=args.seed)
    # No prefix cache: this measures sharing one prefill among the n samples of one call, alone.
    engine = HFEngine.from_policy(policy, max_batch_size=args.prefixes * args.k, prefix_cache_mb=0)
    rng = np.random.default_rng(args.seed)
    vocab = len(policy.tokenizer)
    lengths = rng.integers(args.min_len, args.max_len + 1, size=args.prefixes)
    prefixes = [rng.integers(4, vocab, size=int(n)).tolist() for n in lengths]  # ids 0-3: special tokens
    params = dict(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=True)
    shared = SamplingParams(n=args.k, **params)
    scratch = SamplingParams(n=1, **params)
    scratch_prompts = [p for p in prefixes for _ in range(args.k)]

    def run_shared() -> list[list[int]]:
        return [c.token_ids for group in engine.generate(prefixes, shared) for c in group]

    def run_scratch() -> list[list[int]]:
        return [group[0].token_ids for group in engine.generate(scratch_prompts, scratch)]

    run_shared(), run_scratch()  # warm up (allocator, kernels)
    times: dict[str, list[float]] = {"shared": [], "scratch": []}
    outputs = {}
    for _ in range(args.repeats):
        for name, fn in (("shared", run_shared), ("scratch", run_scratch)):
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)

    generated = sum(len(t) for t in outputs["shared"])
    assert generated == sum(len(t) for t in outputs["scratch"]) == args.prefixes * args.k * args.max_new_tokens
    seconds = {name: statistics.median(values) for name, values in times.items()}
    emit(
        "prefix_reuse",
        config={**arguments(args), "engine": "hf", "device": str(engine.device), "threads": torch.get_num_threads()},
        results={
            "prefix_tokens": [int(n) for n in lengths],
            "generated_tokens": generated,
            "prefill_tokens": {"shared": int(lengths.sum()), "scratch": int(lengths.sum()) * args.k},
            "seconds": {name: round(value, 4) for name, value in seconds.items()},
            "tokens_per_s": {name: round(generated / value, 1) for name, value in seconds.items()},
            "same_samples": outputs["shared"] == outputs["scratch"],
        },
        baseline="scratch: every continuation its own prompt, prefilled separately",
        speedup=round(seconds["scratch"] / seconds["shared"], 3),
    )


if __name__ == "__main__":
    main()
