"""Derivatives with respect to traced known discontinuities (`solve(..., jump_ts=...)`).

A jump time `tau` of `f` is an input of the solve: moving it moves the solution after it by the
change of the vector field there, `(f(tau-) - f(tau+)) dtau` (`f(tau-)` on the side the solve
comes from). Every adjoint must give the derivative of the exact solution in `tau`: the
discrete solves (direct, recursive, forward) differentiate the steps that land on it,
`ForwardSensitivity` jumps its sensitivities there, and the continuous adjoints add
`a(tau) . (f(tau-) - f(tau+))` to its cotangent on their way back. A derivative of 0 here is
a wrong answer reported as success, so each case is checked against a closed form: an infusion
stopped at `tau`, a decay whose dose rate stops at `tau`, a dosing window between two jump times
(given unsorted, one repeated, one outside the span), jump times outside the span, a solve
backwards in time, a jump time equal to a save time, and a failed solve (NaN derivatives).

The default run keeps the infusion with `ForwardSensitivity` and `InterpolatingAdjoint` and
the failed solve with the recursive adjoint; `pytest -m slow` runs every adjoint on every case.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

ADJOINTS = ("recursive", "direct", "backsolve", "interpolating", "forward_sensitivity", "forward")
T = 2.0
TOL = 1e-9


def _derivative(loss, p, adjoint: str):
    """The derivative of `loss(p, adjoint)`: forward mode for `ForwardMode`, reverse mode for
    the others."""
    differentiate = jax.jacfwd if adjoint == "forward" else jax.grad
    return np.asarray(differentiate(lambda p: loss(p, adjoint))(p))


def _final(f, y0, span, args, jump_ts, adjoint, **kwargs):
    sol = odeckpt.solve(f, jnp.array([y0]), span, args, adjoint=adjoint, rtol=TOL, atol=TOL,
                        jump_ts=jump_ts, **kwargs)  # fmt: skip
    return sol.ys[-1, 0]


def _dosed(t, y, p):
    """A decay whose dose rate `r` is given from `t1` until `t2`: `y' = -k y + r [t1 <= t < t2]`."""
    k, r, t1, t2 = p
    return -k * y + jnp.where((t >= t1) & (t < t2), r, 0.0)


def _dosed_until(t, y, p):
    """`_dosed` from the start until `tau`."""
    k, r, tau = p
    return -k * y + jnp.where(t < tau, r, 0.0)


@pytest.mark.parametrize(
    "adjoint", slow_unless(ADJOINTS, fast={"forward_sensitivity", "interpolating"})
)
def test_infusion_stopped_at_a_traced_jump_time(adjoint):
    # y' = 1 until tau, then 0, from y(0) = 0: y(2) = tau, dy(2)/dtau = 1.
    infusion = lambda t, y, tau: jnp.where(t < tau, 1.0, 0.0) * jnp.ones_like(y)
    loss = lambda tau, adjoint: _final(infusion, 0.0, (0.0, T), tau, tau[None], adjoint)
    assert float(loss(jnp.asarray(0.7), adjoint)) == pytest.approx(0.7, abs=1e-12)
    assert _derivative(loss, jnp.asarray(0.7), adjoint) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast=set()))
def test_decay_dosed_until_a_traced_jump_time(adjoint):
    # y(2) = (r/k) (e^{k tau} - 1) e^{-2k}: dy/dtau = r e^{-k (2 - tau)}, and dy/dk with tau.
    exact = lambda p: p[1] / p[0] * (jnp.exp(p[0] * p[2]) - 1) * jnp.exp(-p[0] * T)
    loss = lambda p, adjoint: _final(_dosed_until, 0.0, (0.0, T), p, p[2][None], adjoint)
    p = jnp.array([1.3, 2.0, 0.7])
    np.testing.assert_allclose(_derivative(loss, p, adjoint), jax.grad(exact)(p), rtol=1e-6)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast=set()))
def test_dosing_window_between_two_jump_times(adjoint):
    # Dosed from t1 to t2: y(2) = (r/k) (1 - e^{-k (t2 - t1)}) e^{-k (2 - t2)}. The jump times
    # come unsorted, t1 twice (one discontinuity: its derivative is counted once) and one
    # outside the span (no effect).
    def exact(p):
        k, r, t1, t2 = p
        return r / k * (1 - jnp.exp(-k * (t2 - t1))) * jnp.exp(-k * (T - t2))

    def loss(p, adjoint):
        jump_ts = jnp.stack([p[3], p[2], p[2], p[2] + 5.0])
        return _final(_dosed, 0.0, (0.0, T), p, jump_ts, adjoint)

    p = jnp.array([1.3, 2.0, 0.4, 1.1])
    np.testing.assert_allclose(_derivative(loss, p, adjoint), jax.grad(exact)(p), rtol=1e-6)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast=set()))
def test_jump_times_outside_the_span_have_no_effect(adjoint):
    # Dosed from -0.5 to 2.5, so over the whole span [0, 2]: y(2) = y0 e^{-2k} + (r/k) (1 -
    # e^{-2k}), which does not depend on either jump time.
    def exact(p):
        k, r = p[0], p[1]
        return 0.5 * jnp.exp(-k * T) + r / k * (1 - jnp.exp(-k * T))

    loss = lambda p, adjoint: _final(_dosed, 0.5, (0.0, T), p, p[2:], adjoint)
    p = jnp.array([1.3, 2.0, -0.5, 2.5])
    expected = np.asarray(jax.grad(exact)(p))
    np.testing.assert_array_equal(expected[2:], 0.0)
    np.testing.assert_allclose(_derivative(loss, p, adjoint), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast=set()))
def test_backwards_in_time_across_a_traced_jump_time(adjoint):
    # From y(2) = 0.5 back to t = 0: y(0) = e^{2k} 0.5 - (r/k) (e^{k tau} - 1). The solve
    # comes to tau from above: f(tau-) there is the field after tau in t.
    exact = lambda p: jnp.exp(p[0] * T) * 0.5 - p[1] * (jnp.exp(p[0] * p[2]) - 1) / p[0]
    loss = lambda p, adjoint: _final(_dosed_until, 0.5, (T, 0.0), p, p[2][None], adjoint)
    p = jnp.array([1.3, 2.0, 0.7])
    np.testing.assert_allclose(_derivative(loss, p, adjoint), jax.grad(exact)(p), rtol=1e-6)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast=set()))
def test_jump_time_equal_to_a_save_time(adjoint):
    # The state saved at tau = 0.7 is y(0.7) = (r/k) (e^{k tau} - 1) e^{-0.7 k} for tau <= 0.7
    # and (r/k) (1 - e^{-0.7 k}) above: the saved row is written after the jump, so its
    # derivative in tau is the one from below, where the jump has happened (r). The loss adds
    # half of y(2).
    def at(p, t):
        k, r, tau = p
        return r / k * (jnp.exp(k * tau) - 1) * jnp.exp(-k * t)

    def loss(p, adjoint):
        saveat = jnp.array([0.7, T])
        sol = odeckpt.solve(_dosed_until, jnp.array([0.0]), (0.0, T), p, adjoint=adjoint,
                            rtol=TOL, atol=TOL, jump_ts=p[2][None], saveat=saveat)  # fmt: skip
        return sol.ys[0, 0] + 0.5 * sol.ys[1, 0]

    p = jnp.array([1.3, 2.0, 0.7])
    expected = jax.grad(lambda p: at(p, 0.7) + 0.5 * at(p, T))(p)
    np.testing.assert_allclose(_derivative(loss, p, adjoint), expected, rtol=1e-6)


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast={"recursive"}))
def test_failed_solve_has_nan_jump_time_derivatives(adjoint):
    # Three steps do not reach t = 2: the derivative in the jump time (which the solve never
    # reached) is NaN, never 0.
    def loss(tau, adjoint):
        decay = lambda t, y, k: -k * y
        sol = odeckpt.solve(decay, jnp.array([1.0]), (0.0, T), 1.0, adjoint=adjoint,
                            jump_ts=tau[None], throw=False, max_steps=3)  # fmt: skip
        return sol.ys[-1, 0]

    assert np.isnan(_derivative(loss, jnp.asarray(1.5), adjoint))
