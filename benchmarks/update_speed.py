"""Speed and exactness of the policy update: per-leaf rows against packed trees, on the same trees.

    python benchmarks/update_speed.py                          # demo-sized scripted trees, tiny model
    python benchmarks/update_speed.py --prompts 4 --budget 16  # smaller
    python benchmarks/update_speed.py --run runs/demo --step 3 # the trees of a run folder, its policy
    python benchmarks/update_speed.py --model smollm2-135m --prompts 4 --budget 16
    python benchmarks/update_speed.py --quick                  # `make bench`: 4 prompts, 16 leaves, 1 round,
                                                               # bf16 only on a CPU with native bf16

Trees: without `--run`, one TRACE batch (`--prompts` prompts, `--budget` leaves, bare rollouts then
continuations from intermediate prefixes) of the `multihop` task sampled by the scripted engine of
tests/scripted_engine.py (searches, right and wrong answers; real env, real observations), tokenized for
the real model (`tiny`: the demo's shape, untrained; or `--model`), with the model's own log-probs as
the behaviour log-probs (an on-policy step). With `--run`, the step's trees from the run folder (their
recorded log-probs) and the run's policy (its warm start; `--checkpoint` also loads the latest weights).

Timed: the trainer's own update (`Trainer._update_policy`: forward, loss, backward, optimiser step,
with the run's mini-batches and micro-batches) from the same starting weights, `train.update=per_leaf`
and `packed` alternating `--repeat` times, best of each, in fp32 and under bf16 autocast. Checked in
the same run: per-token log-probs of both layouts (fp32, every trained token) and the gradients of the
same loss (one mini-batch). bf16: whether this CPU has native bf16 (AVX512-BF16 / AMX), the speed-up
over fp32 and how far bf16 moves log-probs and the gradient. `--dense-mask` also times the other exact
layout, a dense 4-D tree mask through the model's own attention. Prints one JSON object (`common.emit`).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from common import arguments, emit, parse_args

from trace_rl.models import native_bf16
from trace_rl.training.tree_attention import loss_token_logprobs

REPO = Path(__file__).resolve().parents[1]


def scripted_trees(model_name: str, prompts: int, budget: int, seed: int) -> tuple[list, object, object]:
    """(trees, policy, rollout config) of one TRACE batch sampled by the scripted engine."""
    sys.path.insert(0, str(REPO / "tests"))
    from scripted_engine import ScriptedEngine

    from trace_rl.agent.tasks import load_taskset
    from trace_rl.infra.config import load_config
    from trace_rl.models import load_policy
    from trace_rl.rollout.collector import TreeRolloutCollector
    from trace_rl.run import RunConfig, build_env, build_predictor

    config = load_config(RunConfig, None, [f"prompts_per_step={prompts}", f"rollout.budget={budget}", f"seed={seed}"])
    train = load_taskset("multihop", split="train", num_tasks=max(64, prompts), seed=0)
    env = build_env(config, train)
    if model_name == "tiny":
        policy = load_policy("tiny", seed=seed, tokenizer_texts=[p.text for p in train.corpus[:200]])
    else:
        policy = load_policy(model_name, seed=seed)

    def menu_for(context: str) -> tuple[str, ...]:
        task = next(t for t in train.tasks if t.question in context)
        return (
            f"<think>look it up</think>\n<search>{task.meta.get('start', task.question)}</search>",
            f"<think>look further</think>\n<search>{task.question}</search>",
            f"<think>sure</think>\n<answer>{task.answers[0]}</answer>",
            "<think>a guess</think>\n<answer>nobody</answer>",
        )

    engine = ScriptedEngine(policy.tokenizer, menu_for=menu_for)
    collector = TreeRolloutCollector(engine, policy.tokenizer, env, build_predictor(config), config.rollout, seed=seed)
    trees = collector.collect(train.tasks[:prompts]).trees
    return trees, policy, config


def set_on_policy(model, trees, temperature: float) -> None:
    """Behaviour log-probs := the model's own (fp32), as if it had sampled the turns: an on-policy step."""
    from trace_rl.models import token_logprobs

    for tree in trees:
        for tip in (n.id for n in tree.nodes if not n.children):
            path = tree.path(tip)
            ids = [t for i in path for t in tree.nodes[i].token_ids]
            with torch.no_grad():
                lp = [0.0, *token_logprobs(model, torch.tensor([ids]), temperature=temperature)[0].tolist()]
            start = 0
            for i in path:
                node = tree.nodes[i]
                node.logprobs = [v if m else 0.0 for v, m in zip(lp[start : start + len(node.token_ids)], node.mask)]
                start += len(node.token_ids)


