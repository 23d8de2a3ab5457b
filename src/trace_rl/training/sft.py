"""SFT warm start: teach a policy the tool format from scripted demonstrations before RL.

Agentic RL papers start from a model that already writes well-formed tool calls. Our
demonstrations come from the bundled tasks' scripted oracles, run through the real env (parser,
tools, scorer), with a share of turns replaced by a random agent's moves (wrong searches, early
guesses), so the demonstrations, and the model, are not perfect. Sequences use exactly the
collector's token layout (chat-templated prompt, then each turn's tokens and its observation's
tokens); the loss covers the turns only, never the prompt or observations.

The result is cached in a folder named by a hash of everything that shapes it, so it is made once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from trace_rl.agent.agents import Episode, OracleAgent, RandomAgent, run_episode
from trace_rl.agent.env import StepResult, ToolEnv
from trace_rl.agent.protocol import ANSWER, TurnFormat
from trace_rl.agent.types import OraclePolicy, Rationale, Task, TaskSet, ToolCall
from trace_rl.infra.config import MAX_SEED, check_choice, check_range
from trace_rl.models import (
    TinyConfig,
    cache_root,
    load_policy,
    native_bf16,
    token_logprobs,
)
from trace_rl.models.cache import atomic_folder
from trace_rl.rollout.collector import encode_observation, encode_prompt
from trace_rl.storage.rundir import atomic_write
from trace_rl.training.sequences import pad_right
from trace_rl.training.tree_attention import packed_token_logprobs, supports_packed

_RECIPE_VERSION = 3  # bump when the recipe changes in a way the cache key does not see (3: copy_ready_init)

_BEFORE_FIELDS = {("precision", "fp32"), ("packing", False)}
"""SFTConfig fields added after caches were made, at the value that reproduces those caches."""

CHECKPOINT_EVERY = 50
"""Steps between a warm start's checkpoints (about 2 minutes of a paper-regime warm start on 2 cores)."""

Sequences = Sequence[tuple[list[int], list[int]]]
"""Training sequences: (token ids, loss mask) pairs, mask 1 on the policy's own tokens."""


