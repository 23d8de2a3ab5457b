"""Exact rollout-budget solvers for TRACE's two stages (the baselines they beat: `trace_rl.core.baselines`).

- `allocate_roots` (Stage 1): rollouts per prompt, maximising Σ root_value(v_i, m_i) with
  m_i ∈ {0} ∪ [min_per_prompt, max_per_prompt] and Σ m_i == budget.
- `expand_prefixes` (Stage 2): continuations per prefix, maximising Σ prefix_value(v_c, r_c, k_c) with
  0 <= k_c <= max_per_prefix and Σ k_c == min(budget, capacity).
- `expand_for_prompts` (Stage 2, `rollout.stage2_objective: prompt`): continuations per prefix,
  maximising the expected number of prompts that end mixed, then the paper's objective with what is
  left (see its docstring).
- Baselines at an equal budget: `uniform_roots` (GRPO), `random_prefixes` (TreePO / Tree-GRPO style
  random tree), and the published prompt-level rules under their own names: `knapsack_roots`
  (Knapsack-RL as released) and `pcl_roots` (PCL: keep the prompts predicted nearest p = 0.5). TRACE's
  Stage 1 alone (`prompt_only`, `trace_stage1`) is `allocate_roots` given the whole budget.
  `trace_rl.planning.methods` maps each method name to these.

Why the solvers are exact (w = min(v, 1 - v); f(m) = root_value(v, m); L, U = min/max per prompt):

1. Diminishing returns. f(m+1) - f(m) = w(1-w)(w^(m-1) + (1-w)^(m-1)) for m >= 1, non-increasing in m;
   prefix_value's gains q^k (1-q) are non-increasing in k. For concave gains under one budget, taking
   the largest gains is optimal (Gross 1956), so Stage 2 is a threshold on the gains. Stage 1 is not
   concave: m = 1 is forbidden and f(0) = 0, so the first L rollouts of a prompt are one lumpy item.
2. Dominance. df/dw = m((1-w)^(m-1) - w^(m-1)) >= 0 on [0, 1/2]: a prompt closer to 1/2 is worth at
   least as much at every m. Moving a whole allocation to an unused prompt closer to 1/2 keeps the
   bounds (they are the same for every prompt) and never lowers the objective, so some optimum uses
   exactly the `a` prompts closest to 1/2, for some a with aL <= budget <= aU.
3. Fixed a. With those a prompts at L each, the R = budget - aL extra rollouts have concave gains, so
   (1) gives the exact best F(a); LP duality gives F(a) = min over λ of UB_λ(a), where
   UB_λ(a) = λR + Σ_{i<a} (f_i(L) + Σ_{L<=m<U} (gain_i(m) - λ)^+).
4. Branch and bound over a. Weak duality makes UB_λ(a) an upper bound on F(a) for every λ, and one λ
   bounds every a at once (prefix sums). Start with λ from the LP relaxation (the concave envelope:
   L units at slope f(L)/L, which is >= every later gain because m·gain(m) <= f(m)); then repeatedly
   evaluate F exactly at the a with the largest bound and add the bound from that fill's threshold,
   which is tight at that a. Stop when no bound exceeds the best F found: nothing pruned can beat
   it. The LP only aims the search (any λ gives valid bounds), so exactness rests on 1-3 alone.
   Typically one or two evaluations of F; never more than the number of feasible a.

Every marginal gain is handled as its logarithm (a "key"), so gains far below 1e-308 still order
correctly. Ties are broken deterministically: Stage 2 gives equal gains to the lower index first;
Stage 1 prefers more active prompts among equally good allocations (so v = 1/2 everywhere gives
the uniform split), activates prompts closer to 1/2 first, then the lower index, and fills equal
gains in that same order. Objectives are compared with a relative tolerance of 1e-13 (floating-point noise), so
"exact" means optimal up to that.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import ArrayLike

from trace_rl.core.contrast import root_value

_BAND_MIN, _BAND_MAX = 256, 4096
"""A threshold bracket holding at most as many units as there are items, clipped to these, is
settled by sorting it: cheaper than another pass over the items."""
_SAMPLE = 4096
"""Inputs of 8x this many items or more first solve a strided sample of about this size."""
_MAX_STEPS = 4000
"""Probes per search before declaring a bug: doubling steps then bisection reach any float in fewer."""
_REL_TOL = 1e-13
"""Relative tolerance on Stage-1 objectives: far above float noise, far below any real difference."""


# ---------------------------------------------------------------------------------------- validation


def _probabilities(name: str, values: ArrayLike) -> np.ndarray:
    """1-D float64 copy of `values`, checked to be numbers in [0, 1]."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an array of numbers in [0, 1]: {exc}") from exc
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size and not (array.min() >= 0.0 and array.max() <= 1.0):  # NaN fails both
        bad = np.flatnonzero(~((array >= 0.0) & (array <= 1.0)))
        raise ValueError(f"{name} must lie in [0, 1] (no NaN), got {name}[{bad[0]}] = {array[bad[0]]}")
    return array


