"""The chance that a group of rollouts mixes, when the success rate is uncertain and the rollouts of a
group are correlated; and BRACE's rule for choosing prompts by it.

DESIGN.md's value of a group of k rollouts from a prompt of success rate p is
g(p, k) = 1 − p^k − (1 − p)^k, read at a point estimate of p. Two things make that optimistic on real
runs (BRACE, "Measure First, Then Allocate", github.com/fatebreaker/brace, `brace/triage.py`):

- p is not known, only a posterior over it; the expectation E[g(p, k)] under a Beta(a, b) posterior is
  below g at the posterior mean wherever the posterior is wide (Jensen);
- the k rollouts of one group share a prompt and a policy, so they agree more often than k independent
  draws. BRACE models a group as exchangeable Beta-Binomial with mean p and concentration
  ν = (1 − ρ) / ρ (ρ the within-group correlation): P(all k succeed | p) = Π_{j<k} (νp + j) / (ν + j),
  which is p^k at ν = ∞ (independent draws) and p at ν = 0 (the group is one draw repeated).

Under both, the chance that all k agree is a polynomial in p, Σ_m c_m p^m, whose coefficients are a
probability distribution over m (they are non-negative and sum to the polynomial at p = 1, which is 1).
They follow from one recursion, c ← (ν·shift(c) + j·c) / (ν + j), with nothing to overflow, and
E[p^m] under Beta(a, b) is Π_{i<m} (a + i) / (a + b + i); so every expectation here is a dot product of
two non-negative vectors, exact to rounding at any k.

`brace_groups` is BRACE's selection of prompts (its v3 "group" rule, the one its README runs): each
prompt's weight is the posterior expected chance that a group of k mixes, prompts are drawn without
replacement with probability proportional to weight^(1/τ) (Efraimidis–Spirakis), and a share ε of the
groups goes uniformly to prompts the weighted draw left out, so no prompt's chance is ever zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from trace_rl.infra.config import FieldError, check_range

PUBLISHED_CONCENTRATION = 0.285
"""BRACE's ν (ρ = 0.78), fitted on its tool-use agents' first groups; `BraceBank` starts from it until
the run has enough groups of its own to fit ν (`fit_concentration`)."""


@dataclass
class BraceConfig:
    """The `brace` method's settings (`rollout.brace`); the defaults are BRACE's README command's
    (`--eps 0.10 --temp 0.3`, γ = 0.9, warm caps 20 / 40)."""

    group_size: int = 4
    """Rollouts each chosen prompt gets (BRACE's k, the trainer's group size); the Stage-1 budget buys
    budget // group_size groups, and a remainder goes one rollout at a time to the chosen prompts."""
    eps: float = 0.1
    """Share of the groups drawn uniformly among the prompts the weighted draw left out."""
    temperature: float = 0.3
    """τ: prompts are drawn with probability proportional to weight^(1/τ)."""
    decay: float = 0.9
    """γ: counts are multiplied by it once per pass over the training pool."""
    warm_bank: list[str] = field(default_factory=list)
    """Run folders (glob patterns allowed; `{seed}` is the run's seed) of earlier runs on the same tasks,
    whose saved trees start the counts; empty: every prompt starts at Beta(1, 1)."""
    warm_cap_successes: float = 20.0
    """Most successes the warm bank may give one prompt."""
    warm_cap_failures: float = 40.0
    """Most failures the warm bank may give one prompt."""
    concentration: float | None = None
    """ν of the group model to use throughout; None: fitted on the run's own groups, starting at BRACE's 0.285."""
    exclude_certified: bool = True
    """Drop from the training pool, before the run, the tasks whose scorer certifies them useless: it pays
    an empty answer (nothing to learn) or does not pay the task's own gold answer (nothing can pass)."""

    def __post_init__(self) -> None:
        check_range(self, "group_size", ge=2, why="one rollout has nothing to contrast with")
        check_range(self, "eps", ge=0, le=1)
        check_range(self, "temperature", gt=0)
        check_range(self, "decay", gt=0, le=1)
        check_range(self, "warm_cap_successes", ge=0)
        check_range(self, "warm_cap_failures", ge=0)
        check_range(self, "concentration", gt=0, nullable=True, why="null: fitted on the run's groups")
        if not isinstance(self.warm_bank, list) or not all(isinstance(p, str) and p for p in self.warm_bank):
            raise FieldError("warm_bank", self.warm_bank, "a list of run folders (glob patterns allowed)")