@dataclass
class SFTConfig:
    """Demonstrations and optimisation of the warm start."""

    demos: int = 4000
    """Demonstration episodes (train tasks are cycled through in seeded random order)."""
    mistake_prob: float = 0.05
    """Chance that a demonstration turn is a random agent's move instead of the oracle's (with 0.15
    the tiny policy's held-out greedy success after 400 steps was 0%, with 0.05 9%)."""
    steps: int = 1200
    """Optimiser steps; batches are drawn epoch by epoch from the demonstrations. The tiny policy's
    held-out multihop success (64 questions, 16 samples at T=1) is 42% after 1,200 steps (4.9 minutes
    in bf16 on a 2-core Xeon with AMX) and 25% after 900 (3.7 minutes, the demo's: `configs/demo.yaml`),
    both spread over [0, 1] (`experiments/warm_start_spread.py`); a step's time grows with its tokens, so
    fewer steps is what makes a warm start shorter."""
    batch_size: int = 8
    """Sequences per step (of similar length, see `length_batches`)."""
    lr: float = 1e-3
    """Peak AdamW learning rate of the warm start (linear warm-up, then cosine decay to 10% of it); 2e-3
    does not converge within 300 steps (loss 0.96 vs 0.49)."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warm-up before the cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay of the warm start."""
    max_seq_len: int = 2048
    """Longer demonstrations are cut (their tail is not trained)."""
    packing: bool = True
    """Each batch as one packed row (`packed_nll`: the shared system prompt once, no padding), where the
    model supports it (`trace_rl.training.tree_attention.supports_packed`); the same loss and gradients as right-padded
    rows up to float rounding. For the tiny policy on 2 cores: 28% fewer tokens through the model (but
    more, smaller attention calls), 1.13x faster over 100 steps of `benchmarks/warm_start_speed.py`
    (0.70 -> 0.62 s a step), 1.4x in a 200-step probe. `false`: right-padded rows (`masked_nll`), the
    recipe before."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """`bf16`: the warm start's forward and backward under bf16 autocast (weights and optimiser stay
    fp32); `auto` (`resolved_precision`): bf16 where it was measured faster, fp32 elsewhere. The cache
    key and the record hold the resolved value, so `auto` shares its cache with the precision it
    resolves to. bf16 packs each batch to a multiple of `BF16_BUCKET` tokens and keeps the tree
    attention in fp32 (`batch_loss`). Packed steps of the demo's warm start
    (`benchmarks/warm_start_speed.py`): plain bf16 autocast was 1.33x faster on an AMD EPYC with
    AVX512-BF16 (the whole warm start 6.2 instead of 9.9 minutes) but slower than fp32 with AMX; the
    bucketed recipe is 1.28x faster with AMX too (4.9 instead of 7.1 minutes). A CPU without
    AVX512-BF16 only emulates bf16. A different policy: check its regime
    (`experiments/warm_start_spread.py`) before a comparison relies on it."""
    seed: int = 0
    """Seed of the warm start (demonstrations, tiny init, batches). Separate from the run's seed so
    that runs with different seeds start from one policy, as RL papers start every seed from one
    checkpoint (and the warm start is made once, not once per seed)."""

    def __post_init__(self) -> None:
        for name in ("demos", "steps", "batch_size", "max_seq_len"):
            check_range(self, name, ge=1)
        check_range(self, "mistake_prob", ge=0, lt=1)
        check_range(self, "lr", gt=0)
        check_range(self, "warmup_steps", ge=0)
        check_range(self, "weight_decay", ge=0)
        check_range(self, "seed", ge=0, le=MAX_SEED)
        check_choice(self, "precision", ("auto", "fp32", "bf16"))


def resolved_precision(precision: str) -> str:
    """`fp32` or `bf16`: the warm start's precision on this machine (it trains on the CPU). `auto` is
    bf16 on a CPU with AVX512-BF16, with or without AMX (`batch_loss`'s bf16 recipe: 1.28x faster a
    step on a 2-core Xeon with AMX; plain bf16 autocast was 1.33x on an AMD EPYC without AMX and
    slower than fp32 with AMX), else fp32 (without AVX512-BF16, bf16 is emulated)."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16()["avx512_bf16"] else "fp32"


# ---------------------------------------------------------------- demonstrations


class DemoAgent:
    """The scripted oracle thinking aloud in steps, with random moves mixed in.

    Each turn is, with probability `mistake_prob`, a random agent's move (a search for random
    words or a random guess, with the random agent's own thought); otherwise the oracle's call with
    the thought `Step i of n.` (before the i-th of the n searches of the oracle's plan for the task;
    a retry repeats the step of the search it retries) or `Done.` (before its answer), followed by the
    task set's rationale when it has one (`Step 2 of 2: Ana Berg studied at`). Without the count a
    small policy does not learn when to stop (on `multihop` it must see from the question how many
    hops to follow, then count them); without the rationale it rarely picks the right fact out of a
    search result. `plan(task)` is the oracle's calls in a clean run.
    """

    def __init__(
        self,
        oracle: OraclePolicy,
        turn_format: TurnFormat,
        random_agent: RandomAgent,
        mistake_prob: float,
        plan: Callable[[Task], list[ToolCall]],
        rationale: Rationale | None = None,
    ) -> None:
        self.oracle, self.format, self.random_agent = oracle, turn_format, random_agent
        self.mistake_prob, self.plan, self.rationale = mistake_prob, plan, rationale

    def act(self, task: Task, turns: Sequence[StepResult], rng: np.random.Generator) -> str:
        if rng.random() < self.mistake_prob:
            return self.random_agent.act(task, turns, rng)
        history = tuple((step.info.call, step.info.observation) for step in turns if step.info.call is not None)
        call = self.oracle(task, history)
        why = self.rationale(task, history) if self.rationale is not None else ""
        if call.name == ANSWER:
            label = "Done"
        else:
            plan = self.plan(task)
            searches = len(plan) - 1
            if call in plan:
                step = plan.index(call) + 1
            else:  # a retry (after a search that found nothing): one past the last planned step made
                step = min(searches, 2 + max((plan.index(made) for made, _ in history if made in plan), default=-1))
            label = f"Step {step} of {searches}"
        return self.format.render_call(call, thought=f"{label}: {why}" if why else f"{label}.")


