"""The allocations TRACE is compared with, at an equal budget: `uniform_roots` (GRPO),
`random_prefixes` (TreePO / Tree-GRPO style random tree), and the published prompt-level rules under
their own names, `knapsack_roots` (Knapsack-RL as released) and `pcl_roots` (PCL: keep the prompts
predicted nearest p = 0.5). They share the exact solvers' input checks and, for Knapsack-RL's fill,
their threshold search (`trace_rl.core.solvers`); `trace_rl.planning.methods` maps method names to them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from trace_rl.core.contrast import root_value
from trace_rl.core.solvers import (
    _infeasible,
    _lp_guess,
    _per_prompt_bounds,
    _probabilities,
    _RootEnvelope,
    _RootIncrements,
    _take_top,
    _whole,
)


def uniform_roots(num_prompts: int, budget: int, *, min_per_prompt: int = 2) -> np.ndarray:
    """GRPO's allocation: the budget split equally over the prompts, the remainder one each to the
    first prompts. When the budget cannot give every prompt min_per_prompt, only the first
    budget // min_per_prompt prompts get rollouts (equally), so no prompt is left with a lone one.

    Returns int64 counts, one per prompt, summing to budget; raises ValueError when 0 < budget <
    min_per_prompt or there are no prompts for a positive budget.
    """
    prompts = _whole("num_prompts", num_prompts, minimum=0)
    budget = _whole("budget", budget, minimum=0)
    low = _whole("min_per_prompt", min_per_prompt, minimum=2)
    allocation = np.zeros(prompts, dtype=np.int64)
    if budget == 0:
        return allocation
    used = min(prompts, budget // low)
    if used == 0:
        raise ValueError(_infeasible(budget, prompts, low, None))
    share, remainder = divmod(budget, used)
    allocation[:used] = share
    allocation[:remainder] += 1
    return allocation


def random_prefixes(
    num_candidates: int, budget: int, *, rng: np.random.Generator, max_per_prefix: int | None = None
) -> np.ndarray:
    """Random-tree baseline (TreePO / Tree-GRPO style): each continuation goes to a candidate prefix
    drawn uniformly at random, with replacement, among those below max_per_prefix (no cap when None).

    Spends min(budget, capacity) exactly, like `expand_prefixes`; the same seeded `rng` gives the same
    counts. Draws are made in rounds: every round spreads what is left multinomially over the
    candidates with room, and a draw beyond a candidate's room is redrawn in the next round, which is
    rejection sampling of the one-at-a-time process. Returns int64 counts, one per candidate.
    """
    candidates = _whole("num_candidates", num_candidates, minimum=0)
    budget = _whole("budget", budget, minimum=0)
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, e.g. np.random.default_rng(0); got {rng!r}")
    cap = budget if max_per_prefix is None else _whole("max_per_prefix", max_per_prefix, minimum=0)
    counts = np.zeros(candidates, dtype=np.int64)
    left = min(budget, cap * candidates)
    while left:
        open_items = np.flatnonzero(counts < cap)
        drawn = rng.multinomial(left, np.full(open_items.size, 1.0 / open_items.size))
        placed = np.minimum(drawn, cap - counts[open_items])
        counts[open_items] += placed
        left -= int(placed.sum())
    return counts


# -------------------------------------------------------------------- published baselines, by name
#
# Knapsack-RL and PCL as their authors run them, for comparisons under their own names. TRACE's
# Stage 1 (`allocate_roots`) is a different objective; these do not share it.

KnapsackCost = Literal["probability", "expectation"]


def knapsack_roots(
    p: ArrayLike,
    budget: int,
    *,
    min_per_prompt: int = 2,
    max_per_prompt: int | None = None,
    zero_per_prompt: int | None = None,
    one_per_prompt: int | None = None,
    known: ArrayLike | None = None,
    unknown_per_prompt: int | None = None,
    alpha: float = 0.9,
    cost: KnapsackCost = "probability",
    fallback: bool = True,
) -> np.ndarray:
    """Knapsack-RL's released allocation rule: rollouts per prompt from last-epoch success rates p.

    Li et al. 2025, "Knapsack RL: Unlocking Exploration of LLMs via Optimizing Budget Allocation",
    arXiv 2509.25849; reproduced from github.com/liziniu/KnapsackRL (commit ca5d5f5):
    `verl/trainer/ppo/exploration_utils.py` (`sampling_budget_by_knapsack`, `solve_by_dp`), its call
    in `verl/trainer/ppo/ray_trainer.py` and the launch script
    `examples/knapsack_trainer/run_knapsack_grpo_7b.sh` (min_n = negative_n = positive_n = 2,
    max_n = 128, alpha = 0.9, cost "probability", fallback on). The rule, in their order:

    1. Floors. A prompt not `known` (the released `reward_states` validity: seen fewer than
       min_buffer_length = 8 times, see `PromptHistoryPredictor(estimate="last_epoch").known`) gets
       `unknown_per_prompt` (their rollout.n; default budget // len(p), the uniform share) and takes no
       further part. A known prompt gets `zero_per_prompt` if p == 0, `one_per_prompt` if p == 1 (both
       default to min_per_prompt), else min_per_prompt; the last kind are the *effective* prompts.
    2. No effective prompt: the rest R of the budget is spread evenly (remainder one each, lowest
       index first) over the prompts counted as p == 0, which as released includes the unknown ones
       (their success rate is left at 0); if there is none, every prompt gets the uniform share.
    3. Fallback. Each effective prompt's cost is the rollouts needed to see its rarer outcome with
       probability alpha, log(1 - alpha) / log(max(p, 1 - p)) ("expectation": 1 / (p(1-p)) - 1), capped
       at max_per_prompt and truncated as a float32 to an integer as released. If the costs sum below R,
       the surplus is spread evenly over the p == 0 prompts (unknown included), or, if there are none,
       over the other non-effective prompts, and only the costs' sum is left for step 4.
    4. Knapsack. The effective prompts share what is left, k_i extra rollouts each, 0 <= k_i <=
       max_per_prompt - min_per_prompt, Σ k_i exactly, maximising their DP's objective
           Σ_{i: k_i >= 1} p_i(1-p_i)² · (1 - p_i^(L+k_i) - (1-p_i)^(L+k_i)),   L = min_per_prompt,
       the paper's Value = P(non-zero gradient) × InfoGain, InfoGain(p) ≈ p(1-p)². As released, a
       prompt left at k_i = 0 scores 0, not the value of its L floor rollouts, so the first extra
       rollout is worth the whole Value(L + 1). If every effective prompt is at its cap, the rest is
       spread evenly over them, beyond the cap, as released.

    Step 4 is solved exactly, not by their O(n·R·max_n) table: the per-prompt gains are concave (the
    first, Value(L+1), is at least every later increment, which fall with N; min_per_prompt >= 1
    keeps it so), so taking the R largest gains is optimal, found by the same threshold search as
    `allocate_roots`. Equal gains go to the lower index first; their table breaks ties by its own
    order, so allocations may differ where objectives are equal (to 1e-13 relative).

    Deviations, all at edges the released code does not handle: it crashes (division by zero) when
    the fallback has no prompt to go to (every prompt effective) — here the surplus stays in step 4;
    its step-2 uniform reset ignores `budget` — here the uniform share is `budget` spread evenly;
    it asserts when the floors exceed the budget — here a ValueError; max_per_prompt=None (no
    cap; theirs must be set) caps at the budget. Values use float64 p (theirs are stored as float32,
    which moves them by ~1e-8 relative). Returns int64 counts, one per prompt, summing to `budget`.
    Raises ValueError naming the argument for bad input.
    """
    p = _probabilities("p", p)
    budget = _whole("budget", budget, minimum=0)
    low, high = _per_prompt_bounds(min_per_prompt, max_per_prompt, minimum=1)
    zero_floor = low if zero_per_prompt is None else _whole("zero_per_prompt", zero_per_prompt, minimum=0)
    one_floor = low if one_per_prompt is None else _whole("one_per_prompt", one_per_prompt, minimum=0)
    known = _known_mask(known, like=p)
    share = budget // p.size if p.size else 0
    unknown_floor = share if unknown_per_prompt is None else _whole("unknown_per_prompt", unknown_per_prompt, minimum=0)
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, (int, float, np.floating, np.integer)):
        raise ValueError(f"alpha must be a number in (0, 1), got {alpha!r}")
    if not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if cost not in ("probability", "expectation"):
        raise ValueError(f"cost must be 'probability' or 'expectation', got {cost!r}")
    if not isinstance(fallback, (bool, np.bool_)):
        raise ValueError(f"fallback must be True or False, got {fallback!r}")
    if p.size == 0:
        if budget:
            raise ValueError(f"budget={budget} cannot be placed: p is empty, there are no prompts")
        return np.zeros(0, dtype=np.int64)

    effective = known & (p > 0.0) & (p < 1.0)
    allocation = np.select(
        [~known, p == 0.0, p == 1.0], [unknown_floor, zero_floor, one_floor], default=low
    ).astype(np.int64)
    rest = budget - int(allocation.sum())
    if rest < 0:
        raise ValueError(
            f"budget={budget} is below the {int(allocation.sum())} rollouts Knapsack-RL's floors take first "
            f"(min_per_prompt={low}, zero_per_prompt={zero_floor}, one_per_prompt={one_floor}, "
            f"unknown_per_prompt={unknown_floor})"
        )
    zero_like = np.flatnonzero(~known | (p == 0.0))  # as released: an unknown prompt's rate reads as 0
    if not effective.any():
        if rest == 0:
            return allocation
        if zero_like.size:
            allocation[zero_like] += _evenly(rest, zero_like.size)
            return allocation
        return _evenly(budget, p.size)

    items = np.flatnonzero(effective)
    cap = budget if high is None else high  # most rollouts one effective prompt may hold
    if fallback:
        estimated = int(_knapsack_costs(p[items], alpha=float(alpha), cost=cost, cap=cap).sum())
        if estimated < rest:
            takers = zero_like if zero_like.size else np.flatnonzero(~effective)
            if takers.size:  # released: always, and a division by zero when there are none
                allocation[takers] += _evenly(rest - estimated, takers.size)
                rest = estimated
    allocation[items] += _knapsack_fill(p[items], rest, low=low, room=cap - low)
    return allocation


def _known_mask(known: ArrayLike | None, *, like: np.ndarray) -> np.ndarray:
    """Boolean mask, one per prompt; None means every prompt is known."""
    if known is None:
        return np.ones(like.size, dtype=bool)
    array = np.asarray(known)
    if array.ndim != 1 or array.size != like.size:
        raise ValueError(f"known must be 1-D with one entry per prompt ({like.size}), got shape {array.shape}")
    if array.size and array.dtype != bool:
        try:
            numbers = array.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"known must be booleans (or 0 / 1): {exc}") from exc
        bad = np.flatnonzero((numbers != 0.0) & (numbers != 1.0))
        if bad.size:
            raise ValueError(f"known must be booleans (or 0 / 1), got known[{bad[0]}] = {array[bad[0]]!r}")
        array = numbers == 1.0
    return array.astype(bool)


def _evenly(amount: int, count: int) -> np.ndarray:
    """`amount` split over `count` slots: equal shares, the remainder one each to the first slots
    (Knapsack-RL's spreading rule for every leftover)."""
    base, remainder = divmod(amount, count)
    return np.full(count, base, dtype=np.int64) + (np.arange(count) < remainder)


def _knapsack_costs(p: np.ndarray, *, alpha: float, cost: KnapsackCost, cap: int) -> np.ndarray:
    """Knapsack-RL's per-prompt cost estimate for 0 < p < 1, as the integer its fallback sums:
    min(cap, cost) truncated, with the cost rounded to float32 first as the released code stores it."""
    with np.errstate(over="ignore", divide="ignore"):
        if cost == "probability":
            raw = np.log1p(-alpha) / np.log(np.maximum(p, 1.0 - p))
        else:
            raw = 1.0 / (p * (1.0 - p)) - 1.0
        stored = raw.astype(np.float32).astype(np.float64)  # inf where float32 overflows: capped below
    return np.floor(np.minimum(float(cap), stored))


def _knapsack_fill(p: np.ndarray, total: int, *, low: int, room: int) -> np.ndarray:
    """Knapsack-RL's step 4: extra rollouts k_i in [0, room] for prompts with 0 < p_i < 1 and floor
    `low`, Σ k_i == total, maximising Σ_{k_i >= 1} p_i(1-p_i)² root_value(p_i, low + k_i).

    Unit 0 of a prompt is worth p(1-p)² root_value(p, low + 1) (an `_RootEnvelope` lump of one unit),
    unit j >= 1 is worth p(1-p)² root_gain(p, low + j) (`_RootIncrements` scaled by log p(1-p)²), keys
    never increase along a prompt, so `_take_top` picks the best `total` exactly. A total beyond the
    room of every prompt fills them all and spreads the rest evenly over them, beyond `room`, as the
    released solver does.
    """
    size = p.size
    if total >= size * room:
        return room + _evenly(total - size * room, size)
    minority = np.minimum(p, 1.0 - p)
    log_weight = np.log(p) + 2.0 * np.log(1.0 - p)  # InfoGain p(1-p)²; 1 - p is exact for p >= 1/2
    increments = _RootIncrements(
        scale=np.log(minority * (1.0 - minority)) + log_weight,
        rate=-np.log1p(-minority),
        skew=np.log1p(-minority) - np.log(minority),  # not log((1-w)/w): that overflows for subnormal w
        start=low,  # increment j' is worth p(1-p)² root_gain(p, low + 1 + j'): extra rollout j' + 2
        cap=room - 1,
        positive=size,  # 0 < p < 1: every prompt gains
    )
    first = log_weight + np.log(root_value(minority, low + 1))  # the first extra rollout: the whole Value
    envelope = _RootEnvelope(increments, first, lump=1)
    with np.errstate(over="ignore"):  # a subnormal rate's x = (scale - t) / rate overflows to inf, then is clipped
        return _take_top(envelope, total, t_guess=_lp_guess(envelope, total))


def pcl_roots(v: ArrayLike, budget: int, *, keep: int, min_per_prompt: int = 2, target: float = 0.5) -> np.ndarray:
    """PCL's allocation: keep the `keep` candidates whose predicted success is nearest `target`, and
    give them the budget uniformly.

    Gao et al. 2025, "Prompt Curriculum Learning for Efficient LLM Post-Training", arXiv 2510.01135
    (no public code found): each step samples a pool of k·m prompts, a value model predicts each
    one's expected reward V(x), and the batch is argmin over |S| = m of Σ_{x∈S} |V(x) - τ|, i.e. the
    m prompts nearest τ (0.5 by default; their ablation varies τ). It is a nearest-m selection, not
    a threshold band: exactly m prompts are kept however far they are from τ. Each kept prompt gets
    n responses; here the budget is split as `uniform_roots` splits it, over the kept prompts in
    order of closeness (so a remainder goes to the closest first). Ties in |v - target| (as float64)
    go to the lower index. `v` is the candidate pool (len(v) = k·keep in the paper's setting).

    Returns int64 counts, one per candidate, summing to `budget`; 0 for every candidate not kept.
    Raises ValueError naming the argument for bad input, keep outside [1, len(v)], or budget <
    keep * min_per_prompt (a kept prompt needs a pair to contrast).
    """
    v = _probabilities("v", v)
    budget = _whole("budget", budget, minimum=0)
    keep = _whole("keep", keep, minimum=1)
    low = _whole("min_per_prompt", min_per_prompt, minimum=2)
    if keep > v.size:
        raise ValueError(f"keep={keep} exceeds the {v.size} candidates in v")
    if isinstance(target, (bool, np.bool_)) or not isinstance(target, (int, float, np.floating, np.integer)):
        raise ValueError(f"target must be a number in [0, 1], got {target!r}")
    if not 0.0 <= float(target) <= 1.0:
        raise ValueError(f"target must lie in [0, 1], got {target!r}")
    if budget < keep * low:
        raise ValueError(f"budget={budget} cannot give keep={keep} prompts min_per_prompt={low} rollouts each")
    kept = np.argsort(np.abs(v - float(target)), kind="stable")[:keep]  # stable: ties to the lower index
    allocation = np.zeros(v.size, dtype=np.int64)
    allocation[kept] = uniform_roots(keep, budget, min_per_prompt=low)
    return allocation