def _outcomes(name: str, values: ArrayLike, *, like: np.ndarray) -> np.ndarray:
    """1-D float64 copy of `values`, checked to be exactly 0 or 1 and as long as `like`."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an array of outcomes 0 or 1: {exc}") from exc
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size != like.size:
        raise ValueError(f"{name} has {array.size} entries but v has {like.size}")
    bad = np.flatnonzero((array != 0.0) & (array != 1.0))
    if bad.size:
        raise ValueError(f"{name} must be 0 or 1 (an observed outcome), got {name}[{bad[0]}] = {array[bad[0]]}")
    return array


def _per_prompt_bounds(min_per_prompt: object, max_per_prompt: object, *, minimum: int) -> tuple[int, int | None]:
    """(min_per_prompt, max_per_prompt or None) checked as whole numbers, the max not below the min."""
    low = _whole("min_per_prompt", min_per_prompt, minimum=minimum)
    high = None if max_per_prompt is None else _whole("max_per_prompt", max_per_prompt, minimum=0)
    if high is not None and high < low:
        raise ValueError(f"max_per_prompt={high} must be >= min_per_prompt={low}")
    return low, high


def _whole(name: str, value: object, *, minimum: int) -> int:
    """An integer >= minimum. Python and numpy integers pass; floats (even 3.0) and bools do not,
    so a budget computed as `total * share` must be rounded where its rounding rule is visible."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


# ------------------------------------------------------------------- top-k over concave unit sequences


class _Units(Protocol):
    """`size` items, each offering `cap` units whose keys (log gains) never increase along the item.

    `finite[i]` units of item i have a key above -inf (the rest carry no gain); `gainful` is their sum.
    `count_above(t)` is #{j: key(i, j) > t} per item (integer-valued, any dtype), exact with respect
    to `keys` and non-decreasing as t falls. `density(counts)` estimates -dN/dt at the threshold that
    produced `counts` (N = counts.sum()); it only aims the search. `every(stride)` is every
    stride-th item, to aim the search on large inputs.
    """

    size: int
    cap: int

    @property
    def finite(self) -> np.ndarray: ...

    @property
    def gainful(self) -> int: ...

    def count_above(self, t: float) -> np.ndarray: ...

    def keys(self, item: np.ndarray, j: np.ndarray) -> np.ndarray: ...

    def density(self, counts: np.ndarray) -> float: ...

    def every(self, stride: int) -> _Units: ...


class _Probe(NamedTuple):
    """Per-item counts of the keys above threshold t, and their sum."""

    t: float
    counts: np.ndarray
    total: int


