"""Does the native trainer run on a GPU, how fast, and do its log-probs there match the CPU's?

    bash scripts/gpu_check.sh                               # on a CUDA machine: JSON to $OUT/gpu_check.json
    python scripts/gpu_check.py --device cpu --layers 1 --steps 1 --quick   # the same path on a CPU (the test)

Made for the lent GPU machine, which has torch and transformers but no vLLM, Ray or verl, reaches no
hub, and takes at most 64 MiB of files a call: so no real weights travel there. Two models, each from
nothing but this repository:

- `tiny`: the preset (a Llama-style decoder of about 4M parameters from a seed) after smoke.yaml's
  10-step warm start;
- `smollm2_shaped`: SmolLM2-135M's architecture (`SMOLLM2`: 30 layers, hidden 576, 9 query and 3
  key/value heads, MLP 1536, a 49,152-token vocabulary tied to the embeddings) with random weights,
  and the `tiny` byte-level BPE padded with unused tokens to that vocabulary. Its rollouts are noise
  (a random model writes no tool call), so a turn runs to `rollout.max_new_tokens`: a heavier
  generation workload than a trained model's, which is what a speed check wants.

For each: `trace-rl train` for `--steps` steps on `configs/smoke.yaml` with `task.name=toolmath` (its
calculator runs in process; `multihop`'s search needs `bm25s`, which that machine lacks) and `model.device`
set (on CUDA the trainer's `auto` precisions mean bf16 generation and bf16 autocast in the update),
its per-step split, generated tokens per second, update tokens per second and on-policy ratio; then
the log-probs of its own saved rollouts, teacher-forced, on the device against the CPU in fp32
(TF32 off), in bf16 against the CPU's fp32, and the packed tree forward against the per-leaf one on
the device, each against the tolerance in `TOLERANCES`. One JSON object on the last line of stdout;
`ok` is whether every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trace_rl.core.advantage import NodeAdvantages
from trace_rl.core.tree import read_jsonl
from trace_rl.models.policy import build_tokenizer, load_policy
from trace_rl.storage.rundir import read_metrics
from trace_rl.training.sequences import tree_sequences
from trace_rl.training.tree_attention import loss_token_logprobs

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0,
           "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
"""SmolLM2-135M-Instruct's shape, as its config.json gives it."""

TOLERANCES = {"fp32_max_abs": 2e-3, "bf16_mean_abs": 0.05, "bf16_max_abs": 0.5, "packed_max_abs": 2e-3}
"""Log-prob agreement (nats, over the policy tokens of the saved rollouts): the device in fp32 against the
CPU in fp32 (different kernels, same arithmetic up to summation order), the device in bf16 against the
CPU's fp32 (bf16 keeps 8 bits of mantissa: a mean error of a few hundredths), and the packed tree forward
against each leaf's own forward on the device in fp32 (the bound the CPU tests hold it to)."""


def smollm2_shaped(folder: Path, *, layers: int, seed: int) -> Path:
    """A model folder with SmolLM2-135M's shape (`layers` of its 30), random weights from `seed`."""
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    tokenizer = build_tokenizer([])
    unused = SMOLLM2["vocab_size"] - len(tokenizer)
    tokenizer.add_tokens([AddedToken(f"<|unused_{i}|>", special=False, normalized=False) for i in range(unused)])
    config = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers}, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train(name: str, model: str, out: Path, device: str, steps: int, extra: list[str]) -> dict:
    """`trace-rl train` for `steps` steps on the device; its per-step figures."""
    command = [sys.executable, "-m", "trace_rl", "train", "--config", str(REPO / "configs" / "smoke.yaml"), "--out", str(out),
               "task.name=toolmath", f"model.name={model}", f"model.device={device}", f"train.steps={steps}",
               "train.eval_every=0", "train.eval_on_start=false", *extra]
    begin = time.perf_counter()
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - begin
    if done.returncode:
        return {"ok": False, "error": done.stderr[-2000:], "wall_s": round(wall, 1)}
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "timing_s/step" in r]
    per_step = [{
        "step_s": round(r["timing_s/step"], 3), "gen_s": round(r["timing_s/gen"], 3), "update_s": round(r["timing_s/update"], 3),
        "gen_tokens_per_s": round(r["rollout/tokens_generated"] / max(r["timing_s/gen"], 1e-9), 1),
        "update_tokens_per_s": round(r.get("actor/tokens_forward", 0.0) / max(r["timing_s/update"], 1e-9), 1),
        "ratio_mean": r.get("actor/ratio_mean"), "leaves": r["rollout/leaves"],
    } for r in rows]
    ratios = [s["ratio_mean"] for s in per_step if s["ratio_mean"] is not None]
    return {"ok": len(rows) == steps and all(0.99 <= r <= 1.01 for r in ratios), "wall_s": round(wall, 1), "steps": per_step}


