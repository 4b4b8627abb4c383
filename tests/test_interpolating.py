"""`InterpolatingAdjoint`: the continuous adjoint read from checkpointed forward re-solves, against
finite differences, closed forms and forward sensitivities at a tight tolerance; its re-solve
count against the closed form; stiff problems; bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from problems import central_differences, lotka_volterra, robertson, sensitivity_reference
from selection import slow_unless

import odeckpt
from odeckpt import InterpolatingAdjoint

Y0, P = jnp.array([10.0, 5.0]), jnp.array([1.1, 0.4, 0.4, 0.1])


def _lv_loss(p, y0, t1, adjoint, rtol, solver):
    sol = odeckpt.solve(
        lotka_volterra, y0, (0.0, t1), args=p, solver=solver, adjoint=adjoint, rtol=rtol,
        atol=1e-12, max_steps=20000, saveat=jnp.array([1.0, 2.5, t1]),
    )  # fmt: skip
    return jnp.sum(sol.ys**2)


def test_lotka_volterra_equals_finite_differences():
    """Gradients in `args`, `y0` and `t1`, through saved outputs, equal central differences of a
    tight solve to 1e-8. (Tsit5: its continuous extension, which the adjoint reads `y(t)` from,
    is accurate to about its steps' error; Dopri8's cubic one at this tolerance is not, and the
    drift check refuses the gradient.)"""
    loss = lambda p, y0, t1: _lv_loss(p, y0, t1, InterpolatingAdjoint(), 1e-11, "tsit5")
    tight = lambda p, y0, t1: _lv_loss(p, y0, t1, "recursive", 1e-13, "dopri8")
    g_p, g_y0, g_t1 = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(P, Y0, 5.0)
    np.testing.assert_allclose(g_p, central_differences(lambda p: tight(p, Y0, 5.0), P), rtol=1e-8)
    np.testing.assert_allclose(g_y0, central_differences(lambda y: tight(P, y, 5.0), Y0), rtol=1e-8)
    fd_t1 = (tight(P, Y0, 5.0 + 1e-5) - tight(P, Y0, 5.0 - 1e-5)) / 2e-5
    np.testing.assert_allclose(g_t1, fd_t1, rtol=1e-8)


@pytest.mark.slow
def test_by_name_and_under_vmap():
    """`adjoint="interpolating"` under `vmap` of `grad`: each lane equals the closed form of
    `y' = -k y^2`."""

    def loss(k):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y**2, jnp.array([1.0, 2.0]), (0.0, 2.0), k,
            adjoint="interpolating", rtol=1e-9, atol=1e-12, saveat=jnp.array([0.5, 2.0]),
        )  # fmt: skip
        return jnp.sum(sol.ys)

    exact = lambda k: sum(
        -t * y0**2 / (1 + k * t * y0) ** 2 for y0 in (1.0, 2.0) for t in (0.5, 2.0)
    )
    ks = jnp.array([0.5, 1.0, 2.0])
    batched = jax.vmap(jax.grad(loss))(ks)
    np.testing.assert_allclose(batched, [exact(float(k)) for k in ks], rtol=1e-7)


class _Records:
    def __init__(self):
        self.records = []

    def record(self, stats):
        self.records.append(stats)


def _decay_gradient(adjoint, t1=20.0):
    def loss(k):
        sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, t1), k,
                            adjoint=adjoint, rtol=1e-8, atol=1e-10)  # fmt: skip
        return sol.ys[-1, 0], sol.stats.num_accepted_steps

    (grad, steps) = jax.jit(jax.grad(loss, has_aux=True))(jnp.array(0.3))
    jax.effects_barrier()
    return float(grad), int(steps)


@pytest.mark.parametrize("window", slow_unless([4, 8], fast={4}))
def test_each_stretch_is_re_solved_once(window):
    """With enough checkpoints (stored every `window // 2` accepted steps) every stretch between
    them is re-solved once: `ceil(n / (window // 2))` re-solves for `n` accepted steps (one
    extra forward integration in all), and the gradient is the closed form's."""
    records = _Records()
    adjoint = InterpolatingAdjoint(checkpoints=64, window=window, on_backward=records.record)
    grad, steps = _decay_gradient(adjoint)
    assert steps > 4 * window  # several stretches
    assert records.records[-1]["num_window_solves"] == math.ceil(steps / (window // 2))
    assert records.records[-1]["succeeded"]
    np.testing.assert_allclose(grad, -20.0 * math.exp(-0.3 * 20.0), rtol=1e-6)


@pytest.mark.slow
def test_few_checkpoints_still_cover_the_solve():
    """Two slots on a solve of many times more steps: the spacing doubles as they fill, they
    still span the solve, and the gradient stays right (at more re-solves)."""
    records = _Records()
    grad, steps = _decay_gradient(InterpolatingAdjoint(checkpoints=2, window=4,
                                                       on_backward=records.record))  # fmt: skip
    assert steps > 20
    record = records.records[-1]
    assert record["succeeded"] and record["max_drift"] < 1.0
    np.testing.assert_allclose(grad, -20.0 * math.exp(-0.3 * 20.0), rtol=1e-6)


ROBERTSON_K = np.array([0.04, 3e7, 1e4])


def _robertson_jacobian(adjoint, t1, rtol):
    def final(log_k):
        return odeckpt.solve(
            robertson, jnp.array([1.0, 0.0, 0.0]), (0.0, t1), jnp.exp(log_k), solver="kvaerno5",
            rtol=rtol, atol=1e-4 * rtol, adjoint=adjoint, max_steps=20000,
        ).ys[-1]  # fmt: skip

    mode = jax.jacfwd if adjoint == "forward_sensitivity" else jax.jacrev
    return np.asarray(jax.jit(mode(final))(jnp.log(ROBERTSON_K)))


def _digits(jacobian, reference):
    return -math.log10(np.max(np.abs(jacobian - reference)) / np.max(np.abs(reference)))


@pytest.mark.parametrize(
    "t1, rtol, at_least",
    [pytest.param(1e5, 1e-6, 5.0, marks=pytest.mark.slow),
     pytest.param(1e5, 1e-8, 7.0, marks=pytest.mark.slow),
     pytest.param(1e11, 1e-6, 3.5, marks=pytest.mark.slow),
     pytest.param(1e11, 1e-8, 4.5, marks=pytest.mark.slow)],
)  # fmt: skip
def test_robertson(t1, rtol, at_least):
    """Robertson's kinetics (k = 0.04, 3e7, 1e4) to t1 = 1e5 and to 1e11, where the adjoint's
    transients at t1 need steps far below the resolution of t there (each backward stretch
    runs in the time from its start): the Jacobian of y(t1) in log k succeeds and reaches the
    digits measured (docs/which-adjoint.md), within about a digit of the discrete adjoint's,
    against scipy's Radau sensitivities at rtol 1e-12."""
    reference = sensitivity_reference(robertson, np.array([1.0, 0.0, 0.0]),
                                      np.log(ROBERTSON_K), t1)  # fmt: skip
    interpolating = _digits(_robertson_jacobian(InterpolatingAdjoint(), t1, rtol), reference)
    recursive = _digits(_robertson_jacobian("recursive", t1, rtol), reference)
    assert interpolating >= at_least
    assert interpolating >= recursive - 1.5


def _van_der_pol_jacobian(adjoint, rtol, solver="kvaerno5"):
    def final(log_mu):
        return odeckpt.solve(
            lambda t, y, mu: jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]]),
            jnp.array([2.0, 0.0]), (0.0, 1000.0), jnp.exp(log_mu), solver=solver,
            rtol=rtol, atol=1e-10, adjoint=adjoint, max_steps=100_000,
        ).ys[-1]  # fmt: skip

    return np.asarray(jax.jit(jax.jacrev(final))(jnp.log(1000.0)))