def demonstrations(taskset: TaskSet, env: ToolEnv, config: SFTConfig, *, seed: int) -> list[Episode]:
    """`config.demos` episodes of `DemoAgent` on the taskset's tasks, cycled in seeded random order."""
    if taskset.oracle is None:
        raise ValueError(f"task set {taskset.name!r} has no scripted oracle to make demonstrations with")
    plans: dict[str, list[ToolCall]] = {}
    clean = OracleAgent(taskset.oracle, env.format)

    def plan(task: Task) -> list[ToolCall]:
        if task.task_id not in plans:
            episode = run_episode(copy.copy(env), task, clean)
            plans[task.task_id] = [step.info.call for step in episode.steps if step.info.call is not None]
        return plans[task.task_id]

    random_agent = RandomAgent.for_corpus(env.format, taskset.corpus, malformed_prob=0.0, specs={name: tool.spec for name, tool in env.tools.items()})
    agent = DemoAgent(taskset.oracle, env.format, random_agent, config.mistake_prob, plan, taskset.rationale)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(taskset.tasks))
    return [
        run_episode(env, taskset.tasks[order[i % len(order)]], agent, seed=seed * 1_000_003 + i)
        for i in range(config.demos)
    ]


def episode_tokens(tokenizer: Any, env: ToolEnv, episode: Episode) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of an episode in the collector's layout: 1 on the policy's turns only."""
    ids = encode_prompt(tokenizer, env, episode.task)
    mask = [0] * len(ids)
    for action, step in zip(episode.actions, episode.steps):
        turn = list(tokenizer.encode(action, add_special_tokens=False))
        observation = encode_observation(tokenizer, step.observation)
        ids += turn + observation
        mask += [1] * len(turn) + [0] * len(observation)
    return ids, mask


# ---------------------------------------------------------------- the warm start, cached


def taskset_digest(taskset: TaskSet) -> str:
    """sha256 of everything in `taskset` the demonstrations are made from: every task (question, answers,
    tools, scorer, meta such as HotpotQA's evidence) and every corpus passage. A sample (a count and a
    few ids) let a file with 15 of 20 answers edited reuse the warm start trained on the old ones."""
    digest = hashlib.sha256()
    for item in (*taskset.tasks, *taskset.corpus):
        digest.update(json.dumps(asdict(item), sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def sft_cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({"recipe": _RECIPE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(
    model: str,
    taskset: TaskSet,
    env: ToolEnv,
    config: SFTConfig,
    *,
    tiny: TinyConfig | None = None,
    cache_dir: str | Path | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> Path:
    """Folder of the warm-started policy (model + tokenizer), trained on first use and cached.

    `model` is a preset or a model folder (see `trace_rl.models.load_policy`). The cache key covers
    the model, the task set's name and content (`taskset_digest`: every task and passage the
    demonstrations are made from, so an edited answer or passage trains anew), the env's turn limit, a transcript of one
    clean demonstration (so any change to the prompt, tools, `topk`, observation cuts or the
    demonstrations' thoughts shows), the config, and `tiny` (the tiny model's shape and tokenizer)
    where it is not the default. The folder appears
    atomically, complete with `trace_rl_sft.json` (the recipe and its statistics), so a second call,
    in this process or another, returns at once. `progress(step, loss)` is called after every step.
    A killed warm start continues from its last checkpoint (`sft-<key>.partial.pt` beside the folder,
    every `CHECKPOINT_EVERY` steps, removed once the folder is complete).
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    config = replace(config, precision=resolved_precision(config.precision))
    key = sft_cache_key(
        {
            "model": model,
            "taskset": taskset.name,
            "content": taskset_digest(taskset),
            "max_turns": env.max_turns,
            "transcript": hashlib.sha256(env_transcript(taskset, env).encode()).hexdigest(),
            # a field at its value from before it existed stays out, so the caches made then stay valid
            "config": {k: v for k, v in asdict(config).items() if (k, v) not in _BEFORE_FIELDS},
            # bf16 packed rows padded to BF16_BUCKET with fp32 attention (fp32's caches stay valid)
            **({"bf16_recipe": 2} if config.precision == "bf16" else {}),
            **({"tiny": asdict(tiny)} if tiny not in (None, TinyConfig()) else {}),
        }
    )
    target = root / f"sft-{key}"
    if (target / "trace_rl_sft.json").exists():
        return target
    seed = config.seed

    start = time.perf_counter()
    policy, episodes, sequences = sft_inputs(model, taskset, env, config, tiny=tiny, cache_dir=root)
    partial = root / f"sft-{key}.partial.pt"
    root.mkdir(parents=True, exist_ok=True)
    stats = train_sft(policy.model, sequences, config, seed=seed, progress=progress, checkpoint=partial, checkpoint_every=CHECKPOINT_EVERY)
    stats.update(
        {
            "sft/total_seconds": time.perf_counter() - start + stats.get("sft/earlier_seconds", 0.0),
            "sft/demo_success": float(np.mean([e.reward for e in episodes])),
            "sft/demo_turns": float(np.mean([e.num_turns for e in episodes])),
            "sft/demo_tokens": float(np.mean([len(ids) for ids, _ in sequences])),
            "sft/demo_policy_tokens": float(np.mean([sum(mask) for _, mask in sequences])),
        }
    )
    with atomic_folder(target) as tmp:
        policy.model.save_pretrained(tmp)
        policy.tokenizer.save_pretrained(tmp)
        record = {"model": model, "seed": seed, "config": asdict(config), "stats": stats}
        (tmp / "trace_rl_sft.json").write_text(json.dumps(record, indent=1))
    partial.unlink(missing_ok=True)
    return target


