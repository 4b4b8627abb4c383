"""Solves at the edge of floating-point resolution: at large |t|, where neighbouring times are
far apart, and with an `rtol` below the resolution of a float32 state.

Neither may become a different solve reported as a success. A constant step that the times
represent exactly takes the steps of the same solve shifted to start at 0, to the last bit; one
that they round by more than 1% is a `ValueError` when the span and `dt0` are known, and
`Status.dt_underflow` with a NaN gradient when they are traced. Adaptive steps at large |t|
agree with the shifted solve to the tolerance. An `rtol` below the state's resolution is
clamped to it, alike for known and traced values and for the adjoints' own tolerances, and
`sol.stats.rtol_clamped` says so.

The default run keeps a few representative cases (a few seconds); `pytest -m slow` runs all.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

EPS32 = float(np.finfo(np.float32).eps)


def decay(t, y, k):
    return -k * y


def _constant(t0, span, dt0, dtype, **kwargs):
    """The final state of RK4 with constant steps `dt0` over `(t0, t0 + span)` and the number
    of steps, as a function of the rate `k`."""

    def final(k):
        y0 = jnp.ones(2, dtype)
        sol = odeckpt.solve(decay, y0, (t0, t0 + span), k, solver="rk4",
                            controller=odeckpt.ConstantStep(), dt0=dt0, **kwargs)  # fmt: skip
        return jnp.sum(sol.ys[-1]), (sol.stats.num_accepted_steps, sol.status)

    return final


# (t0, span, dt0, dtype): `dt0` a multiple of the spacing of the times near `t0`; backwards
# for a negative span.
REPRESENTABLE = [
    (1e14, 10.0, 0.5, "float64"), (1e15, 10.0, 0.5, "float64"), (1e14 + 10, -10.0, -0.5, "float64"),
    (-1e15, 3.0, 0.25, "float64"), (1e6, 10.0, 0.5, "float32"), (3e7, 40.0, 2.0, "float32"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("t0", "span", "dt0", "dtype"), slow_unless(REPRESENTABLE, fast=REPRESENTABLE[:1])
)
def test_representable_constant_steps_at_large_t_equal_the_shifted_solve(t0, span, dt0, dtype):
    """Before the fix, steps ending within `100 eps |t|` (2.2 at 1e14) of the end merged with
    it: 16 steps instead of 20 at 1e14, y 7.9 times too large."""
    run = jax.value_and_grad(_constant(t0, span, dt0, dtype), has_aux=True)
    (y, (steps, _)), dy_dk = run(1.0)
    (y_ref, (steps_ref, _)), dy_dk_ref = jax.value_and_grad(
        _constant(0.0, span, dt0, dtype), has_aux=True
    )(1.0)
    assert int(steps) == int(steps_ref) == round(span / dt0)
    assert y == y_ref and dy_dk == dy_dk_ref  # the same steps of the same size: the same bits


@pytest.mark.slow
@pytest.mark.parametrize(("t0", "span", "dt0", "dtype"), REPRESENTABLE)
def test_representable_constant_steps_with_traced_times(t0, span, dt0, dtype):
    """Traced times (the count of steps not known at trace time) take the same steps."""
    y_ref, (steps_ref, _) = _constant(0.0, span, dt0, dtype)(1.0)
    traced = jax.jit(lambda t: _constant(t, span, dt0, dtype)(1.0))
    y, (steps, status) = traced(jnp.asarray(t0, dtype))
    assert status == odeckpt.Status.successful
    assert int(steps) == int(steps_ref) and y == y_ref


@pytest.mark.slow
def test_representable_constant_steps_land_on_save_times():
    """Save times at large |t| are stops like the end: no step merges with one."""
    t0, ts = 1e14, jnp.array([2.5, 5.0, 7.5, 10.0])

    def saved(start):
        sol = odeckpt.solve(decay, jnp.ones(1), (start, start + 10.0), 1.0, saveat=start + ts,
                            solver="rk4", controller=odeckpt.ConstantStep(), dt0=0.5)  # fmt: skip
        return sol.ys[:, 0], sol.stats.num_accepted_steps

    ys, steps = saved(t0)
    ys_ref, steps_ref = saved(0.0)
    assert int(steps) == int(steps_ref) == 20 and jnp.all(ys == ys_ref)


# (t0, span, dt0, dtype): `t0 + dt0` rounds to a step more than 1% off `dt0`.
UNRESOLVED = [
    (1e15, 3.0, 0.3, "float64"), (1e14, 10.0, 0.3, "float64"), (1e14 + 10, -10.0, -0.3, "float64"),
    (1e6, 3.0, 0.3, "float32"), (2e8, 100.0, 5.0, "float32"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("t0", "span", "dt0", "dtype"), slow_unless(UNRESOLVED, fast=UNRESOLVED[:1])
)
def test_unresolved_constant_steps_raise_at_call_time(t0, span, dt0, dtype):
    """Before the fix, over (1e15, 1e15 + 3) with dt0 = 0.3 the whole span was one step:
    y = 1.375 (exact 0.0498), reported as successful."""
    fix = "float64" if dtype == "float32" else "larger dt0"
    with pytest.raises(ValueError, match=rf"dt0={dt0} is too small.*Fix: shift time.*{fix}"):
        _constant(t0, span, dt0, dtype, throw=False)(1.0)


@pytest.mark.parametrize(
    ("t0", "span", "dt0", "dtype"), slow_unless(UNRESOLVED, fast=UNRESOLVED[1:2])
)
def test_unresolved_constant_steps_fail_when_traced(t0, span, dt0, dtype):
    """With traced times the solve ends with `dt_underflow` and a NaN gradient. (Before the
    fix: over (1e14, 1e14 + 10), successful.)"""

    def final(t, k):
        return _constant(t, span, dt0, dtype, throw=False)(k)

    run = jax.jit(jax.value_and_grad(final, argnums=1, has_aux=True))
    (_, (steps, status)), dy_dk = run(jnp.asarray(t0, dtype), 1.0)
    assert status == odeckpt.Status.dt_underflow and int(steps) == 0
    assert np.isnan(dy_dk)


@pytest.mark.slow
@pytest.mark.parametrize(("t0", "span", "dt0", "dtype"), UNRESOLVED)
def test_unresolved_constant_steps_raise_with_the_fix_when_traced(t0, span, dt0, dtype):
    run = jax.jit(lambda t: _constant(t, span, dt0, dtype)(1.0))
    with pytest.raises(Exception, match="shift time so that the span starts at 0"):
        jax.block_until_ready(run(jnp.asarray(t0, dtype)))


@pytest.mark.slow
def test_constant_steps_that_round_within_one_percent_go_on():
    """float32 times near 1e3 round steps of 0.01 by up to 0.3%: the solve goes on (1000
    steps) and agrees with the float64 one to float32 accuracy."""
    y, (steps, status) = _constant(1e3, 10.0, 0.01, "float32")(1.0)
    y64, (steps64, _) = _constant(1e3, 10.0, 0.01, "float64")(1.0)
    assert status == odeckpt.Status.successful and abs(int(steps) - int(steps64)) <= 2
    assert np.isclose(float(y), float(y64), rtol=1e-3, atol=0)


# (solver, t0): adaptive steps over (t0, t0 + 10).
ADAPTIVE = [("tsit5", 1e14), ("tsit5", 1e12), ("dopri5", 1e14), ("kvaerno5", 1e14),
            ("rodas5", 1e14), ("bosh3", 1e13)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("solver", "t0"), ADAPTIVE)
def test_adaptive_steps_at_large_t_agree_with_the_shifted_solve(solver, t0):
    """Adaptive steps are judged on the step actually taken; landing on the end no longer
    stretches a step by up to `100 eps |t|` (2.2 at 1e14), which before the fix made Tsit5
    reject its last step until `max_steps_reached`, with y 10 times too large."""
    rtol = 1e-6

    def final(t, k):
        sol = odeckpt.solve(decay, jnp.ones(2), (t, t + 10.0), k, solver=solver, rtol=rtol,
                            atol=1e-10, throw=False)  # fmt: skip
        return jnp.sum(sol.ys[-1]), sol.status

    (y, status), dy_dk = jax.value_and_grad(final, argnums=1, has_aux=True)(t0, 1.0)
    (y_ref, _), dy_dk_ref = jax.value_and_grad(final, argnums=1, has_aux=True)(0.0, 1.0)
    assert status == odeckpt.Status.successful
    exact = 2 * math.exp(-10.0)
    assert abs(float(y) - float(y_ref)) < 20 * rtol * exact
    assert abs(float(dy_dk) - float(dy_dk_ref)) < 20 * rtol * 10 * exact


def test_float32_traced_rtol_below_resolution_is_clamped_and_reported():
    """Under `jit` and `vmap`, an `rtol` below float32's eps is held at eps: the solve is the
    one at `rtol = eps`, bit for bit, and `stats.rtol_clamped` says so per lane. (Before the
    fix: no report; with atol = rtol = 1e-10, 146 steps instead of 8.)"""
    y0 = jnp.array([1.0, 2.0], jnp.float32)

    def final(rtol):
        sol = odeckpt.solve(decay, y0, (0.0, 1.0), 1.0, rtol=rtol, atol=1e-6)
        return sol.ys[-1], sol.stats

    rtols = jnp.array([1e-10, EPS32, 1e-5], jnp.float32)
    ys, stats = jax.jit(jax.vmap(final))(rtols)
    assert stats.rtol_clamped.tolist() == [True, False, False]
    assert jnp.all(ys[0] == ys[1]) and stats.num_steps[0] == stats.num_steps[1]
    assert np.allclose(ys[0], y0 * math.exp(-1.0), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_known_rtol_below_resolution_warns_and_is_clamped_alike():
    """A known `rtol` below float32's eps warns and gives the solve of a traced one."""
    y0 = jnp.array([1.0, 2.0], jnp.float32)

    def final(rtol):
        sol = odeckpt.solve(decay, y0, (0.0, 1.0), 1.0, rtol=rtol, atol=1e-6)
        return sol.ys[-1], sol.stats

    y, traced = jax.jit(final)(jnp.float32(1e-10))
    assert bool(traced.rtol_clamped)
    with pytest.warns(UserWarning, match=r"rtol = 1e-10 is below the resolution of float32"):
        known_y, known = final(1e-10)
    assert bool(known.rtol_clamped) and int(known.num_steps) == int(traced.num_steps)
    assert np.allclose(known_y, y, rtol=2 * EPS32, atol=0)