def _take_top(units: _Units, total: int, t_guess: float) -> np.ndarray:
    """Units per item (int64) that take the `total` largest keys, 0 <= total <= size * cap.

    Searches a threshold with about `total` keys above it, then sorts the few units near it. Equal
    keys go to the lower item index, then to the earlier unit. Large inputs first solve a strided
    sample, whose threshold and slope aim the search: 2-3 passes over the items instead of 5-6.
    """
    if total >= units.gainful:  # every unit with a gain, then gainless units in index order
        finite = units.finite
        return (finite + _in_order(units.cap - finite, total - units.gainful)).astype(np.int64)
    if total == 0:
        return np.zeros(units.size, dtype=np.int64)
    starts, slope = [t_guess], None
    if units.size >= 8 * _SAMPLE:
        stride = units.size // _SAMPLE
        sample = units.every(stride)
        share = round(total * sample.size / units.size)
        if 0 < share < sample.gainful:
            above, below = _search(sample, share, starts, None, band_limit=64)
            spread = above.total - below.total
            if _adjacent(above.t, below.t):  # a block of equal keys: probe both of its sides
                starts = [below.t, above.t]
            elif spread:
                starts = [above.t + (below.t - above.t) * (above.total - share) / spread]
                slope = spread * units.size / (sample.size * (below.t - above.t))
            else:
                starts = [above.t]
    band_limit = max(_BAND_MIN, min(units.size, _BAND_MAX))
    above, below = _search(units, total, starts, slope, band_limit=band_limit)
    return _settle(units, above, below, total)


def _search(
    units: _Units, total: int, starts: list[float], slope: float | None, *, band_limit: int
) -> tuple[_Probe, _Probe]:
    """Probes `above` and `below` with above.total >= total >= below.total and at most `band_limit`
    units between them, or only equal keys. Probes `starts` first, then takes secant steps on the
    count (the first along `slope`, else `density`), kept inside the bracket; when they stall, it
    narrows the bracket to its keys and bisects."""
    above = below = previous = None
    queue = [t if np.isfinite(t) else 0.0 for t in starts]
    t, step, last_miss = queue.pop(0), 1.0, None
    for _ in range(_MAX_STEPS):
        counts = units.count_above(t)
        n = int(counts.sum())
        probe = _Probe(t, counts, n)
        if n == total:
            return probe, probe
        if n > total:
            above = probe
        else:
            below = probe
        bracketed = above is not None and below is not None
        if bracketed and (above.total - below.total <= band_limit or _adjacent(above.t, below.t)):
            return above, below
        if queue:
            previous, t = probe, queue.pop(0)
            continue
        if previous is not None and previous.total != n:
            slope = (previous.total - n) / (t - previous.t)  # -dN/dt, as seen by the last two probes
        elif slope is None or previous is not None:
            slope = units.density(counts)
        previous = probe
        # Aim a little past `total`, so that the next probe most likely brackets it with a small band.
        overshoot = band_limit // 4 if n > total else -(band_limit // 4)
        aimed = t + (n - total + overshoot) / slope if slope > 0 else np.nan
        if not np.isfinite(aimed) or aimed == t:  # no unit is priced near t: walk, doubling the steps
            aimed = t + (step if n > total else -step)
        step *= 2.0
        if bracketed:
            stalled = last_miss is not None and 2 * abs(n - total) > last_miss
            if stalled or not above.t < aimed < below.t:
                above, below = _snap(units, above, below)
                if _adjacent(above.t, below.t):
                    return above, below
                aimed = 0.5 * (above.t + below.t)
        last_miss = abs(n - total)
        t = aimed
    raise RuntimeError(f"threshold search did not converge in {_MAX_STEPS} steps (please report)")


def _adjacent(low: float, high: float) -> bool:
    """No float lies strictly between: every key in (low, high] equals high."""
    return not low < 0.5 * (low + high) < high


def _in_order(room: np.ndarray, amount: int) -> np.ndarray:
    """`amount` units handed out in index order, each item up to its room."""
    return np.clip(amount - (np.cumsum(room) - room), 0, room)


def _snap(units: _Units, above: _Probe, below: _Probe) -> tuple[_Probe, _Probe]:
    """Narrow a bracket to the keys actually inside it, with the same counts: lets bisection split
    clusters at once, and reveals ties (then no threshold can split the band, and none must)."""
    rows = np.flatnonzero(above.counts != below.counts)
    largest = units.keys(rows, below.counts[rows]).max()  # keys fall along each item
    smallest = units.keys(rows, above.counts[rows] - 1).min()
    return above._replace(t=float(np.nextafter(smallest, -np.inf))), below._replace(t=float(largest))


