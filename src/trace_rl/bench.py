"""Allocation-quality benchmark: every allocation method at equal budget on the latent-tree simulator.

Each batch draws `prompts_per_batch` fresh prompts; every method gets the same prompts and spends
exactly `budget` leaves on them (a continuation from a prefix counts as one leaf):

- `uniform`: the budget split evenly over the prompts (GRPO); no Stage 2.
- `prompt_only`: Stage 1 on the learned predictor's root values with the whole budget (Knapsack-RL / PCL).
- `prompt_only_oracle`: the same on the true root probabilities (TRACE Stage 1 alone, an ablation).
- `random_prefix`: a uniform Stage 1 with `stage1_share` of the budget, then continuations from
  intermediate prefixes drawn at random (TreePO / Tree-GRPO style).
- `trace_oracle`: TRACE on the true probabilities: `allocate_roots` with the Stage 1 budget, bare
  rollouts, then `expand_prefixes` on the true prefix probabilities and the bare rollouts' outcomes.
- `trace_topic_oracle`: TRACE whose root values know each prompt's latent topic and hop count but
  not its own difficulty deviation (`LatentTreeSimulator.expected_p0`), with true prefix values: a
  ceiling for any predictor that reads the prompt, so a reference for `trace_learned`.
- `trace_noisy`: TRACE on the true probabilities blurred by N(0, noise²) in log-odds.
- `trace_learned`: TRACE on a `HashedNgramPredictor` trained online on the backup targets of the
  method's own previous batches.

Methods with a learned predictor first run `warmup_batches` batches whose figures are reported
apart (under `warmup`); every method's figures come from the same `batches` batches after that.
A figure is averaged over the batches of a seed; the result holds its mean over seeds and, as
`<figure>_std`, its standard deviation over seeds. `targets` measures the issue's two targets:
`trace_oracle` at least doubles `uniform`, and `trace_learned` reaches 85% of `trace_oracle`, on
both effective_ratio and mixed_budget_share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TextIO

import numpy as np

from trace_rl.allocate import allocate_roots, expand_prefixes, random_prefixes, uniform_roots
from trace_rl.config import PredictorConfig, from_dict
from trace_rl.predictor import (
    HashedNgramPredictor,
    backup_targets,
    brier_score,
    expected_calibration_error,
    rollout_starts,
)
from trace_rl.sim import LatentTreeSimulator, SimConfig, SimPrompt
from trace_rl.tree import RolloutTree, tree_metrics

Method = Literal[
    "uniform", "prompt_only", "prompt_only_oracle", "random_prefix", "trace_oracle", "trace_topic_oracle", "trace_noisy", "trace_learned"
]
METHODS: tuple[Method, ...] = (
    "uniform",
    "prompt_only",
    "prompt_only_oracle",
    "random_prefix",
    "trace_oracle",
    "trace_topic_oracle",
    "trace_noisy",
    "trace_learned",
)
LEARNED: tuple[Method, ...] = ("prompt_only", "trace_learned")
FIGURES = ("effective_ratio", "effective_per_candidate", "mixed_budget_share", "anchor_mixed_ratio")
"""Reported together because each alone can flatter: filtering prompts raises effective_ratio
while effective_per_candidate falls; mixed_budget_share says where the budget went."""


@dataclass(frozen=True)
class BenchConfig:
    """The default regime: 64 candidate prompts and 6 leaves per prompt on average per batch."""

    prompts_per_batch: int = 64
    """Candidate prompts per batch (fresh prompts every batch)."""
    budget: int = 384
    """Leaves per batch, the same for every method."""
    stage1_share: float = 0.5
    """Share of the budget spent on bare rollouts by two-stage methods; the rest expands prefixes."""
    min_per_prompt: int = 2
    """A sampled prompt gets at least this many bare rollouts."""
    seeds: int = 5
    """Independent worlds (topics, difficulties, words) and rollout streams."""
    batches: int = 20
    """Reported batches per seed."""
    warmup_batches: int = 20
    """Batches a learned predictor trains on first; reported apart."""
    noise: float = 1.0
    """Log-odds noise std of `trace_noisy`."""
    predictor: PredictorConfig = field(default_factory=lambda: PredictorConfig(max_ngram=1, learning_rate=0.3))
    """The learned methods' `HashedNgramPredictor` (one per method and seed, trained on that method's
    own trees). Word unigrams: on this simulator they gave a lower held-out error than 1-2 grams, as
    its text carries its information in single words and pairs of filler words add only noise."""
    methods: tuple[Method, ...] = METHODS
    workers: int = 2
    """Processes that run seeds side by side (1: in this process)."""
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        if self.prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {self.prompts_per_batch!r}")
        if not 0.0 < self.stage1_share <= 1.0:
            raise ValueError(f"stage1_share must be in (0, 1], got {self.stage1_share!r}")
        if self.min_per_prompt < 2:
            raise ValueError(f"min_per_prompt must be >= 2, got {self.min_per_prompt!r}")
        if self.stage1_budget < self.min_per_prompt:
            raise ValueError(f"the Stage 1 budget round(budget * stage1_share) = {self.stage1_budget} is below min_per_prompt={self.min_per_prompt}")
        if self.seeds < 1 or self.batches < 1 or self.warmup_batches < 0:
            raise ValueError(f"seeds and batches must be >= 1 and warmup_batches >= 0, got {self.seeds}, {self.batches}, {self.warmup_batches}")
        if self.noise < 0.0:
            raise ValueError(f"noise must be >= 0, got {self.noise!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers!r}")
        if not self.methods or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be a non-empty list without repeats, got {self.methods!r}")

    @property
    def stage1_budget(self) -> int:
        return round(self.budget * self.stage1_share)


ValueFn = Callable[[list[RolloutTree], list[int], list[int]], np.ndarray]
"""(trees, tree index per query, node id per query) -> success estimate per query."""


def run_benchmark(**config: Any) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result. Keys are `BenchConfig` fields; `sim` and
    `predictor` may be mappings of their fields; a key given as None keeps its default (so a CLI can
    pass unset flags). Raises `trace_rl.config.ConfigError` (a ValueError) for unknown keys or bad values.

    Seeds run in `workers` processes; the result does not depend on `workers`.
    """
    cfg = from_dict(BenchConfig, {k: v for k, v in config.items() if v is not None})
    start = time.perf_counter()
    workers = min(cfg.workers, cfg.seeds)
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            seeds = list(pool.map(_run_seed, [cfg] * cfg.seeds, range(cfg.seeds)))
    else:
        seeds = [_run_seed(cfg, seed) for seed in range(cfg.seeds)]
    methods = {m: _summarise([s.figures[m] for s in seeds]) for m in cfg.methods}
    result: dict[str, Any] = {
        "bench": "allocation_quality",
        "config": {**asdict(cfg), "methods": list(cfg.methods)},
        "methods": methods,
        "warmup": {m: _summarise([s.warmup[m] for s in seeds]) for m in seeds[0].warmup},
        "predictor": {m: _summarise([s.calibration[m] for s in seeds]) for m in seeds[0].calibration},
        "targets": _targets(methods),
        "seconds": round(time.perf_counter() - start, 3),
    }
    return result