def _van_der_pol_reference():
    field = lambda t, y, p: jnp.stack([y[1], p[0] * (1 - y[0] ** 2) * y[1] - y[0]])
    return sensitivity_reference(field, np.array([2.0, 0.0]), np.log([1000.0]), 1000.0)[:, 0]


@pytest.mark.slow
def test_van_der_pol_succeeds_and_converges():
    """Van der Pol, mu = 1000, t in [0, 1000]: the gradient succeeds, and at rtol 1e-8 has the
    3 digits measured."""
    reference = _van_der_pol_reference()
    assert _digits(_van_der_pol_jacobian(InterpolatingAdjoint(), 1e-8), reference) >= 3.0


@pytest.mark.slow
def test_van_der_pol_four_digits_at_rtol_1e_6():
    """Issue 20's target with Radau5: at rtol 1e-6 the adjoint that retraces the forward
    solution inherits its error (about 2 digits of the Jacobian); with tolerances of its own,
    `y(t)` is re-solved from `y0` at them, and two decades tighter than the solve's the
    Jacobian has at least 4."""
    reference = _van_der_pol_reference()
    retraced = _van_der_pol_jacobian(InterpolatingAdjoint(), 1e-6, "radau")
    resolved = _van_der_pol_jacobian(InterpolatingAdjoint(rtol=1e-8, atol=1e-12), 1e-6, "radau")
    assert _digits(retraced, reference) < 3
    assert _digits(resolved, reference) >= 4


def test_own_tolerances_re_solve_the_forward_solution():
    """After a loose forward solve (rtol 1e-3), the gradient retracing it is off by about that
    tolerance; with the adjoint's own tolerances `y(t)` is re-solved from `y0` at them (one
    extra forward solve, counted with the window re-solves) and the gradient is the exact
    solution's, `d exp(-k t1) / dk = -t1 exp(-k t1)`, to 1e-8."""

    def gradient(**tolerances):
        records = _Records()
        adjoint = InterpolatingAdjoint(on_backward=records.record, **tolerances)

        def loss(k):
            sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, 5.0), k,
                                adjoint=adjoint, rtol=1e-3, atol=1e-6)  # fmt: skip
            return sol.ys[-1, 0]

        grad = float(jax.jit(jax.grad(loss))(jnp.array(0.3)))
        jax.effects_barrier()
        return grad, records.records[-1]

    exact = -5.0 * math.exp(-0.3 * 5.0)
    retraced, _ = gradient()
    resolved, record = gradient(rtol=1e-11, atol=1e-13)
    assert abs(retraced - exact) > 1e-5 * abs(exact)
    np.testing.assert_allclose(resolved, exact, rtol=1e-8)
    assert record["succeeded"] and record["num_window_solves"] >= 2