def sft_inputs(
    model: str, taskset: TaskSet, env: ToolEnv, config: SFTConfig, *, tiny: TinyConfig | None = None, cache_dir: Path | None = None
) -> tuple[Any, list[Episode], Sequences]:
    """What a warm start trains, before its first step: the starting policy (`tiny`: its tokenizer fitted
    to the corpus, questions and demonstrations, then `copy_ready_init`), the demonstrations, and their
    training sequences cut at `config.max_seq_len`."""
    episodes = demonstrations(taskset, env, config, seed=config.seed)
    texts = [p.text for p in taskset.corpus] + [t.question for t in taskset.tasks] + [e.context for e in episodes[:200]]
    policy = load_policy(model, seed=config.seed, tokenizer_texts=texts if model == "tiny" else None, tiny=tiny, cache_dir=cache_dir)
    if model == "tiny":
        copy_ready_init(policy.model, seed=config.seed)
    sequences = [episode_tokens(policy.tokenizer, env, e) for e in episodes]
    return policy, episodes, [(ids[: config.max_seq_len], mask[: config.max_seq_len]) for ids, mask in sequences]


def env_transcript(taskset: TaskSet, env: ToolEnv) -> str:
    """A clean demonstration on the first task: what the env shows a policy, for the cache key.

    The env's search `topk`, observation cuts, prompt and format, and the demonstrations' thoughts
    all change this text, and none of them is otherwise visible from outside (a tool is a closure).
    """
    first = replace(taskset, tasks=taskset.tasks[:1])
    return demonstrations(first, copy.copy(env), SFTConfig(demos=1, mistake_prob=0.0), seed=0)[0].context