def run_trees(folder: Path, step: int | None, checkpoint: bool) -> tuple[list, object, object]:
    from trace_rl.core.tree import read_jsonl
    from trace_rl.infra.config import load_config
    from trace_rl.models import load_policy
    from trace_rl.run import RunConfig, policy_source
    from trace_rl.storage.rundir import RunDir

    run = RunDir(folder)
    config = load_config(RunConfig, run.config_path, [])
    files = sorted((folder / "trees").glob("step_*.jsonl"))
    if not files:
        raise SystemExit(f"{folder} has no trees/step_*.jsonl")
    path = run.trees_path(step) if step is not None else files[0]
    policy = load_policy(policy_source(config), seed=config.seed, dtype=config.model.dtype)
    if checkpoint:
        policy.model.load_state_dict(run.load_checkpoint()["model"])
    return read_jsonl(path), policy, config


def make_trainer(model, config, *, update: str, precision: str, **train):
    from trace_rl.training.trainer import Trainer, TrainingSetup

    class Engine:
        accepts_weights, weight_version = True, 0

        def update_weights(self, model, *, version):
            self.weight_version = version

    cfg = copy.deepcopy(config.train)
    cfg.update, cfg.precision = update, precision
    for key, value in train.items():
        setattr(cfg, key, value)
    setup = TrainingSetup(
        method=config.rollout.spec, model=model, engine=Engine(), collector=SimpleNamespace(config=config.rollout),
        predictor=None, train_tasks=[], test_tasks=[], prompts_per_step=1, seed=config.seed,
    )
    return Trainer(cfg, setup, tempfile.mkdtemp(prefix="update-speed-"))


def timed_updates(model, config, sequences, *, precision: str, repeat: int) -> dict[str, dict[str, float]]:
    """Best wall and CPU seconds of `_update_policy` per layout, from the same weights each time."""
    start = copy.deepcopy(model.state_dict())
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeat):
        for update in ("per_leaf", "packed"):
            model.load_state_dict(start)
            trainer = make_trainer(model, config, update=update, precision=precision)
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = trainer._update_policy(sequences)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            row = best.setdefault(update, {"wall_s": float("inf"), "cpu_s": float("inf")})
            row["wall_s"], row["cpu_s"] = min(row["wall_s"], wall), min(row["cpu_s"], cpu)
            row["tokens_forward"] = metrics["actor/tokens_forward"]
            row["ratio_mean"] = metrics["actor/ratio_mean"]
            row["pg_loss"] = metrics["actor/pg_loss"]
    model.load_state_dict(start)
    return best


def gradient(model, config, sequences, *, update: str, precision: str) -> torch.Tensor:
    """The gradient of the step's whole loss (one mini-batch), from the current weights (left as they were)."""
    start = copy.deepcopy(model.state_dict())
    trainer = make_trainer(model, config, update=update, precision=precision, mini_batches=1, epochs=1, grad_clip=1e12)
    trainer._update_policy(sequences)
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]).clone()
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    return grads