def _settle(units: _Units, above: _Probe, below: _Probe, total: int) -> np.ndarray:
    """Finish `_take_top`: take the best units above `above.t` but not above `below.t`."""
    counts = below.counts.astype(np.int64)
    extra = above.counts - below.counts  # >= 0: counts grow as t falls
    if _adjacent(above.t, below.t):  # all equal: the lower index first
        return counts + _in_order(extra, total - below.total).astype(np.int64)
    rows = np.flatnonzero(extra)
    extra = extra[rows].astype(np.int64)
    position = np.repeat(np.arange(rows.size), extra)
    j = counts[rows][position] + np.arange(position.size) - np.repeat(np.cumsum(extra) - extra, extra)
    chosen = np.argsort(-units.keys(rows[position], j), kind="stable")[: total - below.total]  # ties: by row
    counts[rows] += np.bincount(position[chosen], minlength=rows.size)
    return counts


def _largest_untaken_key(units: _Units, counts: np.ndarray) -> float:
    """The best key left out by `counts` (-inf when every unit is taken): a threshold that is exact
    for this fill, which is what Stage 1's duality bound needs."""
    open_items = np.flatnonzero(counts < units.cap)
    if open_items.size == 0:
        return -np.inf
    return float(units.keys(open_items, counts[open_items]).max())


# ------------------------------------------------------------------------------------------ Stage 2


@dataclass
class _PrefixUnits:
    """Stage-2 units: continuation j of a candidate has key log(p) + j·log(q), with p = 1 - q."""

    first: np.ndarray  # log p: the first continuation's key; -inf when q == 1 (never any gain)
    per_log: np.ndarray  # 1 / -log q: continuations per unit of key; 0 when q == 0, inf when q == 1
    cap: int

    @property
    def size(self) -> int:
        return self.first.size

    @property
    def finite(self) -> np.ndarray:
        gainful = np.where(self.per_log > 0.0, self.cap, min(self.cap, 1))  # q == 0: only the first
        return np.where(self.first > -np.inf, gainful, 0)

    @property
    def gainful(self) -> int:
        only_first = np.count_nonzero(self.per_log == 0.0)  # q == 0
        return self.cap * np.count_nonzero(self.first > -np.inf) - (self.cap - min(self.cap, 1)) * only_first

    def count_above(self, t: float) -> np.ndarray:
        units = self.first - t
        units *= self.per_log  # j < this; and j = 0 counts as soon as first > t
        np.ceil(units, out=units)
        np.clip(units, 1, self.cap, out=units)
        units *= self.first > t
        return units

    def keys(self, item: np.ndarray, j: np.ndarray) -> np.ndarray:
        first = self.first[item]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(j == 0, first, first - j / self.per_log[item])

    def density(self, counts: np.ndarray) -> float:
        return float(np.sum(self.per_log, where=(counts > 0) & (counts < self.cap)))

    def every(self, stride: int) -> _PrefixUnits:
        return _PrefixUnits(self.first[::stride], self.per_log[::stride], self.cap)


