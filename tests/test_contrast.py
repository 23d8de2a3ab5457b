"""V_root, V_pref and their marginal gains: definitions, precision, and the shape facts the solvers use."""

from decimal import Decimal, localcontext

import numpy as np
import pytest

from trace_rl.core.contrast import prefix_gain, prefix_value, root_gain, root_value

V = np.array([0.0, 1e-9, 0.01, 0.2, 0.3, 0.5, 0.7, 0.99, 1.0])
M = np.arange(0, 60)


def test_root_value_matches_its_definition() -> None:
    v, m = V[:, None], M[None, :]
    direct = np.where(m < 2, 0.0, 1.0 - v**m - (1.0 - v) ** m)  # loses ~1e-15 absolute to cancellation
    np.testing.assert_allclose(root_value(v, m), direct, rtol=1e-12, atol=1e-14)


def test_root_value_is_zero_below_a_pair_and_for_certain_prompts() -> None:
    assert np.all(root_value(V, 0) == 0.0) and np.all(root_value(V, 1) == 0.0)
    assert np.all(root_value([[0.0], [1.0]], M) == 0.0)
    assert root_value(0.5, 2) == 0.5


def test_root_value_keeps_precision_for_rare_outcomes() -> None:
    for v, m in [(1e-12, 5), (1e-17, 3), (1.0 - 2.0**-40, 7), (3e-9, 1000)]:
        with localcontext() as context:
            context.prec = 60  # digits: the reference is exact to float precision
            reference = float(1 - Decimal(v) ** m - (1 - Decimal(v)) ** m)
        assert root_value(v, m) == pytest.approx(reference, rel=1e-13)


def test_root_value_is_symmetric_in_success_and_failure() -> None:
    v = np.array([0.0, 2.0**-40, 0.015625, 0.25, 0.375, 0.5])[:, None]  # 1 - v is exact for these
    assert np.array_equal(root_value(v, M), root_value(1.0 - v, M))


def test_root_gain_is_the_next_rollouts_value() -> None:
    v, m = V[:, None], M[None, :]
    np.testing.assert_allclose(root_gain(v, m), root_value(v, m + 1) - root_value(v, m), rtol=1e-9, atol=1e-15)
    assert np.all(root_gain(V, 0) == 0.0)


def test_root_gain_never_increases_from_the_first_rollout() -> None:
    gains = root_gain(np.linspace(0.0, 1.0, 101)[:, None], np.arange(1, 80)[None, :])
    assert np.all(np.diff(gains, axis=1) <= 1e-18)


def test_the_first_pair_is_worth_at_least_every_later_rollout_on_average() -> None:
    # The LP bound of allocate_roots relies on this: f(m)/m never increases for m >= 2, and
    # m * gain(m) <= f(m), so the first L rollouts spread out bound every later gain from above.
    v, m = np.linspace(0.0, 1.0, 101)[:, None], np.arange(2, 80)[None, :]
    average = root_value(v, m) / m
    assert np.all(np.diff(average, axis=1) <= 1e-15)
    assert np.all(m * root_gain(v, m) <= root_value(v, m) + 1e-15)


def test_prompts_closer_to_one_half_are_worth_more_at_every_count() -> None:
    # The dominance step of allocate_roots: root_value grows with w = min(v, 1 - v) on [0, 1/2].
    values = root_value(np.linspace(0.0, 0.5, 201)[:, None], np.arange(0, 80)[None, :])
    assert np.all(np.diff(values, axis=0) >= -1e-15)


def test_prefix_value_matches_its_definition() -> None:
    v, r, k = V[:, None, None], np.array([0.0, 1.0])[None, :, None], M[None, None, :]
    q = r * v + (1.0 - r) * (1.0 - v)
    np.testing.assert_allclose(prefix_value(v, r, k), 1.0 - q**k, rtol=1e-12, atol=1e-14)


def test_prefix_value_edges() -> None:
    assert np.all(prefix_value(V, 1.0, 0) == 0.0)  # no continuation, no flip, even when q == 0
    assert np.all(prefix_value(1.0, 1.0, M) == 0.0)  # q == 1: a success that always repeats
    assert np.all(prefix_value(0.0, 1.0, M[1:]) == 1.0)  # q == 0: the first continuation flips it
    assert np.all(prefix_value(0.0, 0.0, M) == 0.0)


def test_prefix_value_keeps_precision_when_flips_are_rare() -> None:
    for v, r, k in [(1e-18, 0.0, 10), (1.0 - 2.0**-45, 1.0, 3), (1e-9, 0.0, 100_000)]:
        with localcontext() as context:
            context.prec = 60
            flip = Decimal(v) if r == 0.0 else 1 - Decimal(v)
            reference = float(1 - (1 - flip) ** k)
        assert prefix_value(v, r, k) == pytest.approx(reference, rel=1e-12)


def test_prefix_gain_is_the_next_continuations_value_and_never_increases() -> None:
    v, r, k = V[:, None, None], np.array([0.0, 1.0])[None, :, None], M[None, None, :]
    gains = prefix_gain(v, r, k)
    np.testing.assert_allclose(gains, prefix_value(v, r, k + 1) - prefix_value(v, r, k), rtol=1e-9, atol=1e-15)
    assert np.all(np.diff(gains, axis=2) <= 0.0)


def test_functions_broadcast_to_float64() -> None:
    v, m = np.full((3, 1), 0.4), np.arange(4)
    for result in (root_value(v, m), root_gain(v, m), prefix_value(v, 1, m), prefix_gain(v, [0, 1, 1, 0], m)):
        assert result.shape == (3, 4) and result.dtype == np.float64