def dense_mask_check(model, sequences, *, temperature: float, max_len: int, repeat: int) -> dict[str, float]:
    """The alternative: the same packs, one per row, through the model's own attention with a dense
    (B, 1, N, N) tree mask (transformers passes a 4-D mask through as it is: bool for sdpa, additive
    float for eager). Forward + backward of the summed log-probs, against the packed layout's."""
    from trace_rl.training.sequences import pack_batch, pack_tree, tree_groups
    from trace_rl.training.tree_attention import packed_token_logprobs

    packs = [p for g in tree_groups(sequences) for p in pack_tree(g, max_len=max_len, zero_advantage=True)]
    eager = model.config._attn_implementation == "eager"

    def dense() -> torch.Tensor:
        out = []
        for first in range(0, len(packs), 8):
            rows = packs[first : first + 8]
            n = max(p.size for p in rows)
            ids = torch.zeros(len(rows), n, dtype=torch.long)
            pos = torch.zeros(len(rows), n, dtype=torch.long)
            allow = torch.eye(n, dtype=torch.bool).repeat(len(rows), 1, 1, 1)  # padding attends to itself
            for r, pack in enumerate(rows):
                ids[r, : pack.size] = torch.tensor(pack.token_ids)
                pos[r, : pack.size] = torch.tensor(pack.positions)
                for start, end, parent in pack.nodes:
                    allow[r, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
                    up = parent
                    while up >= 0:
                        a, b, up = pack.nodes[up]
                        allow[r, 0, start:end, a:b] = True
            mask = torch.zeros(allow.shape).masked_fill(~allow, torch.finfo(torch.float32).min) if eager else allow
            logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits.float() / temperature
            for r, pack in enumerate(rows):
                lp = torch.log_softmax(logits[r, torch.tensor(pack.sources)], -1)
                out.append(lp.gather(-1, torch.tensor(pack.targets)[:, None]).squeeze(-1))
        return torch.cat(out)

    def packed() -> torch.Tensor:
        out = []
        for first in range(0, len(packs), 8):
            b = pack_batch(packs[first : first + 8])
            out.append(packed_token_logprobs(model, b.input_ids, b.position_ids, b.nodes, b.sources, b.targets, temperature=temperature))
        return torch.cat(out)

    result: dict[str, float] = {}
    values = {}
    for name, run in (("dense_mask", dense), ("packed", packed)):
        best = float("inf")
        for _ in range(repeat):
            model.zero_grad(set_to_none=True)
            cpu = time.process_time()
            lp = run()
            lp.sum().backward()
            best = min(best, time.process_time() - cpu)
        values[name] = lp.detach()
        result[f"{name}_cpu_s"] = round(best, 3)
    model.zero_grad(set_to_none=True)
    result["logprob_max_abs_diff"] = float((values["dense_mask"] - values["packed"]).abs().max())
    result["packed_speedup_cpu"] = round(result["dense_mask_cpu_s"] / result["packed_cpu_s"], 2)
    return result


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a.double(), b.double()) / (a.double().norm() * b.double().norm()).clamp_min(1e-30))