ADJOINTS = ["backsolve", "interpolating", "forward_sensitivity"]
_ADJOINT_TYPES = {"backsolve": odeckpt.BacksolveAdjoint,
                  "interpolating": odeckpt.InterpolatingAdjoint,
                  "forward_sensitivity": odeckpt.ForwardSensitivity}  # fmt: skip


@pytest.mark.parametrize("name", slow_unless(ADJOINTS, fast={"forward_sensitivity"}))
def test_adjoint_tolerances_below_resolution_are_clamped_and_reported(name):
    """An adjoint's own traced `rtol` below float32's eps: the gradient is the one at
    `rtol = eps`, bit for bit, and the solve's stats report the clamp (per lane under `vmap`).
    (Before the fix: no report.)"""
    y0 = jnp.array([1.0, 2.0], jnp.float32)

    def loss(k, rtol):
        adjoint = _ADJOINT_TYPES[name](rtol=rtol, atol=1e-7)
        sol = odeckpt.solve(decay, y0, (0.0, 1.0), k, adjoint=adjoint, rtol=1e-5, atol=1e-7)
        return jnp.sum(sol.ys[-1]), sol.stats.rtol_clamped

    grad = jax.jit(jax.vmap(jax.grad(loss, has_aux=True), in_axes=(None, 0)))
    dl_dk, clamped = grad(jnp.float32(1.0), jnp.array([1e-10, EPS32], jnp.float32))
    assert clamped.tolist() == [True, False]
    assert dl_dk[0] == dl_dk[1]
    assert np.isclose(float(dl_dk[0]), -3 * math.exp(-1.0), rtol=1e-4, atol=0)
