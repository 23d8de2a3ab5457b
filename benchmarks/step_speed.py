"""Speed of a real training step: today's path against the previous one, on the same config and seeds.

    python benchmarks/step_speed.py                        # configs/demo.yaml, 1 step each way
    python benchmarks/step_speed.py --steps 2 --config configs/demo.yaml key=value ...
    python benchmarks/step_speed.py --quick                # `make bench`: configs/smoke.yaml, a small decode check

Both runs start from the same (warm-started) policy, seed and tasks, so their first step does the
same work: `previous` re-prefills every turn's whole history (`engine.prefix_cache_mb=0`) and runs
every leaf's full path through the update (`train.update=per_leaf`, where the trainer has it);
`current` is the config as it is. The previous path runs on `--previous-threads` (1: the demo's
setting when the issue measured it); where the config uses more (`model.cpu_threads`), the current
path is also timed on those (`current_previous_threads`, ratio `step_same_threads`), so the gain of
the code and that of the cores read apart. Prints one JSON object: per path the step's time split
(gen / env / update / predictor / alloc), generated tokens/s, prefill tokens against the prompt and
observation tokens, update tokens/s, and the ratios; then the decode loop against a bare forward
loop of the same model and batch (the hardware bound), with the FLOP bound beside it (2 × parameters
per token at this machine's measured matmul rate). The JSON's shape is the suite's (`common.emit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import arguments, emit, parse_args
from hardware import matmul_gflops

from trace_rl.infra.config import load_config
from trace_rl.run import RunConfig, build_parts, build_trainer

SPLIT = ("timing_s/gen", "timing_s/env", "timing_s/update", "timing_s/predictor", "timing_s/alloc", "timing_s/step")


def run_path(config: RunConfig, steps: int) -> dict[str, float]:
    parts = build_parts(config)
    with tempfile.TemporaryDirectory() as folder:
        trainer = build_trainer(config, parts, Path(folder))
        rows = [trainer.train_step() for _ in range(steps)]
    mean = {key: sum(r.get(key, 0.0) for r in rows) / steps for key in rows[0]}
    out = {key.removeprefix("timing_s/"): round(mean.get(key, 0.0), 3) for key in SPLIT}
    generated, prefill = mean["rollout/tokens_generated"], mean["rollout/tokens_prefill"]
    out.update(
        tokens_generated=generated,
        tokens_prefill=prefill,
        tokens_observation=mean["rollout/tokens_observation"],
        tokens_prompt=mean["rollout/tokens_prompt"],
        gen_tokens_per_s=round(generated / max(mean["timing_s/gen"], 1e-9), 1),
        update_tokens_per_s=round(mean.get("actor/tokens_forward", 0.0) / max(mean["timing_s/update"], 1e-9), 1),
        step_rows=[{k: r[k] for k in ("critic/score/mean", "tree/effective_ratio") if k in r} for r in rows],
    )
    return out


def decode_bound(config: RunConfig, batch: int = 64, prompt: int = 256, new: int = 48, rounds: int = 3) -> dict[str, float]:
    """Our decode loop at `batch` sequences against a bare loop of forwards with a KV cache (same model,
    engine precision, shapes and steps, no sampling or bookkeeping; best of `rounds` each), and the FLOP
    bound at the matmul rate measured in that precision."""
    from trace_rl.engine.base import SamplingParams
    from trace_rl.engine.hf import HFEngine

    parts = build_parts(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=0)))
    model = parts.policy.model
    engine = HFEngine.from_policy(parts.policy, max_batch_size=batch, prefix_cache_mb=0, precision=config.engine.generation_precision)
    vocab = engine.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (batch, prompt), generator=generator).tolist()
    params = SamplingParams(n=1, max_new_tokens=new, seed=0, ignore_eos=True)
    from trace_rl.engine.hf import buffered_cache

    def ours() -> float:
        begin = time.perf_counter()
        engine.generate(prompts, params)
        return time.perf_counter() - begin

    @torch.no_grad()
    def bare() -> float:  # the same model calls on the same cache layout, and nothing else
        ids, mask = torch.tensor(prompts), torch.ones(batch, prompt, dtype=torch.long)
        positions = torch.arange(prompt)[None].expand(batch, -1)
        begin = time.perf_counter()
        cache = buffered_cache(model.config, prompt + new)
        logits = engine._forward(ids, mask, positions, cache)
        for step in range(new - 1):
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
            logits = engine._forward(token, mask, torch.full((batch, 1), prompt + step), cache)
        return time.perf_counter() - begin

    timings = {"ours": [], "bare": []}
    for _ in range(rounds):  # alternate, keep the best of each: these machines are noisy
        timings["ours"].append(ours())
        timings["bare"].append(bare())
    ours_s, bare_s = min(timings["ours"]), min(timings["bare"])

    flops = matmul_gflops(dtype=torch.bfloat16 if engine.precision == "bf16" else torch.float32) * 1e9
    params_count = sum(p.numel() for p in model.parameters())
    tokens = batch * (prompt + new)
    return {
        "precision": engine.precision,
        "batch": batch,
        "prompt_tokens": prompt,
        "new_tokens": new,
        "decode_loop_s": round(ours_s, 3),
        "bare_forward_loop_s": round(bare_s, 3),
        "decode_vs_bare": round(bare_s / ours_s, 3),
        "decode_tokens_per_s": round(batch * new / ours_s, 1),
        "matmul_gflops": round(flops / 1e9, 2),
        "flop_bound_s": round(2 * params_count * tokens / flops, 3),
        "parameters": params_count,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--steps", type=int, default=1, help="training steps timed per path (default 1)")
    parser.add_argument("--previous-threads", type=int, default=1, help="torch threads of the previous path (default 1, the demo's before it used both cores)")
    parser.add_argument("--decode-batch", type=int, default=64, help="sequences of the decode-loop check")
    parser.add_argument("--decode-prompt", type=int, default=256, help="prompt tokens a sequence there")
    parser.add_argument("--decode-new", type=int, default=48, help="new tokens a sequence there")
    parser.add_argument("--decode-rounds", type=int, default=3, help="timed rounds of each loop (best kept)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides for both paths")
    args = parse_args(parser, argv, config="configs/smoke.yaml", decode_batch=16, decode_prompt=128, decode_new=16, decode_rounds=1)
    base = [*args.overrides, "train.eval_every=0", "train.save_trees=false"]
    current = load_config(RunConfig, args.config, base)
    previous_overrides = [*base, "engine.prefix_cache_mb=0", f"model.cpu_threads={args.previous_threads}"]
    if "update" in {f.name for f in dataclasses.fields(current.train)}:
        previous_overrides.append("train.update=per_leaf")
    previous = load_config(RunConfig, args.config, previous_overrides)
    threads = current.model.cpu_threads
    result: dict[str, object] = {}
    result["previous"] = run_path(previous, args.steps)  # build_parts sets each path's threads
    result["current"] = run_path(current, args.steps)
    p, c = result["previous"], result["current"]
    same = {}
    if threads != args.previous_threads:  # the code's own gain: today's path on the previous path's threads
        result["current_previous_threads"] = run_path(load_config(RunConfig, args.config, [*base, f"model.cpu_threads={args.previous_threads}"]), args.steps)
        same = {"step_same_threads": round(p["step"] / result["current_previous_threads"]["step"], 3)}
    result["ratios"] = {
        "step": round(p["step"] / c["step"], 3),
        **same,
        "gen": round(p["gen"] / c["gen"], 3),
        "update": round(p["update"] / max(c["update"], 1e-9), 3),
        "prefill_tokens": round(p["tokens_prefill"] / max(c["tokens_prefill"], 1), 3),
        "prefill_vs_prompt_and_observation": round(c["tokens_prefill"] / max(c["tokens_observation"] + c["tokens_prompt"], 1), 3),
    }
    result["decode"] = decode_bound(current, args.decode_batch, args.decode_prompt, args.decode_new, args.decode_rounds)
    emit(
        "step_speed",
        config={**arguments(args), "threads": threads, "previous_threads": args.previous_threads},
        results=result,
        baseline=f"previous: engine.prefix_cache_mb=0, train.update=per_leaf, {args.previous_threads} thread(s)",
        speedup={key: result["ratios"][key] for key in ("step", "step_same_threads", "gen", "update") if key in result["ratios"]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
