"""TRACE's contrast objectives and their marginal gains, vectorised over numpy arrays.

`root_value` is Stage 1's objective (chance that a prompt's rollouts disagree) and `prefix_value` is
Stage 2's (chance that at least one continuation from a prefix flips the observed outcome). The
allocators in `trace_rl.core.solvers` maximise sums of these, and their exactness proofs rest on the
gains: both never increase with the count (Stage 1's from the first rollout on; the zero gain of that
first rollout is what makes a prompt's first pair one lumpy item).

All functions broadcast their arguments and return float64. They are written in log / expm1 form
because the direct formulas lose every digit where it matters: `1 - (1 - v)**m` cancels for small v,
and `q**k` is rounded to 1 when q is within 1e-16 of 1 (a prefix that almost surely repeats).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _minority_rate(v: ArrayLike) -> np.ndarray:
    """w = min(v, 1 - v), the rarer outcome's rate: V_root is symmetric in success and failure, and
    the rarer side is the one that must stay exact (1 - v is exact for v >= 1/2, Sterbenz's lemma)."""
    v = np.asarray(v, dtype=np.float64)
    return np.minimum(v, 1.0 - v)


def root_value(v: ArrayLike, m: ArrayLike) -> np.ndarray:
    """V_root = 1 - v**m - (1 - v)**m: chance that m rollouts of a prompt with success rate v are
    not all equal. 0 where m < 2 (one rollout, or none, has nothing to contrast with)."""
    w = _minority_rate(v)
    m = np.asarray(m, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        # 1 - (1-w)**m without cancellation, minus w**m which is small for w <= 1/2.
        value = -np.expm1(m * np.log1p(-w)) - w**m
    return np.where(m < 2, 0.0, value)


def root_gain(v: ArrayLike, m: ArrayLike) -> np.ndarray:
    """root_value(v, m + 1) - root_value(v, m): the value of one more rollout for a prompt holding m.

    For m >= 1 this is v(1-v) (v**(m-1) + (1-v)**(m-1)), non-increasing in m (so V_root is concave
    from m = 1 on); it is 0 for m <= 0, because the first rollout alone contrasts with nothing.
    Computed as that product, never as a difference, so it stays exact where it is tiny.
    """
    w = _minority_rate(v)
    m = np.asarray(m, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = w * (1.0 - w) * (w ** (m - 1.0) + np.exp((m - 1.0) * np.log1p(-w)))
    return np.where(m < 1, 0.0, gain)


def _flip_chance(v: ArrayLike, r: ArrayLike) -> np.ndarray:
    """p = 1 - q = r (1 - v) + (1 - r) v: chance one continuation does NOT repeat the observed outcome
    r. Kept as p rather than q so that q close to 1 keeps its precision."""
    v = np.asarray(v, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    return r * (1.0 - v) + (1.0 - r) * v


def prefix_value(v: ArrayLike, r: ArrayLike, k: ArrayLike) -> np.ndarray:
    """V_pref = 1 - q**k with q = r v + (1 - r)(1 - v): chance that at least one of k continuations
    from a prefix (predicted success v, observed outcome r) ends differently from r. k >= 0."""
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_q = np.log1p(-_flip_chance(v, r))  # -inf where q == 0
        exponent = np.where(k == 0, 0.0, k * log_q)  # q**0 == 1 even when q == 0
    return -np.expm1(exponent)


def prefix_gain(v: ArrayLike, r: ArrayLike, k: ArrayLike) -> np.ndarray:
    """prefix_value(v, r, k + 1) - prefix_value(v, r, k) = q**k (1 - q): non-increasing in k, so a
    threshold on these gains allocates Stage 2 exactly. k >= 0."""
    p = _flip_chance(v, r)
    k = np.asarray(k, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.where(k == 0, 0.0, k * np.log1p(-p))
    return p * np.exp(exponent)
