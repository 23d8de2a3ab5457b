"""Allocation-quality benchmark: the registry's methods at equal budget on the latent-tree simulator,
planned by the same code that plans training batches (`trace_rl.planning.planner`).

Each batch draws `prompts_per_batch` fresh prompts; every row gets the same prompts and spends
exactly `budget` leaves on them (a continuation from a prefix counts as one leaf). A row is a method
of `trace_rl.planning.methods.METHODS`, run as in training (its own predictor, learning online from its own
trees), or a method fed other values, written `method@values`:

- `@oracle`: the true success probability of every root and prefix;
- `@topic`: roots valued by their latent topic and hop count only, not their own difficulty
  (`LatentTreeSimulator.expected_p0`), prefixes by the truth: a ceiling for a predictor that reads
  the prompt, so a reference for the learned `trace`;
- `@noisy`: the truth blurred by N(0, noise²) in log-odds.

Every method of the registry runs except `dapo`, whose resampling spends extra rounds of the
trainer, not an allocation (its allocation is `grpo`'s). The simulator's prompts are new in every
batch, so the per-prompt history predictors of `prompt_only` and `knapsack` never see a prompt twice
and both fall back to their no-information split: that is what those methods do on fresh prompts.

Rows with a learned predictor first run `warmup_batches` batches whose figures are reported apart
(under `warmup`); every row's figures come from the same `batches` batches after that. A figure is
averaged over the batches of a seed; the result holds its mean over seeds and, as `<figure>_std`, its
standard deviation over seeds. `targets` measures two targets: `trace@oracle` at least doubles
`grpo`, and the learned `trace` reaches 85% of `trace@oracle`, on both effective_ratio and
mixed_budget_share.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trace_rl.core.token_budget import TokenCosts
from trace_rl.core.tree import RolloutTree
from trace_rl.infra.config import from_dict
from trace_rl.planning.evidence import Stage2Evidence
from trace_rl.planning.methods import AllocationSettings, expand_stage2, get_method
from trace_rl.planning.metrics import FIGURES, predictor_metrics, tree_metrics
from trace_rl.planning.planner import Planner, Request
from trace_rl.predictor import (
    KnowsPrompts,
    PredictorConfig,
    SuccessPredictor,
    backup_targets,
    brier_score,
    build_predictor,
)
from trace_rl.research.sim import LatentTreeSimulator, SimConfig, SimPrompt

ROWS: tuple[str, ...] = (
    "grpo",
    "trace_stage1",
    "trace_stage1@oracle",
    "random_tree",
    "trace@oracle",
    "trace@topic",
    "trace@noisy",
    "trace",
    "prompt_only",
    "knapsack",
    "pcl",
    "pcl@oracle",
    "trace_stage2",
    "trace_stage2@oracle",
)
"""The default rows. A row's position here also keys its random stream, so adding a row at the end
leaves every other row's numbers as they were."""
VALUES = ("oracle", "topic", "noisy")
TOKEN_FIGURES = ("leaves", "tokens_generated", "mixed_leaves_per_ktoken", "mixed_prompts_per_ktoken")
"""What a batch spent and bought per 1,000 generated tokens (`tree_metrics`), reported beside FIGURES."""
UNMIXED_FIGURES = ("failed_budget_share", "solved_budget_share", "most_leaves_unmixed")
"""The budget in prompts that never mixed (`tree_metrics`), reported beside FIGURES."""


def parse_row(row: str) -> tuple[str, str | None]:
    """`trace@oracle` -> ("trace", "oracle"); `trace` -> ("trace", None). ValueError for a bad row."""
    name, _, values = row.partition("@")
    spec = get_method(name)
    if name == "dapo":
        raise ValueError("dapo's resampling is the trainer's; the benchmark has no row for it (its allocation is grpo's)")
    if values and values not in VALUES:
        raise ValueError(f"row {row!r}: values must be one of {', '.join(VALUES)}, got {values!r}")
    if values and not spec.uses_values:
        raise ValueError(f"row {row!r}: {name} reads no values, so it takes no @{values}")
    return name, values or None


