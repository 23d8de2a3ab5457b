"""The method registry: what each method name means, in one place.

A method is a `MethodSpec`: how Stage 1 splits the budget over prompts, whether and how Stage 2
expands prefixes, which advantage estimator trains on the trees, which success predictor feeds the
allocator, and any resampling rule (DAPO's). The collector, the planner, the trainer, the
allocation benchmark, the report and the CLI all read it from here, so a name means one thing
everywhere. Adding a method is one `MethodSpec` entry below (plus its allocator, if it is new).

    >>> get_method("trace").stage2 is expand_stage2
    True
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal

import numpy as np

from trace_rl.core.baselines import (
    knapsack_roots,
    pcl_roots,
    random_prefixes,
    uniform_roots,
)
from trace_rl.core.mixing import (
    BraceConfig,
    PrefixPosterior,
    brace_groups,
    expand_expected,
    group_mixing,
)
from trace_rl.core.solvers import allocate_roots, expand_for_prompts, expand_prefixes
from trace_rl.core.token_budget import allocate_roots_by_cost, expand_prefixes_by_cost
from trace_rl.infra.config import FieldError, check_choice, check_range
from trace_rl.predictor import PredictorKind, PromptEvidence

MAX_BUDGET = 65_536
"""Most leaves one batch may hold: far above published RL batches (512 prompts x 16 rollouts is 8,192),
so a larger budget is a typo; a budget of 10**9 ran out of memory after 92 s instead of being refused."""
MAX_TOKEN_BUDGET = 2**27
"""Most expected generated tokens one batch may spend (`budget_unit: tokens`): 8,192 rollouts of 16k."""


@dataclass
class AllocationSettings:
    """How a batch's budget is spent, for every method: all the planner reads. Training's
    `RolloutConfig` (`rollout.*`) and the benchmark's `BenchConfig` are these plus settings of their
    own, so each knob is declared, documented and checked here once."""

    budget: int = 64
    """Leaves per batch (one rollout = one leaf; a continuation from a prefix counts as one), from
    `min_per_prompt` to `MAX_BUDGET`; with `budget_unit: tokens`, expected generated tokens per batch."""
    budget_unit: Literal["leaves", "tokens"] = "leaves"
    """`leaves`: every rollout costs one (the paper's budget). `tokens`: a rollout costs its expected
    generated tokens, learnt from the trees so far (`trace_rl.core.token_budget.TokenCosts`: per depth, per
    task), so a continuation from a deep prefix is cheaper than a fresh rollout; both stages spend
    `budget` tokens (exact solvers, `trace_rl.core.token_budget`) and a batch holds as many leaves as that
    buys. For the methods whose allocators can (`MethodSpec.allocates_tokens`); Stage 2 then uses the
    `anchor` objective."""
    stage1_share: float = 0.5
    """Share of the budget spent on bare rollouts when the method has a Stage 2."""
    min_per_prompt: int = 2
    """A prompt gets zero rollouts or at least this many (one rollout has nothing to contrast with)."""
    max_per_prompt: int | None = None
    """Most rollouts the exact and Knapsack-RL Stage-1 allocators give one prompt (None: no cap)."""
    max_per_prefix: int | None = None
    """Most continuations one prefix may get in Stage 2 (None: no cap)."""
    pcl_keep_share: float = 0.5
    """`pcl`: share of the candidate prompts it keeps (those predicted nearest p = 0.5)."""
    success_threshold: float = 0.5
    """A leaf counts as a success for Stage 2's observed outcome r when its reward exceeds this."""
    stage2_objective: Literal["anchor", "prompt"] = "anchor"
    """What TRACE's Stage 2 maximises: `anchor`, the paper's Σ over prefixes of the chance that an anchor
    turns mixed; `prompt`, the expected number of prompts that end mixed (what the effective ratio
    counts: `trace_rl.core.solvers.expand_for_prompts`). `experiments/stage2_objective.py` compares them."""
    brace: BraceConfig = field(default_factory=BraceConfig)
    """The `brace` method's settings (group size, ε, τ, decay, warm bank, certified exclusion)."""

    def __post_init__(self) -> None:
        check_range(self, "min_per_prompt", ge=2, why="one rollout has nothing to contrast with")
        check_choice(self, "budget_unit", ("leaves", "tokens"))
        check_choice(self, "stage2_objective", ("anchor", "prompt"))
        if self.budget_unit == "tokens":
            check_range(self, "budget", ge=1, le=MAX_TOKEN_BUDGET, why="expected generated tokens per batch")
            if self.stage2_objective != "anchor":
                raise FieldError("stage2_objective", self.stage2_objective, "anchor with budget_unit tokens (the prompt objective spends leaves)")
        else:
            check_range(self, "budget", ge=1, le=MAX_BUDGET)
            if self.budget < self.min_per_prompt:
                raise FieldError("budget", self.budget, f">= min_per_prompt={self.min_per_prompt} (a sampled prompt gets at least that many rollouts)")
        check_range(self, "stage1_share", gt=0, le=1)
        check_range(self, "max_per_prompt", ge=self.min_per_prompt, nullable=True, why="at least min_per_prompt; null: no cap")
        check_range(self, "max_per_prefix", ge=1, nullable=True, why="null: no cap")
        check_range(self, "pcl_keep_share", gt=0, le=1)
        check_range(self, "success_threshold", ge=0, lt=1, why="rewards lie in [0, 1] and a success is a reward above it")

    def allocation(self) -> AllocationSettings:
        """The planner's view: these settings alone, as a copy (a subclass's own settings left out)."""
        return AllocationSettings(**{f.name: getattr(self, f.name) for f in fields(AllocationSettings)})


Stage1Allocator = Callable[..., np.ndarray]
"""(root values v, Stage-1 budget, settings, evidence, rng, *, costs=None) -> rollouts per prompt (int64,
summing to the budget). `evidence` is what the predictor knows beyond v (`PromptEvidence`: Knapsack-RL's
`known`, BRACE's counts; None when it has nothing more); `rng` serves the allocators that draw (BRACE);
`costs` (token budgets only) are each prompt's expected tokens per fresh rollout."""
Stage2Allocator = Callable[..., np.ndarray]
"""(prefix values ṽ, observed outcomes r, Stage-2 budget, settings, rng, *, prompts, mixed, costs=None) ->
continuations per prefix; `prompts` names each prefix's prompt and `mixed` says whether that prompt's
bare rollouts already mixed (for the `prompt` objective); `costs` (token budgets only) are each
prefix's expected tokens per continuation."""


def affordable(budget: int, costs: np.ndarray) -> int:
    """Rollouts a token budget buys at the mean cost: what the uniform and random allocators spread."""
    return int(budget // float(np.mean(costs))) if len(costs) else 0


def _no_costs(name: str, costs: np.ndarray | None) -> None:
    if costs is not None:
        able = ", ".join(f.__name__ for f in TOKEN_ALLOCATORS)
        raise ValueError(f"the {name} allocator spends leaves, not tokens (rollout.budget_unit: tokens takes {able})")


def uniform_stage1(
    v: np.ndarray, budget: int, s: AllocationSettings, evidence: PromptEvidence | None = None, rng: np.random.Generator | None = None,
    *, costs: np.ndarray | None = None,
) -> np.ndarray:
    if costs is not None:  # the leaves the tokens buy at the mean cost, split evenly
        leaves = affordable(budget, costs)
        return uniform_roots(len(v), leaves if leaves >= s.min_per_prompt else 0, min_per_prompt=s.min_per_prompt)
    return uniform_roots(len(v), budget, min_per_prompt=s.min_per_prompt)


def exact_stage1(
    v: np.ndarray, budget: int, s: AllocationSettings, evidence: PromptEvidence | None = None, rng: np.random.Generator | None = None,
    *, costs: np.ndarray | None = None,
) -> np.ndarray:
    if costs is not None:
        return allocate_roots_by_cost(v, costs, budget, min_per_prompt=s.min_per_prompt, max_per_prompt=s.max_per_prompt)
    return allocate_roots(v, budget, min_per_prompt=s.min_per_prompt, max_per_prompt=s.max_per_prompt)


def knapsack_stage1(
    v: np.ndarray, budget: int, s: AllocationSettings, evidence: PromptEvidence | None = None, rng: np.random.Generator | None = None,
    *, costs: np.ndarray | None = None,
) -> np.ndarray:
    _no_costs("knapsack", costs)
    return knapsack_roots(v, budget, min_per_prompt=s.min_per_prompt, max_per_prompt=s.max_per_prompt, known=None if evidence is None else evidence.known)


def pcl_stage1(
    v: np.ndarray, budget: int, s: AllocationSettings, evidence: PromptEvidence | None = None, rng: np.random.Generator | None = None,
    *, costs: np.ndarray | None = None,
) -> np.ndarray:
    _no_costs("pcl", costs)
    keep = max(1, min(len(v), budget // s.min_per_prompt, round(len(v) * s.pcl_keep_share)))
    return pcl_roots(v, budget, keep=keep, min_per_prompt=s.min_per_prompt)


def brace_stage1(
    v: np.ndarray, budget: int, s: AllocationSettings, evidence: PromptEvidence | None = None, rng: np.random.Generator | None = None,
    *, costs: np.ndarray | None = None,
) -> np.ndarray:
    """BRACE: groups of `brace.group_size` for the prompts `trace_rl.core.mixing.brace_groups` draws by the
    posterior expected chance that a group mixes; a budget the groups leave over goes one rollout at a
    time to the chosen prompts (to the candidates, if fewer prompts than groups)."""
    _no_costs("brace", costs)
    if evidence is None or evidence.successes is None or evidence.failures is None:
        raise ValueError("the brace allocator reads each prompt's counts (PromptEvidence from a BraceBank predictor); got none")
    if rng is None:
        raise ValueError("the brace allocator draws prompts and needs an rng")
    k = s.brace.group_size
    weights = group_mixing(1.0 + evidence.successes, 1.0 + evidence.failures, k, evidence.concentration)
    chosen = brace_groups(weights, budget // k, eps=s.brace.eps, temperature=s.brace.temperature, rng=rng)
    per_prompt = chosen * k
    left = budget - int(per_prompt.sum())
    takers = np.flatnonzero(chosen) if chosen.any() else np.arange(len(v))
    if left and takers.size:
        per_prompt[takers] += np.bincount(np.arange(left) % takers.size, minlength=takers.size)
    return per_prompt.astype(np.int64)


def expand_stage2(
    v: np.ndarray | PrefixPosterior, r: np.ndarray, budget: int, s: AllocationSettings, rng: np.random.Generator, *,
    prompts: np.ndarray, mixed: np.ndarray, costs: np.ndarray | None = None,
) -> np.ndarray:
    if isinstance(v, PrefixPosterior):  # the posterior expectation (`rollout.stage2_expected`)
        if costs is not None or s.stage2_objective != "anchor":
            raise ValueError("Stage 2 by the posterior expectation values anchors in leaves (budget_unit leaves, stage2_objective anchor)")
        return expand_expected(v, r, budget, max_per_prefix=s.max_per_prefix)
    if costs is not None:
        if s.stage2_objective == "prompt":
            raise ValueError("stage2_objective prompt spends leaves; under a token budget Stage 2 maximises the paper's anchor objective")
        return expand_prefixes_by_cost(v, r, costs, budget, max_per_prefix=s.max_per_prefix)
    if s.stage2_objective == "prompt":
        return expand_for_prompts(v, r, prompts, mixed, budget, max_per_prefix=s.max_per_prefix)
    return expand_prefixes(v, r, budget, max_per_prefix=s.max_per_prefix)


def random_stage2(
    v: np.ndarray, r: np.ndarray, budget: int, s: AllocationSettings, rng: np.random.Generator, *,
    prompts: np.ndarray, mixed: np.ndarray, costs: np.ndarray | None = None,
) -> np.ndarray:
    leaves = budget if costs is None else affordable(budget, costs)
    return random_prefixes(len(v), leaves, rng=rng, max_per_prefix=s.max_per_prefix)


TOKEN_ALLOCATORS = (uniform_stage1, exact_stage1, expand_stage2, random_stage2)
"""The allocators that can spend a token budget (`MethodSpec.allocates_tokens`)."""


@dataclass(frozen=True)
class MethodSpec:
    """What one method does; see the module docstring."""

    name: str
    """What `rollout.method` and a comparison's rows call it."""
    stage1: Stage1Allocator
    """Stage 1: how the budget (or its Stage-1 share) is split over the candidate prompts as bare rollouts."""
    stage2: Stage2Allocator | None
    """Stage 2: how the rest is spent as continuations from the bare rollouts' prefixes; None: no Stage 2,
    the whole budget goes to bare rollouts."""
    estimator: str
    """Advantage estimator (`trace_rl.core.advantage.ESTIMATORS`) unless `train.advantage` names another."""
    predictor: PredictorKind
    """The success predictor the run trains and its allocators read (`trace_rl.predictor.PREDICTORS`)."""
    resample: Literal["dapo"] | None
    """`dapo`: drop groups whose rewards all agree and sample more prompts until the batch is full."""
    description: str
    """One line on what the method does, for `trace-rl methods` and the docs."""
    source: str
    """The paper or code the method comes from."""

    @property
    def uses_values(self) -> bool:
        """Whether its allocation reads the predictor (so the benchmark can feed it oracle values)."""
        return self.stage1 is not uniform_stage1 or self.stage2 is expand_stage2

    @property
    def allocates_tokens(self) -> bool:
        """Whether both its stages can spend a token budget (`rollout.budget_unit: tokens`)."""
        stages = [self.stage1] + ([] if self.stage2 is None else [self.stage2])
        return self.resample is None and all(stage in TOKEN_ALLOCATORS for stage in stages)

    def stage1_budget(self, settings: AllocationSettings) -> int:
        if self.stage2 is None:
            return settings.budget
        return max(settings.min_per_prompt, round(settings.budget * settings.stage1_share))

    def stage2_budget(self, settings: AllocationSettings) -> int:
        return settings.budget - self.stage1_budget(settings)

    def describe(self) -> dict[str, str | None]:
        """JSON-ready: allocator and estimator names, for help texts and summaries."""
        return {
            "name": self.name,
            "stage1": self.stage1.__name__.removesuffix("_stage1"),
            "stage2": None if self.stage2 is None else self.stage2.__name__.removesuffix("_stage2"),
            "estimator": self.estimator,
            "predictor": self.predictor,
            "resample": self.resample,
            "description": self.description,
            "source": self.source,
        }


_TRACE = "TRACE, Tree Rollout Allocation for Contrastive Exploration (arXiv 2606.11119)"

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("grpo", uniform_stage1, None, "grpo", "shared", None,
                   "uniform rollouts over the prompts, flat GRPO over each prompt's leaves",
                   "GRPO, Shao et al. 2024, DeepSeekMath (arXiv 2402.03300)"),
        MethodSpec("prompt_only", exact_stage1, None, "grpo", "prompt_history", None,
                   "TRACE's exact Stage 1 alone, on each prompt's own past outcomes (Beta posterior); no Stage 2",
                   f"ablation of {_TRACE}"),
        MethodSpec("knapsack", knapsack_stage1, None, "grpo", "knapsack_history", None,
                   "Knapsack-RL's allocation rule on each prompt's success rate from its last sampling",
                   "Knapsack RL, Li et al. 2025 (arXiv 2509.25849)"),
        MethodSpec("pcl", pcl_stage1, None, "grpo", "shared", None,
                   "keep the candidate prompts predicted nearest p = 0.5, uniform rollouts on them",
                   "PCL, Prompt Curriculum Learning, Gao et al. 2025 (arXiv 2510.01135)"),
        MethodSpec("random_tree", uniform_stage1, random_stage2, "tree_grpo", "shared", None,
                   "uniform bare rollouts, then continuations from prefixes drawn at random",
                   "random prefix expansion as in TreePO (Li et al. 2025) and Tree-GRPO (Ji et al. 2025)"),
        MethodSpec("dapo", uniform_stage1, None, "grpo", "shared", "dapo",
                   "uniform rollouts; groups whose rewards agree are dropped and more prompts sampled (every rollout counted)",
                   "DAPO dynamic sampling, Yu et al. 2025 (arXiv 2503.14476)"),
        MethodSpec("brace", brace_stage1, None, "grpo", "brace_bank", None,
                   "BRACE: groups of a fixed size for the prompts drawn by the posterior expected chance a "
                   "correlated group mixes, from decayed per-prompt counts and a warm bank",
                   "BRACE, Measure First, Then Allocate (github.com/fatebreaker/brace, brace/triage.py)"),
        MethodSpec("trace_stage1", exact_stage1, None, "trace", "shared", None,
                   "TRACE's exact Stage 1 on the shared predictor; no Stage 2", f"ablation of {_TRACE}"),
        MethodSpec("trace_stage2", uniform_stage1, expand_stage2, "trace", "shared", None,
                   "uniform bare rollouts, then TRACE's exact Stage 2 on the shared predictor", f"ablation of {_TRACE}"),
        MethodSpec("trace", exact_stage1, expand_stage2, "trace", "shared", None,
                   "TRACE: exact Stage 1 over prompts, exact Stage 2 over prefixes, one shared predictor", _TRACE),
    )
}
"""Every method, in the order tables and plots show them (the baseline first, TRACE last)."""

MethodName = Literal["grpo", "prompt_only", "knapsack", "pcl", "random_tree", "dapo", "brace", "trace_stage1", "trace_stage2", "trace"]
"""The registry's names, for typed config fields (a test keeps it equal to `METHODS`)."""


def get_method(name: str) -> MethodSpec:
    """The spec of `name`; ValueError listing the known names (and the nearest one) otherwise."""
    if name not in METHODS:
        close = difflib.get_close_matches(str(name), METHODS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown method {name!r}{hint} (known: {', '.join(METHODS)})")
    return METHODS[name]