def expand_prefixes(v: ArrayLike, r: ArrayLike, budget: int, *, max_per_prefix: int | None = None) -> np.ndarray:
    """Stage 2: continuations per candidate prefix, maximising Σ prefix_value(v_c, r_c, k_c).

    v: predicted success from each prefix, in [0, 1]; r: the observed outcome of the rollout the prefix
    belongs to, each exactly 0 or 1; same length. Σ k == min(budget, capacity), capacity being
    len(v) · max_per_prefix (unbounded when None). Continuations that gain nothing (from a prefix that
    always repeats its outcome, q == 1, or any after the first when q == 0) are placed only after
    every continuation with a gain, because the budget must be spent. Equal gains go to the lower
    index first. Returns int64 counts, one per candidate; raises ValueError naming the argument for
    bad input.
    """
    v = _probabilities("v", v)
    r = _outcomes("r", r, like=v)
    budget = _whole("budget", budget, minimum=0)
    cap = budget if max_per_prefix is None else _whole("max_per_prefix", max_per_prefix, minimum=0)
    if v.size == 0:
        return np.zeros(0, dtype=np.int64)
    # In place, because at 1e5+ candidates fresh arrays cost more than the arithmetic.
    scratch = np.subtract(r, v)
    flip = np.abs(scratch, out=scratch)  # p: chance that one continuation flips the observed outcome
    with np.errstate(divide="ignore"):
        first = np.log(flip)
        per_log = np.divide(-1.0, np.log1p(np.negative(flip, out=scratch), out=scratch), out=scratch)
    return _take_top(_PrefixUnits(first, per_log, cap), min(budget, cap * v.size), t_guess=np.log(0.5))


def expand_for_prompts(
    v: ArrayLike, r: ArrayLike, prompts: ArrayLike, mixed: ArrayLike, budget: int, *, max_per_prefix: int | None = None
) -> np.ndarray:
    """Stage 2 that counts prompts: continuations per candidate prefix, maximising the expected number
    of prompts whose leaves end with both a success and a failure (what the effective ratio counts).

    v, r: as in `expand_prefixes`; prompts: each candidate's prompt (any integer ids); mixed: per
    candidate, whether its prompt's bare rollouts already mixed. A mixed prompt is counted whatever
    Stage 2 does; a prompt whose bare rollouts all agree (so every r of it is the same R) ends mixed
    unless every continuation repeats R: with q_c = r v + (1 - r)(1 - v) as in `prefix_value`, its
    chance is 1 - Π_c q_c^k_c. For a given number of continuations that product is smallest when they
    go to the prefixes with the smallest q first (each up to max_per_prefix), and then the t-th
    continuation's gain, (Π of the q's before it)·(1 - q of its prefix), is non-increasing in t: each
    prompt's value is concave in its continuations, so taking the largest gains over all prompts is
    optimal (as for `expand_prefixes`). Ties go to the lower candidate index first.

    What no gain can use (every agreeing prompt saturated, or none left: only mixed prompts) is spent
    on the paper's objective, `prefix_value`'s gains from the counts reached so far, so exactly
    min(budget, capacity) continuations are placed; the first objective is exact, this remainder is
    the paper's greedy given it. Returns int64 counts, one per candidate.
    """
    v = _probabilities("v", v)
    r = _outcomes("r", r, like=v)
    groups = np.asarray(prompts)
    done = np.asarray(mixed, dtype=bool)
    if groups.shape != v.shape or done.shape != v.shape:
        raise ValueError(f"prompts and mixed must have one entry per candidate ({v.size}), got {groups.shape} and {done.shape}")
    budget = _whole("budget", budget, minimum=0)
    cap = budget if max_per_prefix is None else _whole("max_per_prefix", max_per_prefix, minimum=0)
    counts = np.zeros(v.size, dtype=np.int64)
    total = min(budget, cap * v.size)
    if total == 0:
        return counts
    flip = np.abs(r - v)  # 1 - q: one continuation's chance to differ from the observed outcome
    units_candidate, units_gain = [], []
    for group in np.unique(groups[~done]):
        members = np.flatnonzero((groups == group) & ~done)
        order = members[np.argsort(-flip[members], kind="stable")]  # smallest q first; ties: lower index
        sequence = np.repeat(order, cap)[:total]  # the continuations in the order this prompt takes them
        q = 1.0 - flip[sequence]
        before = np.concatenate(([1.0], np.cumprod(q)[:-1]))
        units_candidate.append(sequence)
        units_gain.append(before * flip[sequence])
    if units_candidate:
        candidate, gain = np.concatenate(units_candidate), np.concatenate(units_gain)
        position = np.concatenate([np.arange(u.size) for u in units_candidate])
        useful = gain > 0.0
        candidate, gain, position = candidate[useful], gain[useful], position[useful]
        taken = np.lexsort((position, candidate, -gain))[:total]  # largest gain; ties: lower index, earlier unit
        np.add.at(counts, candidate[taken], 1)
    left = total - int(counts.sum())
    if left > 0:  # the paper's gains q^k (1 - q), continuing from the counts reached
        room = cap - counts
        owner = np.repeat(np.arange(v.size), np.minimum(room, left))
        k = counts[owner] + np.concatenate([np.arange(n) for n in np.minimum(room, left)]) if owner.size else owner
        q_owner = 1.0 - flip[owner]
        with np.errstate(divide="ignore", invalid="ignore"):
            extra = np.where(k == 0, 1.0, np.exp(k * np.log(q_owner))) * flip[owner]
        taken = np.lexsort((k, owner, -extra))[:left]
        np.add.at(counts, owner[taken], 1)
    return counts