@dataclass
class BenchConfig(AllocationSettings):
    """The default regime: 64 candidate prompts and 6 leaves per prompt on average per batch. The
    budget's settings are `AllocationSettings`, the same for every row, as training's `rollout.*`."""

    budget: int = 384
    """Leaves per batch (`AllocationSettings.budget`), here 6 per candidate prompt."""
    prompts_per_batch: int = 64
    """Candidate prompts per batch (fresh prompts every batch)."""
    stage2_evidence: bool = False
    """Rows with TRACE's Stage 2 allocate with the evidence posterior (`rollout.stage2_evidence`), each
    row fitting its own on its own trees."""
    seeds: int = 5
    """Independent worlds (topics, difficulties, words) and rollout streams."""
    batches: int = 20
    """Reported batches per seed."""
    warmup_batches: int = 20
    """Batches a learned predictor trains on first; reported apart."""
    noise: float = 1.0
    """Log-odds noise std of `@noisy` rows."""
    predictor: PredictorConfig = field(default_factory=lambda: PredictorConfig(max_ngram=1, learning_rate=0.3, turn_features=True))
    """The shared predictor of learned rows (one per row and seed, trained on that row's own trees).
    Word unigrams: on this simulator they gave a lower held-out error than 1-2 grams, as its text
    carries its information in single words and pairs of filler words add only noise. Its turn texts
    carry clues by construction, so the turns' n-grams are read (`turn_features`), unlike on real trees."""
    methods: tuple[str, ...] = ROWS
    """Rows to run (see the module docstring)."""
    workers: int = 2
    """Processes that run seeds side by side (1: in this process)."""
    sim: SimConfig = field(default_factory=SimConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {self.prompts_per_batch!r}")
        if round(self.budget * self.stage1_share) < self.min_per_prompt:
            raise ValueError(
                f"the Stage 1 budget round(budget * stage1_share) = {round(self.budget * self.stage1_share)} "
                f"is below min_per_prompt={self.min_per_prompt}"
            )
        if self.seeds < 1 or self.batches < 1 or self.warmup_batches < 0:
            raise ValueError(f"seeds and batches must be >= 1 and warmup_batches >= 0, got {self.seeds}, {self.batches}, {self.warmup_batches}")
        if self.noise < 0.0:
            raise ValueError(f"noise must be >= 0, got {self.noise!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers!r}")
        if not self.methods or len(set(self.methods)) != len(self.methods):
            raise ValueError(f"methods must be a non-empty list without repeats, got {self.methods!r}")
        for row in self.methods:
            parse_row(row)
        if self.budget_unit == "tokens":
            unable = [row for row in self.methods if not get_method(parse_row(row)[0]).allocates_tokens]
            if unable:
                raise ValueError(f"rows {unable} allocate leaves, not tokens (budget_unit tokens)")


ValueFn = Callable[[list[RolloutTree], Sequence[tuple[int, int]]], np.ndarray]
"""(trees, (tree index, node id) per query) -> success estimate per query."""


def run_benchmark(**config: Any) -> dict[str, Any]:
    """Run the benchmark and return its JSON-ready result. Keys are `BenchConfig` fields; `sim` and
    `predictor` may be mappings of their fields; a key given as None keeps its default (so a CLI can
    pass unset flags). Raises `trace_rl.infra.config.ConfigError` (a ValueError) for unknown keys or bad values.

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


def learned_rows(rows: Sequence[str]) -> list[str]:
    """The rows that learn a predictor from their own trees (and so have a warm-up)."""
    return [row for row in rows if parse_row(row)[1] is None and get_method(parse_row(row)[0]).uses_values]


def _run_seed(cfg: BenchConfig, seed: int) -> _SeedResult:
    sim = LatentTreeSimulator(cfg.sim, seed=seed)
    predictors = {row: build_predictor(get_method(row).predictor, cfg.predictor, seed=seed) for row in learned_rows(cfg.methods)}
    planners = {row: planner_for(row, cfg) for row in cfg.methods}
    figures: dict[str, dict[str, list[float]]] = {m: {} for m in cfg.methods}
    warmup: dict[str, dict[str, list[float]]] = {m: {} for m in predictors}
    calibration: dict[str, dict[str, list[float]]] = {m: {} for m in predictors}
    for batch in range(cfg.warmup_batches + cfg.batches):
        reported = batch >= cfg.warmup_batches
        prompts = sim.sample_prompts(cfg.prompts_per_batch, np.random.default_rng([seed, batch, 1]))
        for row in cfg.methods:
            predictor = predictors.get(row)
            planner = planners[row]
            if not reported and predictor is None and planner.costs is None and planner.evidence is None:
                continue  # stateless rows need no warm-up (under a token budget every row learns its costs)
            rng = np.random.default_rng([seed, batch, 2, _stream(row)])
            trees = run_batch(row, prompts, sim, cfg, rng, predictor, planner)
            metrics = tree_metrics(trees)
            if cfg.budget_unit == "leaves" and metrics["tree/leaves"] != cfg.budget:
                raise RuntimeError(f"{row} spent {metrics['tree/leaves']:.0f} leaves, expected {cfg.budget}")
            planner.observe(trees)
            table = figures if reported else warmup
            if row in table:  # a warm-up batch of a row without a predictor only teaches it its costs
                for name in FIGURES + TOKEN_FIGURES + UNMIXED_FIGURES:
                    table[row].setdefault(name, []).append(metrics[f"tree/{name}"])
            if predictor is not None:
                if reported:
                    for key, value in _calibration(trees).items():
                        calibration[row].setdefault(key, []).append(value)
                predictor.update(*backup_targets(trees))

    def means(table: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
        return {m: {k: float(np.mean(v)) for k, v in row.items()} for m, row in table.items() if row}

    return _SeedResult(means(figures), means(warmup), means(calibration))


def _stream(row: str) -> int:
    """The random stream of a row: its position in `ROWS`, or past them for other rows (stable)."""
    if row in ROWS:
        return ROWS.index(row)
    return len(ROWS) + zlib.crc32(row.encode()) % 1_000_000


def run_batch(
    row: str,
    prompts: Sequence[SimPrompt],
    sim: LatentTreeSimulator,
    cfg: BenchConfig,
    rng: np.random.Generator,
    predictor: SuccessPredictor | None = None,
    planner: Planner | None = None,
) -> list[RolloutTree]:
    """One batch of `row`: the two stages of its `Planner` (the training collector's), with the
    simulator in place of the engine and env: exactly `cfg.budget` leaves are grown; under a token
    budget, the leaves that `cfg.budget` expected tokens buy at the planner's cost estimates. The
    caller has the planner observe the trees (`Planner.observe`)."""
    name, values = parse_row(row)
    method = get_method(name)
    planner = planner if planner is not None else Planner(method, cfg.allocation())
    value = _value_fn(method.uses_values, values, sim, predictor, cfg.noise, rng)
    trees = [sim.new_tree(p) for p in prompts]
    known = predictor.evidence([t.history(0) for t in trees]) if value and isinstance(predictor, KnowsPrompts) else None
    for requests in planner.plan(trees, value, rng, prompt_evidence=known):
        _grow(trees, requests, sim, rng)
    return trees


def planner_for(row: str, cfg: BenchConfig) -> Planner:
    """The planner of one row, with the state it learns: token costs under a token budget (from the most
    a simulated rollout writes), Stage 2's evidence model under `cfg.stage2_evidence`."""
    method = get_method(parse_row(row)[0])
    most = cfg.sim.turn_tokens * cfg.sim.max_turns + cfg.sim.answer_tokens
    costs = TokenCosts(initial=float(most)) if cfg.budget_unit == "tokens" else None
    evidence = Stage2Evidence() if cfg.stage2_evidence and method.stage2 is expand_stage2 else None
    return Planner(method, cfg.allocation(), costs=costs, evidence=evidence, stage2_value="evidence" if evidence is not None else "paper")


def _grow(trees: list[RolloutTree], requests: list[Request], sim: LatentTreeSimulator, rng: np.random.Generator) -> None:
    for request in requests:
        for _ in range(request.count):
            sim.rollout(trees[request.tree], request.node, rng)


def _value_fn(
    uses_values: bool,
    values: str | None,
    sim: LatentTreeSimulator,
    predictor: SuccessPredictor | None,
    noise: float,
    rng: np.random.Generator,
) -> ValueFn | None:
    """The values a row's planner reads, or None for a method that reads none."""
    if not uses_values:
        return None

    def truth(trees: list[RolloutTree], queries: Sequence[tuple[int, int]]) -> np.ndarray:
        return np.array([sim.true_value(trees[i], n) for i, n in queries], dtype=np.float64)

    def topic(trees: list[RolloutTree], queries: Sequence[tuple[int, int]]) -> np.ndarray:
        values = truth(trees, queries)
        for k, (i, n) in enumerate(queries):
            if n == 0:  # a root: what its topic and hop count tell
                values[k] = sim.expected_p0(int(trees[i].meta["topic"]), int(trees[i].meta["hops"]))
        return values

    def noisy(trees: list[RolloutTree], queries: Sequence[tuple[int, int]]) -> np.ndarray:
        p = np.clip(truth(trees, queries), 1e-6, 1.0 - 1e-6)
        z = np.log(p / (1.0 - p)) + rng.normal(0.0, noise, size=p.size)
        return 1.0 / (1.0 + np.exp(-z))

    if values is None:
        if predictor is None:
            raise ValueError("a learned row needs a predictor")
        model = predictor

        def learned(trees: list[RolloutTree], queries: Sequence[tuple[int, int]]) -> np.ndarray:
            return model.predict([trees[i].history(n) for i, n in queries])

        return learned
    return {"oracle": truth, "topic": topic, "noisy": noisy}[values]


def _calibration(trees: list[RolloutTree]) -> dict[str, float]:
    """`predictor/brier` and `predictor/ece` as training logs them (`trace_rl.planning.metrics.predictor_metrics`),
    and `predictor/mse_true`: squared error against the true probability, one per node the allocator
    looked at, filtered-out prompts included (only the simulator knows it)."""
    figures = {k: v for k, v in predictor_metrics(trees).items() if k in ("predictor/brier", "predictor/ece")}
    predicted = [(n.predicted, LatentTreeSimulator.true_value(t, n.id)) for t in trees for n in t.nodes if n.predicted is not None]
    p, truth = np.array(predicted, dtype=np.float64).T
    return {**figures, "predictor/mse_true": brier_score(p, truth)}


def _summarise(per_seed: list[dict[str, float]]) -> dict[str, float]:
    """Mean over seeds of each figure, and its spread as `<figure>_std` (population std over seeds)."""
    out: dict[str, float] = {}
    for name in per_seed[0]:
        values = [row[name] for row in per_seed]
        out[name] = float(np.mean(values))
        out[f"{name}_std"] = float(np.std(values))
    return out


def _targets(methods: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The targets, measured: oracle TRACE ≥ 2× uniform; learned TRACE ≥ 85% of oracle."""
    targets: dict[str, Any] = {}
    checks = (("oracle_vs_uniform", "trace@oracle", "grpo", 2.0), ("learned_vs_oracle", "trace", "trace@oracle", 0.85))
    for name, top, base, need in checks:
        if top in methods and base in methods:
            ratios = {f: methods[top][f] / methods[base][f] if methods[base][f] else None for f in ("effective_ratio", "mixed_budget_share")}
            met = all(r is not None and r >= need for r in ratios.values())
            targets[name] = {**ratios, "required": need, "met": met}
    return targets


def summary_table(result: dict[str, Any]) -> str:
    """The per-row figures as a table, for people (the JSON is for programs)."""
    import io

    from rich.console import Console
    from rich.table import Table

    config = result["config"]
    out = io.StringIO()
    console = Console(file=out, width=120)
    table = Table(
        title=f"allocation quality: {config['seeds']} seeds x {config['batches']} batches, "
        f"budget {config['budget']} over {config['prompts_per_batch']} prompts, stage1_share {config['stage1_share']} "
        "(mean ± std over seeds)"
    )
    table.add_column("row", no_wrap=True)
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
    return out.getvalue()