def agreement_coefficients(k: int, concentration: float) -> np.ndarray:
    """c_0..c_k with P(all k succeed | p) = Σ_m c_m p^m under the exchangeable model at ν = concentration
    (np.inf: independent draws, c = e_k). Non-negative, summing to 1."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not concentration > 0:
        raise ValueError(f"concentration must be > 0, got {concentration!r}")
    c = np.zeros(k + 1)
    c[0] = 1.0
    if np.isinf(concentration):
        c[:] = 0.0
        c[k] = 1.0
        return c
    nu = float(concentration)
    for j in range(k):  # multiply by (ν p + j) / (ν + j)
        c[1 : j + 2] = (nu * c[0 : j + 1] + j * c[1 : j + 2]) / (nu + j)
        c[0] = j * c[0] / (nu + j)
    return c


def beta_moments(a: ArrayLike, b: ArrayLike, k: int) -> np.ndarray:
    """E[p^m] for m = 0..k under Beta(a, b), one row per (a, b): shape (n, k + 1); a, b finite and > 0
    (a known p is `point_moments`)."""
    a = np.atleast_1d(np.asarray(a, dtype=np.float64))
    b = np.atleast_1d(np.asarray(b, dtype=np.float64))
    if a.shape != b.shape:
        raise ValueError(f"a and b differ in shape: {a.shape} and {b.shape}")
    if not (np.all(a > 0) and np.all(b > 0) and np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("Beta parameters must be finite and > 0")
    i = np.arange(k)
    ratios = (a[:, None] + i) / (a[:, None] + b[:, None] + i)
    return np.concatenate([np.ones((a.size, 1)), np.cumprod(ratios, axis=1)], axis=1)


def point_moments(p: ArrayLike, k: int) -> np.ndarray:
    """E[p^m] for m = 0..k when p is known (a point mass): shape (n, k + 1)."""
    p = np.atleast_1d(np.asarray(p, dtype=np.float64))
    return p[:, None] ** np.arange(k + 1)


def group_mixing(a: ArrayLike, b: ArrayLike, k: int, concentration: float) -> np.ndarray:
    """E[1 − P(all k succeed | p) − P(all k fail | p)] under p ~ Beta(a, b): BRACE's weight. k ≤ 1 gives 0."""
    if k <= 1:
        return np.zeros(np.atleast_1d(np.asarray(a)).shape)
    c = agreement_coefficients(k, concentration)
    return np.clip(1.0 - beta_moments(a, b, k) @ c - beta_moments(b, a, k) @ c, 0.0, 1.0)


def point_mixing(p: ArrayLike, k: int, concentration: float) -> np.ndarray:
    """1 − P(all k agree | p) at a known p (the plug-in; ν = ∞ gives DESIGN.md's 1 − p^k − (1 − p)^k)."""
    p = np.atleast_1d(np.asarray(p, dtype=np.float64))
    if k <= 1:
        return np.zeros(p.shape)
    c = agreement_coefficients(k, concentration)
    return np.clip(1.0 - point_moments(p, k) @ c - point_moments(1.0 - p, k) @ c, 0.0, 1.0)