def tree_stats(trees, sequences) -> dict[str, float]:
    from trace_rl.training.sequences import pack_tree, tree_groups

    unique = sum(p.size for g in tree_groups(sequences) for p in pack_tree(g, zero_advantage=True))
    return {
        "trees": len(trees),
        "leaves": int(sum(len(t.leaves()) for t in trees)),
        "nodes": int(sum(len(t.nodes) for t in trees)),
        "max_depth": int(max(n.depth for t in trees for n in t.nodes)),
        "sequences": len(sequences),
        "per_leaf_tokens": int(sum(len(s.token_ids) for s in sequences)),
        "packed_tokens": int(unique),
        "longest_sequence": int(max(len(s.token_ids) for s in sequences)),
        "observation_token_share": round(
            float(sum(m == 0 for t in trees for n in t.nodes[1:] for m in n.mask) / max(1, sum(len(n.mask) for t in trees for n in t.nodes[1:]))), 3
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (the demo's shape, untrained) or a load_policy name / folder")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", type=Path, help="read the trees of this run folder instead (and load its policy)")
    parser.add_argument("--step", type=int, help="with --run: the step whose trees to read (default the first)")
    parser.add_argument("--checkpoint", action="store_true", help="with --run: load the run's latest weights")
    parser.add_argument("--repeat", type=int, default=2, help="timed rounds per layout and precision (best is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 measurements")
    parser.add_argument("--dense-mask", action="store_true", help="also time a dense 4-D tree mask through the model's own attention")
    # quick: bf16 only where the CPU has it natively (emulated, it takes minutes)
    args = parse_args(parser, argv, prompts=4, budget=16, repeat=1, no_bf16=not any(native_bf16().values()))
    torch.set_num_threads(args.threads)

    from trace_rl.core.advantage import get_estimator
    from trace_rl.training.sequences import tree_sequences

    if args.run:
        trees, policy, config = run_trees(args.run, args.step, args.checkpoint)
    else:
        trees, policy, config = scripted_trees(args.model, args.prompts, args.budget, args.seed)
    model = policy.model.float()
    temperature, max_len = config.rollout.temperature, config.rollout.max_context_tokens
    if not args.run:
        set_on_policy(model, trees, temperature)
    estimator = config.train.advantage or config.rollout.spec.estimator
    sequences = tree_sequences(trees, get_estimator(estimator)(trees, **config.train.advantage_options))

    # exactness, fp32: per-token log-probs and the gradient of the same loss both ways
    leaf_lp = loss_token_logprobs(model, sequences, packed=False, temperature=temperature, max_len=max_len, dtype=None)
    packed_lp = loss_token_logprobs(model, sequences, packed=True, temperature=temperature, max_len=max_len, dtype=None)
    g_leaf = gradient(model, config, sequences, update="per_leaf", precision="fp32")
    g_packed = gradient(model, config, sequences, update="packed", precision="fp32")
    exact = {
        "tokens_compared": int(leaf_lp.numel()),
        "logprob_max_abs_diff": float((leaf_lp - packed_lp).abs().max()),
        "logprob_within_1e-5": bool(torch.allclose(leaf_lp, packed_lp, atol=1e-5, rtol=0.0)),
        "grad_max_abs_diff": float((g_leaf - g_packed).abs().max()),
        "grad_max_abs": float(g_leaf.abs().max()),
        "grad_rel_diff_norm": float((g_leaf - g_packed).norm() / g_leaf.norm().clamp_min(1e-30)),
        "grad_cosine": cosine(g_leaf, g_packed),
    }

    path_tokens = sum(len(s.token_ids) for s in sequences)

    def summary(times: dict[str, dict[str, float]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for update, row in times.items():
            out[update] = {
                "wall_s": round(row["wall_s"], 3),
                "cpu_s": round(row["cpu_s"], 3),
                "tokens_forward": int(row["tokens_forward"]),
                "forward_tokens_per_s": round(row["tokens_forward"] / row["wall_s"], 1),
                "path_tokens_per_s": round(path_tokens / row["wall_s"], 1),
                "ratio_mean": round(row["ratio_mean"], 6),
            }
        out["speedup_wall"] = round(times["per_leaf"]["wall_s"] / times["packed"]["wall_s"], 2)
        out["speedup_cpu"] = round(times["per_leaf"]["cpu_s"] / times["packed"]["cpu_s"], 2)
        return out

    fp32 = timed_updates(model, config, sequences, precision="fp32", repeat=args.repeat)
    config_info = {
        **arguments(args),
        "model": args.model if not args.run else str(args.run),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "attn_implementation": model.config._attn_implementation,
        "train": {k: getattr(config.train, k) for k in ("mini_batches", "micro_batch_size", "epochs", "kl_coef")},
        "estimator": estimator,
    }
    result: dict[str, object] = {
        "batch": tree_stats(trees, sequences),
        "exact_fp32": exact,
        "fp32": summary(fp32),
    }

    if args.dense_mask:
        result["dense_mask_fp32"] = dense_mask_check(model, sequences, temperature=temperature, max_len=max_len, repeat=args.repeat)

    native = native_bf16()
    if not args.no_bf16:
        bf16 = timed_updates(model, config, sequences, precision="bf16", repeat=args.repeat)
        bf_leaf = loss_token_logprobs(model, sequences, packed=False, temperature=temperature, max_len=max_len, dtype=torch.bfloat16)
        bf_packed = loss_token_logprobs(model, sequences, packed=True, temperature=temperature, max_len=max_len, dtype=torch.bfloat16)
        g_bf16 = gradient(model, config, sequences, update="packed", precision="bf16")
        result["bf16"] = {
            **summary(bf16),
            "cpu": native,
            "speedup_over_fp32_packed": round(fp32["packed"]["wall_s"] / bf16["packed"]["wall_s"], 2),
            "speedup_over_fp32_per_leaf": round(fp32["per_leaf"]["wall_s"] / bf16["per_leaf"]["wall_s"], 2),
            "logprob_vs_fp32_max_abs_diff": float((bf_packed - leaf_lp).abs().max()),
            "logprob_vs_fp32_mean_abs_diff": float((bf_packed - leaf_lp).abs().mean()),
            "per_leaf_logprob_vs_fp32_max_abs_diff": float((bf_leaf - leaf_lp).abs().max()),
            "packed_vs_per_leaf_bf16_max_abs_diff": float((bf_packed - bf_leaf).abs().max()),
            "ratio_vs_fp32_max_abs_diff": float((torch.exp(bf_packed - leaf_lp) - 1).abs().max()),
            "grad_cosine_vs_fp32": cosine(g_bf16, g_leaf),
            "grad_rel_diff_norm_vs_fp32": float((g_bf16 - g_leaf).norm() / g_leaf.norm().clamp_min(1e-30)),
        }
    else:
        result["bf16"] = {"cpu": native}
    speedup = {"fp32": result["fp32"]["speedup_wall"]}
    if "speedup_wall" in result["bf16"]:
        speedup["bf16"] = result["bf16"]["speedup_wall"]
    emit("update_speed", config=config_info, results=result, baseline="train.update=per_leaf: every leaf's full path, same trees and weights", speedup=speedup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