def _vdp(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


_HELD = [(adjoint, solver) for adjoint in (InterpolatingAdjoint, odeckpt.BacksolveAdjoint)
         for solver in ("radau", "kvaerno5", "bdf", "rodas5")]  # fmt: skip


@pytest.mark.parametrize(
    "adjoint, solver",
    slow_unless(_HELD, fast={(InterpolatingAdjoint, "radau")}),
)
def test_backward_tolerances_hold_the_implicit_stepper(adjoint, solver):
    """A backward solve (and its forward re-solves) at tolerances far tighter than the forward
    solve's hold the implicit stepper's Newton iteration and step proposals to them, not to
    the forward solve's: on Van der Pol (mu = 10) solved at rtol 1e-4, the backward solve at
    1e-10 rejects few steps (held to 1e-4, Radau5 rejected two steps in three, and Kvaerno5's
    backsolve failed). `InterpolatingAdjoint`, which re-solves `y(t)` from `y0` at its own
    tolerances, gives the exact solution's derivative to 1e-7; `BacksolveAdjoint` re-solves
    from the forward solve's states, and is as accurate as they are."""
    records = _Records()

    def loss(mu, adjoint, rtol, atol):
        sol = odeckpt.solve(_vdp, jnp.array([2.0, 0.0]), (0.0, 3.0), mu, solver=solver,
                            rtol=rtol, atol=atol, adjoint=adjoint, max_steps=20_000)  # fmt: skip
        return jnp.sum(sol.ys[-1])

    exact = jax.grad(loss)(10.0, "forward_sensitivity", 1e-12, 1e-14)
    backward = adjoint(rtol=1e-10, atol=1e-12, on_backward=records.record)
    grad = jax.grad(loss)(10.0, backward, 1e-4, 1e-6)
    jax.effects_barrier()
    record = records.records[-1]
    assert record["succeeded"]
    assert record["num_rejected_backward_steps"] < 0.25 * record["num_accepted_backward_steps"]
    np.testing.assert_allclose(grad, exact, rtol=1e-7 if adjoint is InterpolatingAdjoint else 1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=1), "window=1\\) must be at least 2"),
        (dict(window=0), "window=...\\) must be a positive int"),
        (dict(checkpoints=0), "checkpoints=...\\) must be a positive int"),
        (dict(rtol=-1e-6), "rtol=-1e-06\\) must be positive"),
        (dict(max_drift=0.0), "max_drift=math.inf for no check"),
        (dict(solver="tsit5"), "is not a stepper"),
        (dict(on_backward=[]), "is not callable"),
    ],
)
def test_bad_settings_raise_naming_the_fix(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        InterpolatingAdjoint(**kwargs)


def test_own_tolerances_after_steps_without_an_error_estimate_raise_naming_the_fix():
    """The re-solve at the adjoint's tolerances needs a forward stepper that adapts to them:
    the first error says so (not a fix that leads to it)."""
    adjoint = InterpolatingAdjoint(rtol=1e-8)

    def loss(k):
        sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.ones(1), (0.0, 1.0), k, solver="rk4",
                            dt0=0.1, adjoint=adjoint)  # fmt: skip
        return sol.ys[-1, 0]

    with pytest.raises(ValueError, match="RK4 has no error estimate to adapt.*rtol and atol"):
        jax.grad(loss)(1.0)


def test_forward_mode_and_jumps_are_refused_naming_the_fix():
    final = lambda k, **kw: odeckpt.solve(lambda t, y, k: -k * y, jnp.ones(1), (0.0, 1.0), k,
                                          adjoint="interpolating", **kw).ys[-1, 0]  # fmt: skip
    with pytest.raises(Exception, match="adjoint='forward_sensitivity'"):
        jax.jacfwd(final)(1.0)
    bounce = odeckpt.Event(lambda t, y, k: y[0] - 0.5, terminal=False, update=lambda t, y, k: 2 * y)
    with pytest.raises(ValueError, match="terminal events only"):
        final(1.0, event=bounce)


def test_failed_backward_solve_is_nan_or_raises():
    """A backward solve that cannot finish (two steps allowed) gives a NaN gradient, and with
    `throw=True` an error naming InterpolatingAdjoint's fixes."""

    def loss(k, throw):
        sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.ones(1), (0.0, 1.0), k,
                            adjoint=InterpolatingAdjoint(rtol=1e-12, atol=1e-14),
                            max_steps=12, rtol=1e-3, atol=1e-6, throw=throw)  # fmt: skip
        return sol.ys[-1, 0]

    assert np.isnan(jax.grad(loss)(1.0, False))
    with pytest.raises(Exception, match="InterpolatingAdjoint\\(checkpoints=...\\)"):
        jax.block_until_ready(jax.grad(loss)(1.0, True))