def fit_concentration(
    a: ArrayLike, b: ArrayLike, k: ArrayLike, agreed: ArrayLike, *, low: float = 1e-3, high: float = 1e4
) -> float:
    """ν at which the groups' predicted chance of agreeing sums to how many did agree (BRACE fits its ν
    "by matching the degenerate fraction"). Each group: its prompt's Beta(a, b) before the group was
    seen, its size k (≥ 2) and whether all its rollouts agreed. See `match_concentration`."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    k, agreed = _groups(k, agreed, a.shape, b.shape)

    def predicted(nu: float) -> float:
        return float(sum(np.sum(1.0 - group_mixing(a[k == size], b[k == size], int(size), nu)) for size in np.unique(k)))

    return match_concentration(predicted, float(agreed.sum()), low=low, high=high)


def fit_repeat_concentration(
    p: ArrayLike, strength: ArrayLike, r: ArrayLike, k: ArrayLike, repeated: ArrayLike, *, low: float = 1e-3, high: float = 1e4
) -> float:
    """ν of Stage 2's continuations: each group is the k (≥ 2) continuations of one prefix, whose success
    rate had the posterior (mean p, strength, `repeat_probabilities`) when they were planned, and
    `repeated` says whether all of them repeated the outcome r of the rollout through the prefix."""
    p, strength, r = (np.asarray(x, dtype=np.float64) for x in (p, strength, r))
    k, repeated = _groups(k, repeated, p.shape, strength.shape, r.shape)
    top = int(k.max()) if k.size else 0

    def predicted(nu: float) -> float:
        stay = repeat_probabilities(p, strength, r, top, nu)
        return float(stay[np.arange(k.size), k].sum())

    return match_concentration(predicted, float(repeated.sum()), low=low, high=high)


def match_concentration(predicted: Callable[[float], float], observed: float, *, low: float = 1e-3, high: float = 1e4) -> float:
    """The ν at which `predicted(ν)`, a count of groups expected to agree that falls as ν grows, equals
    `observed`: bisection on log ν within [low, high]. More agreement than even ν = low predicts gives
    `low`; less than independent draws (ν = ∞) predict gives np.inf."""
    if observed <= predicted(np.inf):
        return float(np.inf)
    if observed >= predicted(low):
        return float(low)
    if observed <= predicted(high):
        return float(high)
    lo, hi = np.log(low), np.log(high)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if predicted(float(np.exp(mid))) > observed:
            lo = mid
        else:
            hi = mid
    return float(np.exp(0.5 * (lo + hi)))


def _groups(k: ArrayLike, flags: ArrayLike, *shapes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    k, flags = np.asarray(k, dtype=np.int64), np.asarray(flags, dtype=np.float64)
    if any(shape != k.shape for shape in shapes) or flags.shape != k.shape:
        raise ValueError("every argument must have one entry per group")
    if np.any(k < 2):
        raise ValueError("every group needs at least 2 rollouts to agree or not")
    if not k.size:
        raise ValueError("no groups to fit on")
    return k, flags


# ------------------------------------------------------------------ Stage 2 by the posterior expectation


@dataclass(frozen=True)
class PrefixPosterior:
    """Per Stage-2 candidate, the Beta posterior of its continuations' success rate (mean and strength
    a + b; np.inf: a point mass at the mean) and the concentration ν of a group of continuations: what
    Stage 2 allocates with when it values a prefix by the posterior expectation of mixing."""

    mean: np.ndarray
    strength: np.ndarray
    concentration: float = float("inf")

    def __len__(self) -> int:
        return int(np.asarray(self.mean).size)


def repeat_probabilities(p: ArrayLike, strength: ArrayLike, r: ArrayLike, k_max: int, concentration: float) -> np.ndarray:
    """M[i, k] = P(all k continuations from prefix i repeat its outcome r_i), k = 0..k_max, when their
    success rate has the posterior Beta(p·strength, (1 − p)·strength) (a point mass where strength is
    np.inf) and a group of them is exchangeable with concentration ν. M[:, 0] = 1; non-increasing in k."""
    p, strength, r = (np.atleast_1d(np.asarray(x, dtype=np.float64)) for x in (p, strength, r))
    if not (p.shape == strength.shape == r.shape):
        raise ValueError("p, strength and r must have one entry per prefix")
    if np.any((p < 0) | (p > 1)) or np.any(~np.isin(r, (0.0, 1.0))) or np.any(~(strength > 0)):
        raise ValueError("p must lie in [0, 1], r be 0 or 1 and strength be > 0")
    coefficients = np.zeros((k_max + 1, k_max + 1))  # row k: P(all k succeed | rate) as Σ_m c_m rate^m
    for k in range(k_max + 1):
        coefficients[k, : k + 1] = agreement_coefficients(k, concentration)
    side = np.where(r == 1.0, p, 1.0 - p)  # the chance of one continuation repeating r
    point = np.isinf(strength)
    moments = np.empty((p.size, k_max + 1))
    if point.any():
        moments[point] = point_moments(side[point], k_max)
    if (~point).any():
        a = np.clip(side[~point] * strength[~point], 1e-12, None)
        b = np.clip((1.0 - side[~point]) * strength[~point], 1e-12, None)
        moments[~point] = beta_moments(a, b, k_max)
    return np.clip(moments @ coefficients.T, 0.0, 1.0)


MAX_GAIN_TABLE = 20_000_000
"""Most (candidate, continuation) gains `expand_expected` tabulates; beyond it, cap `max_per_prefix`."""


def expand_expected(posterior: PrefixPosterior, r: ArrayLike, budget: int, *, max_per_prefix: int | None = None) -> np.ndarray:
    """Stage 2 by the posterior expectation: continuations per candidate prefix, maximising
    Σ_c (1 − M_c(k_c)), the expected number of anchors that turn mixed (`repeat_probabilities`).
    M_c(k) is a mixture of k-th powers of a repeat rate, so its gains M_c(k − 1) − M_c(k) never grow
    with k: taking the largest gains over all candidates is optimal (as for `allocate.expand_prefixes`,
    which this equals at a point mass and ν = ∞). Σ k = min(budget, capacity); gains that are 0 are
    taken last; equal gains go to the lower index, then the earlier continuation. Int64 counts."""
    r = np.asarray(r, dtype=np.float64)
    n = len(posterior)
    if budget < 0 or (max_per_prefix is not None and max_per_prefix < 0):
        raise ValueError("budget and max_per_prefix must be >= 0")
    cap = budget if max_per_prefix is None else int(max_per_prefix)
    total = min(int(budget), cap * n)
    if n == 0 or total == 0:
        return np.zeros(n, dtype=np.int64)
    k_max = min(cap, total)
    if n * k_max > MAX_GAIN_TABLE:
        raise ValueError(f"{n} candidates x {k_max} continuations each is too large a gain table; set rollout.max_per_prefix")
    stay = repeat_probabilities(posterior.mean, posterior.strength, r, k_max, posterior.concentration)
    gains = np.clip(stay[:, :-1] - stay[:, 1:], 0.0, None)
    rows, ks = np.indices(gains.shape)
    order = np.lexsort((ks.ravel(), rows.ravel(), -gains.ravel()))[:total]
    return np.bincount(rows.ravel()[order], minlength=n).astype(np.int64)


def brace_groups(
    weights: ArrayLike, groups: int, *, eps: float, temperature: float, rng: np.random.Generator
) -> np.ndarray:
    """Which prompts get a group: a 0/1 array with `min(groups, n)` ones. `groups − round(ε·groups)` are
    drawn without replacement with probability proportional to weight^(1/τ) (Efraimidis–Spirakis keys
    −log(u) / w; weights floored at 1e-12 as BRACE does, so a zero weight is drawn last, not never),
    then round(ε·groups) uniformly among the prompts not yet drawn."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or np.any(~np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be a 1-D array of finite numbers >= 0")
    if not 0 <= eps <= 1:
        raise ValueError(f"eps must be in [0, 1], got {eps!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    groups = min(int(groups), w.size)
    chosen = np.zeros(w.size, dtype=np.int64)
    if groups <= 0:
        return chosen
    uniform = round(eps * groups)
    scaled = np.clip(w, 1e-12, None) ** (1.0 / temperature)
    keys = -np.log(np.clip(rng.random(w.size), 1e-300, 1.0)) / np.clip(scaled, 1e-300, None)
    chosen[np.argsort(keys, kind="stable")[: groups - uniform]] = 1
    rest = np.flatnonzero(chosen == 0)
    chosen[rng.permutation(rest)[:uniform]] = 1
    return chosen