def sft_stats(folder: str | Path) -> dict[str, float]:
    """The statistics `warm_start` recorded in a warm-started policy's folder (seconds, losses, demos)."""
    return json.loads((Path(folder) / "trace_rl_sft.json").read_text())["stats"]


# ---------------------------------------------------------------- optimisation


def copy_ready_init(model: Any, *, seed: int) -> None:
    """Add an orthogonal Q to every attention layer's value map and Q^T to its output map.

    Each layer's attention then starts by copying the attended tokens' embeddings: its value/output
    product is the identity plus the usual small noise, and each head covers its own slice of it
    (the "mimetic" initialisation of Trockman & Kolter, 2023). The policy's hard part is copying
    names out of the question and the search results into its next query. From a plain random
    init, the `tiny` model learns no copying at all within 400 steps (its guesses stay the most
    frequent names); with this init it copies the first query right in ~98% of held-out demos by
    step 400. Only for freshly initialised models: a pretrained model already copies.
    """
    generator = torch.Generator().manual_seed(seed)
    # LAPACK's QR rounds differently on more threads; the init must not depend on them
    with torch_threads(1), torch.no_grad():
        for layer in model.model.layers:
            value, output = layer.self_attn.v_proj.weight, layer.self_attn.o_proj.weight  # (inner, d), (d, inner)
            if value.shape != output.T.shape:
                raise ValueError(f"copy_ready_init needs as many key/value heads as query heads, got v_proj {tuple(value.shape)}")
            basis, _ = torch.linalg.qr(torch.randn(output.shape[0], value.shape[0], generator=generator))  # (d, inner)
            value += basis.T.to(value.dtype)
            output += basis.to(output.dtype)


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's CPU thread count set to `count` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def length_batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator) -> Iterator[list[int]]:
    """Endless batches of indices, epoch after epoch, each batch of similar lengths.

    A padded batch costs its longest row times its size, and demonstrations range from ~200 to
    ~900 tokens (1 to 4 hops), so random batches waste about a third of the compute on padding.
    Each epoch is shuffled, cut into windows of 8 batches, each window sorted by length and cut
    into batches, and the batches shuffled again: every batch is still a fresh random draw of
    tasks, but its rows have about the same length.
    """
    lengths = np.asarray(lengths)
    window = 8 * batch_size
    while True:
        order = rng.permutation(len(lengths))
        batches = []
        for begin in range(0, len(order), window):
            chunk = order[begin : begin + window]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
        for index in rng.permutation(len(batches)):
            yield batches[index]


def pad_sft_batch(batch: Sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, attention mask, loss mask), each of shape (B, longest row)."""
    length = max(len(ids) for ids, _ in batch)
    ids, attention = pad_right([seq for seq, _ in batch], length, torch.long)
    loss_mask, _ = pad_right([mask for _, mask in batch], length, torch.float32)
    return ids, attention, loss_mask


_PLAIN_HEAD = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose logits are exactly `lm_head(last hidden state)` (no soft-capping or scaling), so
`masked_nll` may run the output layer at the scored positions only."""