def logprob_checks(model_dir: str, run: Path, device: str, *, max_leaves: int = 16) -> dict:
    """Teacher-forced log-probs of the run's last saved rollouts: device against CPU, bf16 against fp32,
    packed against per leaf (see `TOLERANCES`)."""
    trees = read_jsonl(max(run.glob("trees/step_*.jsonl")))
    ones = [NodeAdvantages(advantage=[1.0] * len(t.nodes), weight=[1.0] * len(t.nodes)) for t in trees]
    sequences = tree_sequences(trees, ones)[:max_leaves]

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        cpu = loss_token_logprobs(load_policy(model_dir).model, sequences, packed=False, rows=1)
        on_device = load_policy(model_dir, device=device).model
        fp32 = loss_token_logprobs(on_device, sequences, packed=False, rows=1)
        bf16 = loss_token_logprobs(load_policy(model_dir, device=device, dtype="bfloat16").model, sequences, packed=False, rows=1)
        packed = loss_token_logprobs(on_device, sequences, packed=True, pack_tokens=1 << 30)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    figures = {
        "tokens": int(cpu.numel()),
        "fp32_max_abs": float((fp32 - cpu).abs().max()),
        "bf16_mean_abs": float((bf16 - cpu).abs().mean()),
        "bf16_max_abs": float((bf16 - cpu).abs().max()),
        "packed_max_abs": float((packed - fp32).abs().max()) if packed.shape == fp32.shape else float("inf"),
    }
    figures["ok"] = all(figures[key] <= bound for key, bound in TOLERANCES.items())
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per model (default 3)")
    parser.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"], help="layers of the SmolLM2-shaped model (default its 30)")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "gpu_check", help="folder for the runs and the random model")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="a smaller SmolLM2-shaped workload (4 prompts x 2 rollouts of 16 tokens a turn)")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    found: dict = {"bench": "gpu_check", "device": args.device, "torch": torch.__version__, "tolerances": TOLERANCES}
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print(json.dumps({**found, "ok": False, "error": "no CUDA device"}))
            return 1
        found["gpu"] = torch.cuda.get_device_name(0)
        found["bf16_supported"] = torch.cuda.is_bf16_supported()
    import transformers

    found["transformers"] = transformers.__version__
    shaped = smollm2_shaped(args.work / f"smollm2_shaped_{args.layers}", layers=args.layers, seed=0)
    # Both models' rewards are all or nearly all 0, so few groups have a contrast: a small KL term puts every
    # token in the update anyway (with its reference model), which is what timing the update needs.
    shape = ["prompts_per_step=4", "rollout.budget=8", "rollout.max_new_tokens=16"] if args.quick else \
        ["prompts_per_step=8", "rollout.budget=32", "rollout.max_new_tokens=64"]
    models = {
        "tiny": ("tiny", ["train.kl_coef=0.001"]),  # smoke.yaml's warm start (10 steps) first: the trainer refuses an untrained tiny
        "smollm2_shaped": (str(shaped), ["model.warm_start=false", "train.kl_coef=0.001", *shape]),
    }
    found["models"] = {}
    for name, (model, extra) in models.items():
        run = args.work / name
        if run.exists():
            import shutil

            shutil.rmtree(run)
        result = train(name, model, run, args.device, args.steps, extra)
        if result["ok"] and name != "tiny":
            result["logprobs"] = logprob_checks(model, run, args.device)
            result["ok"] = result["logprobs"]["ok"]
        found["models"][name] = result
    found["ok"] = all(m["ok"] for m in found["models"].values())
    found["wall_s"] = round(time.perf_counter() - begin, 1)
    text = json.dumps(found)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