@dataclass
class _SeedResult:
    """One seed's figures, each averaged over its batches."""

    figures: dict[str, dict[str, float]]  # method -> figure -> mean over reported batches
    warmup: dict[str, dict[str, float]]  # learned method -> figure -> mean over warm-up batches
    calibration: dict[str, dict[str, float]]  # learned method -> predictor/* -> mean over reported batches


def _run_seed(cfg: BenchConfig, seed: int) -> _SeedResult:
    sim = LatentTreeSimulator(cfg.sim, seed=seed)
    p = cfg.predictor
    predictors = {
        m: HashedNgramPredictor(
            num_features=p.num_features, max_ngram=p.max_ngram, learning_rate=p.learning_rate, l2=p.l2, epochs=p.epochs, seed=seed
        )
        for m in cfg.methods
        if m in LEARNED
    }
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in cfg.methods}
    warmup: dict[str, dict[str, list[float]]] = {m: {} for m in predictors}
    calibration: dict[str, dict[str, list[float]]] = {m: {} for m in predictors}
    for batch in range(cfg.warmup_batches + cfg.batches):
        reported = batch >= cfg.warmup_batches
        prompts = sim.sample_prompts(cfg.prompts_per_batch, np.random.default_rng([seed, batch, 1]))
        for method in cfg.methods:
            predictor = predictors.get(method)
            if not reported and predictor is None:
                continue  # stateless methods need no warm-up
            rng = np.random.default_rng([seed, batch, 2, METHODS.index(method)])
            trees = run_batch(method, prompts, sim, cfg, rng, predictor)
            metrics = tree_metrics(trees)
            if metrics["tree/leaves"] != cfg.budget:
                raise RuntimeError(f"{method} spent {metrics['tree/leaves']:.0f} leaves, expected {cfg.budget}")
            for name in FIGURES:
                (figures if reported else warmup)[method].setdefault(name, []).append(metrics[f"tree/{name}"])
            if predictor is not None:
                if reported:
                    for key, value in _calibration(trees).items():
                        calibration[method].setdefault(key, []).append(value)
                predictor.update(*backup_targets(trees))

    def means(table: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
        return {m: {k: float(np.mean(v)) for k, v in row.items()} for m, row in table.items() if row}

    return _SeedResult(means(figures), means(warmup), means(calibration))


def run_batch(
    method: Method,
    prompts: Sequence[SimPrompt],
    sim: LatentTreeSimulator,
    cfg: BenchConfig,
    rng: np.random.Generator,
    predictor: HashedNgramPredictor | None = None,
) -> list[RolloutTree]:
    """One batch of `method`: Stage 1 bare rollouts, then (two-stage methods) Stage 2 continuations.

    Fills `budget` (rollouts given) and `predicted` (the estimate the allocator used) on the roots and
    on the expanded prefixes. Exactly `cfg.budget` leaves are grown.
    """
    trees = [sim.new_tree(p) for p in prompts]
    roots = list(range(len(trees)))
    two_stage = method.startswith("trace_") or method == "random_prefix"
    stage1 = cfg.stage1_budget if two_stage else cfg.budget
    value = _value_fn(method, sim, predictor, cfg.noise, rng)

    if method in ("uniform", "random_prefix"):
        v_root = None
        per_prompt = uniform_roots(len(trees), stage1, min_per_prompt=cfg.min_per_prompt)
    else:
        v_root = value(trees, roots, [0] * len(trees))
        per_prompt = allocate_roots(v_root, stage1, min_per_prompt=cfg.min_per_prompt)
    for i, tree in enumerate(trees):
        tree.root.budget = int(per_prompt[i])
        tree.root.predicted = None if v_root is None else float(v_root[i])
        for _ in range(per_prompt[i]):
            sim.rollout(tree, 0, rng)
    if not two_stage or cfg.budget == stage1:
        return trees

    # Stage 2 candidates: the intermediate prefixes (non-terminal, below the root) of the bare
    # rollouts, each with its rollout's observed reward. Bare rollouts branch only at the root, so
    # every such node lies on exactly one bare rollout.
    where, nodes, outcome = [], [], []
    for i, tree in enumerate(trees):
        for leaf in tree.leaves():
            for node in tree.path(int(leaf))[1:-1]:
                where.append(i)
                nodes.append(node)
                outcome.append(tree.nodes[int(leaf)].reward)
    stage2 = cfg.budget - stage1
    if not nodes:
        raise RuntimeError(f"{method}: no intermediate prefix to expand with the Stage 2 budget {stage2}")
    if method == "random_prefix":
        v_prefix = None
        per_prefix = random_prefixes(len(nodes), stage2, rng=rng)
    else:
        v_prefix = value(trees, where, nodes)
        per_prefix = expand_prefixes(v_prefix, np.array(outcome, dtype=np.float64), stage2)
    for c in np.flatnonzero(per_prefix):
        tree, node = trees[where[c]], nodes[c]
        tree.nodes[node].budget = int(per_prefix[c])
        tree.nodes[node].predicted = None if v_prefix is None else float(v_prefix[c])
        for _ in range(per_prefix[c]):
            sim.rollout(tree, node, rng)
    return trees


def _value_fn(
    method: Method, sim: LatentTreeSimulator, predictor: HashedNgramPredictor | None, noise: float, rng: np.random.Generator
) -> ValueFn:
    def truth(trees: list[RolloutTree], where: list[int], nodes: list[int]) -> np.ndarray:
        return np.array([sim.true_value(trees[i], n) for i, n in zip(where, nodes)], dtype=np.float64)

    def topic(trees: list[RolloutTree], where: list[int], nodes: list[int]) -> np.ndarray:
        values = truth(trees, where, nodes)
        for k, (i, n) in enumerate(zip(where, nodes)):
            if n == 0:  # a root: what its topic and hop count tell
                values[k] = sim.expected_p0(int(trees[i].meta["topic"]), int(trees[i].meta["hops"]))
        return values

    def noisy(trees: list[RolloutTree], where: list[int], nodes: list[int]) -> np.ndarray:
        p = np.clip(truth(trees, where, nodes), 1e-6, 1.0 - 1e-6)
        z = np.log(p / (1.0 - p)) + rng.normal(0.0, noise, size=p.size)
        return 1.0 / (1.0 + np.exp(-z))

    if method in LEARNED:
        if predictor is None:
            raise ValueError(f"method {method!r} needs a predictor")
        model = predictor

        def learned(trees: list[RolloutTree], where: list[int], nodes: list[int]) -> np.ndarray:
            return model.predict([trees[i].history(n) for i, n in zip(where, nodes)])

        return learned
    return {"trace_noisy": noisy, "trace_topic_oracle": topic}.get(method, truth)


def _calibration(trees: list[RolloutTree]) -> dict[str, float]:
    """Calibration of the estimates the allocator acted on: `node.predicted` on every root and every
    expanded prefix, made before any rollout started there.

    `predictor/brier` and `predictor/ece`: against the 0/1 outcomes of the rollouts the allocator then
    started at that node (bare rollouts at a root, continuations at a prefix), one pair per rollout.
    Only those are fair draws: the bare rollout through an expanded prefix is why it was chosen.
    `predictor/mse_true`: squared error against the true probability, one per node the allocator
    looked at, filtered-out prompts included.
    """
    pairs_p, pairs_r, predicted, truth = [], [], [], []
    for tree in trees:
        starts = rollout_starts(tree)
        for node in tree.nodes:
            if node.predicted is not None:
                predicted.append(node.predicted)
                truth.append(LatentTreeSimulator.true_value(tree, node.id))
            elif node.is_terminal and tree.nodes[starts[node.id]].predicted is not None:
                pairs_p.append(tree.nodes[starts[node.id]].predicted)
                pairs_r.append(node.reward)
    return {
        "predictor/brier": brier_score(np.array(pairs_p), np.array(pairs_r)),
        "predictor/ece": expected_calibration_error(np.array(pairs_p), np.array(pairs_r)),
        "predictor/mse_true": brier_score(np.array(predicted), np.array(truth)),
    }


def _summarise(per_seed: list[dict[str, float]]) -> dict[str, float]:
    """Mean over seeds of each figure, and its spread as `<figure>_std` (population std over seeds)."""
    out: dict[str, float] = {}
    for name in per_seed[0]:
        values = [row[name] for row in per_seed]
        out[name] = float(np.mean(values))
        out[f"{name}_std"] = float(np.std(values))
    return out


def _targets(methods: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The issue's targets, measured: oracle TRACE ≥ 2× uniform; learned TRACE ≥ 85% of oracle."""
    targets: dict[str, Any] = {}
    checks = (("oracle_vs_uniform", "trace_oracle", "uniform", 2.0), ("learned_vs_oracle", "trace_learned", "trace_oracle", 0.85))
    for name, top, base, need in checks:
        if top in methods and base in methods:
            ratios = {f: methods[top][f] / methods[base][f] if methods[base][f] else None for f in ("effective_ratio", "mixed_budget_share")}
            met = all(r is not None and r >= need for r in ratios.values())
            targets[name] = {**ratios, "required": need, "met": met}
    return targets


def summary_table(result: dict[str, Any], file: TextIO | None = None) -> None:
    """Print the per-method figures as a table, for people (the JSON is for programs)."""
    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    console = Console(file=file)
    table = Table(
        title=f"allocation quality: {config['seeds']} seeds x {config['batches']} batches, "
        f"budget {config['budget']} over {config['prompts_per_batch']} prompts, stage1_share {config['stage1_share']} "
        "(mean ± std over seeds)"
    )
    table.add_column("method", no_wrap=True)
    for name in FIGURES:
        table.add_column(name.replace("_", "\n"), justify="right", no_wrap=True)  # fits 80 columns
    for method, figures in result["methods"].items():
        table.add_row(method, *(f"{figures[n]:.3f}±{figures[n + '_std']:.3f}" for n in FIGURES))
    console.print(table)
    for method, metrics in result["predictor"].items():
        shown = ", ".join(f"{k.split('/')[-1]} {v:.4f}" for k, v in metrics.items() if not k.endswith("_std"))
        console.print(f"{method} predictor (after {config['warmup_batches']} warm-up batches): {shown}")
    for name, check in result["targets"].items():
        ratios = ", ".join(f"{k} x{v:.2f}" for k, v in check.items() if k not in ("required", "met"))
        console.print(f"target {name} (need x{check['required']}): {ratios}: {'met' if check['met'] else 'MISSED'}")