def masked_nll(model: Any, ids: torch.Tensor, attention: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens where `loss_mask` is 1 (the policy's own tokens).

    Prompt, observation and padding tokens are context only: their own prediction is never scored,
    so for a plain-head model (`_PLAIN_HEAD`) the output layer and the softmax run only where a token
    is scored (a multi-turn demonstration is mostly observations: a warm-start step of the tiny policy
    took 1.5x less time, the same loss and gradients up to float rounding).
    """
    target = loss_mask[:, 1:]
    if getattr(model.config, "model_type", None) not in _PLAIN_HEAD:
        logp = token_logprobs(model, ids, attention)  # (B, T-1): predicts ids[:, 1:]
        return -(logp * target).sum() / target.sum().clamp(min=1.0)
    scored = target.bool()
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[scored]).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:][scored][:, None]).squeeze(-1)
    return -(logp * target[scored]).sum() / target.sum().clamp(min=1.0)


Pack = tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]], torch.Tensor, torch.Tensor]
"""A batch packed by `pack_sft_batch`: ids, positions, nodes, sources, targets."""


def pack_sft_batch(batch: Sequences) -> Pack:
    """One batch as one packed row for `packed_token_logprobs`: the rows' longest common prefix once (the
    system prompt and tool list every demonstration starts with), then each row's remaining tokens as a
    child of it. No padding. Returns (ids, positions) of shape (1, N), the nodes, and the packed index
    of each scored token's predecessor with the token itself (`sources`, `targets`, shape (K,))."""
    rows = [np.asarray(ids, dtype=np.int64) for ids, _ in batch]
    shortest = min(len(row) for row in rows)
    first = rows[0][:shortest]
    same = np.ones(shortest, dtype=bool)
    for row in rows[1:]:
        same &= row[:shortest] == first
    common = int(np.argmin(same)) if not same.all() else shortest
    ids, positions, sources, targets = [first[:common]], [np.arange(common)], [], []
    nodes = [(0, common, -1)]
    start = common
    for row, (_, mask) in zip(rows, batch):
        own = len(row) - common
        ids.append(row[common:])
        positions.append(np.arange(common, len(row)))
        nodes.append((start, start + own, 0))
        scored = np.flatnonzero(np.asarray(mask[1:], dtype=bool))  # t: token t+1 is scored, predicted at t
        sources.append(np.where(scored < common, scored, start + scored - common))
        targets.append(row[scored + 1])
        start += own
    ids_row, positions_row = torch.from_numpy(np.concatenate(ids))[None], torch.from_numpy(np.concatenate(positions))[None]
    return ids_row, positions_row, nodes, torch.from_numpy(np.concatenate(sources)), torch.from_numpy(np.concatenate(targets))


BF16_BUCKET = 128
"""Under bf16 a packed row is padded to a multiple of this many tokens, and its scored tokens too:
oneDNN builds a bf16 kernel for every new matrix shape, and a packed row's length differs every step."""


def bucket_pack(pack: Pack, multiple: int) -> tuple[Pack, int]:
    """`pack` padded to a multiple of `multiple` tokens by one more root node that nothing attends to, and
    its scored tokens to a multiple by scoring that node's first token; returns the padded pack and how
    many of its scored tokens are real (the first ones). The real tokens' log-probs are unchanged."""
    ids, positions, nodes, sources, targets = pack
    length, scored = int(ids.shape[1]), len(targets)
    extra, more = -length % multiple, -scored % multiple
    if more and not extra:
        extra = multiple  # the padded scores need a pad token to sit on
    if extra:
        ids = torch.cat([ids, ids.new_zeros(1, extra)], 1)
        positions = torch.cat([positions, torch.arange(extra, dtype=positions.dtype)[None]], 1)
        nodes = [*nodes, (length, length + extra, -1)]
    if more:
        sources = torch.cat([sources, sources.new_full((more,), length)])
        targets = torch.cat([targets, targets.new_zeros(more)])
    return (ids, positions, nodes, sources, targets), scored


def packed_nll(model: Any, pack: Pack, *, scored: int | None = None, attention_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`masked_nll` of a batch, computed on its packed tree (`pack_sft_batch`): every demonstration
    starts with the same ~110-token system prompt, which a padded batch runs once per row. `scored`:
    only the first this many scored tokens count (the rest pad a `bucket_pack`)."""
    ids, positions, nodes, sources, targets = pack
    device = next(model.parameters()).device
    logp = packed_token_logprobs(model, ids.to(device), positions, nodes, sources, targets, attention_dtype=attention_dtype)
    if scored is not None:
        logp = logp[:scored]
    return -logp.sum() / max(1, len(logp))


def batch_loss(model: Any, batch: Sequences, *, packed: bool, precision: str = "fp32") -> tuple[torch.Tensor, int]:
    """(masked loss of the batch, tokens through the model): one packed row (`packed_nll`) or
    right-padded rows (`masked_nll`). `precision="bf16"`: under bf16 autocast, a packed row padded to
    `BF16_BUCKET` and its tree attention in fp32 (on a 2-core Xeon with AMX, 0.25 s a step against
    fp32's 0.33, where plain bf16 took 0.40: new shapes and the attention's bf16 backward ate the gain)."""
    device = next(model.parameters()).device
    bf16 = precision == "bf16"
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        if packed:
            pack, scored = pack_sft_batch(batch), None
            if bf16:
                pack, scored = bucket_pack(pack, BF16_BUCKET)
            loss = packed_nll(model, pack, scored=scored, attention_dtype=torch.float32 if bf16 else None)
            return loss, int(pack[0].shape[1])
        ids, attention, loss_mask = pad_sft_batch(batch)
        return masked_nll(model, ids.to(device), attention.to(device), loss_mask.to(device)), ids.numel()


def _read_checkpoint(path: Path, device: torch.device) -> dict[str, Any] | None:
    """A warm start's checkpoint, or None where there is none or it cannot be read (with a warning: the
    warm start then starts over, it does not fail). Data only, never code (`weights_only`)."""
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # a cut-short or foreign file
        warnings.warn(f"warm start checkpoint {path} is unreadable ({exc}); training from step 0", stacklevel=3)
        return None


def train_sft(
    model: Any,
    sequences: Sequences,
    config: SFTConfig,
    *,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    checkpoint: Path | None = None,
    checkpoint_every: int = CHECKPOINT_EVERY,
) -> dict[str, float]:
    """`config.steps` AdamW steps on the masked loss, linear warmup then cosine decay to 10% of `lr`.

    With `checkpoint`, the state (weights, optimiser, schedule, random state, losses) is written there
    every `checkpoint_every` steps and training continues from it when the file exists, to the same
    weights as an uninterrupted run: a paper-regime warm start takes 25-50 minutes on 2 cores, and a
    killed one should not start over. The caller names the file by everything that shapes the run."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def lr_scale(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        done = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_scale)
    batches = length_batches([len(ids) for ids, _ in sequences], config.batch_size, np.random.default_rng(seed))
    packed = config.packing and supports_packed(model)
    precision = resolved_precision(config.precision)
    model.train()
    losses: list[float] = []
    tokens, first, before = 0, 0, 0.0
    state = _read_checkpoint(checkpoint, device) if checkpoint is not None else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        first, tokens, before, losses = int(state["step"]), int(state["tokens"]), float(state["seconds"]), list(state["losses"])
        for _ in range(first):  # the batch order is a pure function of the seed: replay it
            next(batches)
    start = time.perf_counter()
    # A training batch (~3k tokens) splits well over cores: on 2 cores, 2 threads train ~1.7x faster
    # than the 1 thread that suits decoding (`model.cpu_threads`).
    with torch_threads(os.cpu_count() or torch.get_num_threads()):
        for step in range(first, config.steps):
            loss, size = batch_loss(model, [sequences[i] for i in next(batches)], packed=packed, precision=precision)
            tokens += size
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            if checkpoint is not None and (step + 1) % checkpoint_every == 0 and step + 1 < config.steps:
                state = {
                    "step": step + 1, "tokens": tokens, "seconds": before + time.perf_counter() - start, "losses": losses,
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                }
                atomic_write(checkpoint, lambda tmp: torch.save(state, tmp))
            if progress is not None:
                progress(step, losses[-1])
    model.eval()
    return {
        "sft/first_loss": losses[0],
        "sft/final_loss": float(np.mean(losses[-10:])),
        "sft/seconds": before + time.perf_counter() - start,
        "sft/steps": float(config.steps),
        "sft/tokens": float(tokens),
        # a resumed warm start says so: which step it continued from, and the training seconds before it
        **({"sft/resumed_at_step": float(first), "sft/earlier_seconds": before} if first else {}),
    }