# ------------------------------------------------------------------------------------------ Stage 1


@dataclass
class _RootIncrements:
    """Stage-1 units beyond each prompt's first L rollouts; prompts sorted by w = min(v, 1-v), largest
    first. Unit j of a prompt is rollout L + j + 1; with x = L - 1 + j its key is
    log root_gain(v, L + j) = log(w(1-w)) - x·α + log1p(exp(-x·β)), α = -log(1-w), β = log((1-w)/w).
    """

    scale: np.ndarray  # log(w(1-w)); -inf where w == 0 (such prompts never gain)
    rate: np.ndarray  # α > 0: the key's slope from the failure-side term (1-w)^x, which dominates
    skew: np.ndarray  # β >= 0: how fast the success-side term w^x fades relative to it
    start: int  # x of unit 0, i.e. L - 1
    cap: int  # units per prompt: U - L
    positive: int  # prompts with w > 0; they come first in the sorted order

    @property
    def size(self) -> int:
        return self.scale.size

    @property
    def finite(self) -> np.ndarray:
        return np.where(np.arange(self.size) < self.positive, self.cap, 0)

    @property
    def gainful(self) -> int:
        return self.positive * self.cap

    def head(self, size: int) -> _RootIncrements:
        """The same units restricted to the `size` prompts closest to 1/2."""
        rows = slice(None, size)
        return _RootIncrements(
            self.scale[rows], self.rate[rows], self.skew[rows], self.start, self.cap, min(self.positive, size)
        )

    def tail(self, start: int) -> _RootIncrements:
        """The same units for the prompts after the first `start`."""
        rows = slice(start, None)
        return _RootIncrements(
            self.scale[rows], self.rate[rows], self.skew[rows], self.start, self.cap, max(self.positive - start, 0)
        )

    def every(self, stride: int) -> _RootIncrements:
        rows = slice(None, None, stride)
        return _RootIncrements(
            self.scale[rows], self.rate[rows], self.skew[rows], self.start, self.cap, -(-self.positive // stride)
        )

    def keys(self, item: np.ndarray, j: np.ndarray) -> np.ndarray:
        x = self.start + j
        return self.scale[item] - x * self.rate[item] + np.log1p(np.exp(-x * self.skew[item]))

    def count_above(self, t: float) -> np.ndarray:
        counts = np.zeros(self.size, dtype=np.int64)
        n, top = self.positive, float(self.start + self.cap)
        target = self.scale[:n] - t
        rate, skew = self.rate[:n], self.skew[:n]
        # key(x) > t  <=>  H(x) = α x - log1p(exp(-β x)) - (scale - t) < 0. H is concave and increasing
        # and its root lies above (scale - t)/α, so Newton from there climbs to the root in few steps.
        x = np.clip(target / rate, 0.0, top)
        for _ in range(2):
            fade = np.exp(-skew * x)
            x = np.clip(x - (rate * x - np.log1p(fade) - target) / (rate + skew * fade / (1.0 + fade)), 0.0, top)
        estimate = np.clip(np.ceil(x) - self.start, 0, self.cap).astype(np.int64)
        counts[:n] = self._exact(estimate, t)
        return counts

    def _exact(self, counts: np.ndarray, t: float) -> np.ndarray:
        """Correct estimated counts to exactly #{j: key(j) > t}: keys never increase along a prompt
        (in floating point too), so stepping until the boundary key is on the right side suffices."""
        items = np.flatnonzero(counts > 0)
        while items.size:
            items = items[self.keys(items, counts[items] - 1) <= t]
            counts[items] -= 1
            items = items[counts[items] > 0]
        items = np.flatnonzero(counts < self.cap)
        while items.size:
            items = items[self.keys(items, counts[items]) > t]
            counts[items] += 1
            items = items[counts[items] < self.cap]
        return counts

    def density(self, counts: np.ndarray) -> float:
        return float(np.sum(1.0 / self.rate[(counts > 0) & (counts < self.cap)]))


@dataclass
class _RootEnvelope:
    """Stage 1's LP relaxation (concave envelope): a prompt's first L rollouts become L units at slope
    root_value(v, L)/L, which is at least every later gain, followed by the increments."""

    increments: _RootIncrements
    activation: np.ndarray  # log(root_value(v, L) / L); -inf where w == 0
    lump: int  # L

    @property
    def size(self) -> int:
        return self.increments.size

    @property
    def cap(self) -> int:
        return self.lump + self.increments.cap

    @property
    def finite(self) -> np.ndarray:
        return np.where(self.activation > -np.inf, self.lump + self.increments.finite, 0)

    @property
    def gainful(self) -> int:
        return self.increments.positive * self.cap

    def every(self, stride: int) -> _RootEnvelope:
        return _RootEnvelope(self.increments.every(stride), self.activation[::stride], self.lump)

    def keys(self, item: np.ndarray, j: np.ndarray) -> np.ndarray:
        later = self.increments.keys(item, np.maximum(j - self.lump, 0))
        return np.where(j < self.lump, self.activation[item], later)

    def count_above(self, t: float) -> np.ndarray:
        return np.where(self.activation > t, self.lump + self.increments.count_above(t), 0)

    def density(self, counts: np.ndarray) -> float:
        return self.increments.density(np.maximum(counts - self.lump, 0))


def _infeasible(budget: int, prompts: int, low: int, high: int | None) -> str:
    """Why `budget` rollouts cannot be placed exactly: the message for allocate_roots' ValueError."""
    if prompts == 0:
        return f"budget={budget} cannot be placed: v is empty, there are no prompts"
    if budget < low:
        return f"budget={budget} cannot be placed: a prompt gets 0 or at least min_per_prompt={low} rollouts"
    if high is not None and budget > prompts * high:
        return f"budget={budget} exceeds the capacity of {prompts} prompts x max_per_prompt={high}"
    return (
        f"budget={budget} cannot be placed exactly: no number of prompts a <= {prompts} has "
        f"a*min_per_prompt={low} <= budget <= a*max_per_prompt={high}"
    )


def allocate_roots(
    v: ArrayLike, budget: int, *, min_per_prompt: int = 2, max_per_prompt: int | None = None
) -> np.ndarray:
    """Stage 1: rollouts per prompt, maximising Σ root_value(v_i, m_i) with Σ m_i == budget exactly.

    Each m_i is 0 (prompt filtered out) or in [min_per_prompt, max_per_prompt]; max_per_prompt=None
    means no cap. min_per_prompt must be >= 2: a single rollout contrasts with nothing, so the bound
    could only waste budget. Among equally good prompts the one closer to v = 1/2, then the lower
    index, is used first. Returns int64 counts, one per prompt. Raises ValueError naming the argument
    for bad input, and when no allocation meets the budget exactly under the bounds (say budget=1,
    or budget above len(v) * max_per_prompt). The module docstring proves exactness.
    """
    v = _probabilities("v", v)
    budget = _whole("budget", budget, minimum=0)
    low, high = _per_prompt_bounds(min_per_prompt, max_per_prompt, minimum=2)
    allocation = np.zeros(v.size, dtype=np.int64)
    if budget == 0:
        return allocation
    each = budget if high is None else min(high, budget)  # the most one prompt can take
    fewest, most = -(-budget // each), min(v.size, budget // low)  # feasible numbers of prompts
    if fewest > most:
        raise ValueError(_infeasible(budget, v.size, low, high))

    minority = np.minimum(v, 1.0 - v)  # the rarer outcome's rate; value grows with it (proof step 2)
    order = np.argsort(-minority, kind="stable")[:most]  # the prompts that may be used, best first
    w = minority[order]
    with np.errstate(divide="ignore"):
        increments = _RootIncrements(
            scale=np.log(w * (1.0 - w)),
            rate=-np.log1p(-w),
            skew=np.log((1.0 - w) / w),
            start=low - 1,
            cap=each - low,
            positive=int(np.count_nonzero(w > 0.0)),
        )
        envelope = _RootEnvelope(increments, np.log(root_value(w, low) / low), lump=low)
    sizes = np.arange(fewest, most + 1)

    def upper_bounds(t: float, extra: np.ndarray) -> np.ndarray:
        """UB_λ(a) for every feasible a, λ = exp(t), given extra[i] = #{gains of prompt i above λ}:
        weak duality for the fill of the top a prompts."""
        lam = np.exp(t)
        per_prompt = root_value(w, low + extra) - lam * extra  # max over m >= L of f(m) - λ(m - L)
        return lam * (budget - low * sizes) + np.cumsum(per_prompt)[sizes - 1]

    lp = _take_top(envelope, budget, t_guess=_lp_guess(envelope, budget))
    t = _largest_untaken_key(envelope, lp)
    # The LP took every unit above t; a prompt short of L units has no gain above t (gain(L) <= f(L)/L).
    bound = upper_bounds(t, np.maximum(lp - low, 0))
    best_value, best_size, best_fill = -np.inf, 0, np.zeros(0, dtype=np.int64)
    while True:
        # Sizes that could beat the best, or tie it with more prompts: ties go to coverage, so a
        # predictor that knows nothing (v = 1/2 everywhere) gives the uniform split.
        slack = _REL_TOL * max(1.0, best_value) if best_value > -np.inf else 0.0
        open_ = (bound > best_value + slack) | ((bound >= best_value - slack) & (sizes > best_size))
        if not open_.any():
            break
        top = bound[open_].max()
        k = int(np.flatnonzero(open_ & (bound >= top - _REL_TOL * max(1.0, abs(top))))[-1])  # the largest size
        size = int(sizes[k])
        head = increments.head(size)
        fill = _take_top(head, budget - size * low, t_guess=t)
        value = float(root_value(w[:size], low + fill).sum())
        if value > best_value + slack or (value >= best_value - slack and size > best_size):
            best_value, best_size, best_fill = value, size, fill
        t = _largest_untaken_key(head, fill)
        rest = increments.finite[size:] if t == -np.inf else increments.tail(size).count_above(t)
        bound = np.minimum(bound, upper_bounds(t, np.concatenate([fill, rest])))
        bound[k] = -np.inf  # F(size) is known exactly now
    allocation[order[:best_size]] = low + best_fill
    return allocation


def _lp_guess(envelope: _RootEnvelope, budget: int) -> float:
    """A threshold near the LP's, to start its search: the activation slope of the first prompt left
    out when every prompt takes L rollouts, or else the key of the average prompt's last rollout."""
    lump, prompts = envelope.lump, envelope.size
    if budget < lump * prompts:
        guess = envelope.activation[budget // lump]
    else:
        extra = max(0, min((budget - lump * prompts) // prompts, envelope.increments.cap - 1))
        items = np.arange(envelope.increments.positive)
        guess = np.median(envelope.increments.keys(items, np.full(items.size, extra))) if items.size else 0.0
    return float(guess) if np.isfinite(guess) else 0.0
