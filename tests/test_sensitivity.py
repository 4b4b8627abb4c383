"""`ForwardSensitivity`: forward sensitivities under the step-size control, against finite
differences, closed forms and scipy's forward sensitivities at a tight tolerance."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from problems import central_differences, robertson, sensitivity_reference
from selection import slow_unless

import odeckpt


def lotka_volterra(t, y, p):
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - c * y[1]])


Y0, P = jnp.array([10.0, 5.0]), jnp.array([1.1, 0.4, 0.4, 0.1])


def _lv_loss(p, y0, t1, adjoint, solver="dopri8", rtol=1e-11):
    sol = odeckpt.solve(
        lotka_volterra, y0, (0.0, t1), args=p, solver=solver, adjoint=adjoint, rtol=rtol,
        atol=1e-12, max_steps=20000, saveat=jnp.array([1.0, 2.5, t1]),
    )  # fmt: skip
    return jnp.sum(sol.ys**2)


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["dopri8", "kvaerno5", "rodas5", "radau", "bdf"])
def test_lotka_volterra_equals_finite_differences(solver):
    """Gradients in `args`, `y0` and `t1` (grad, jvp and jacfwd) equal central differences of a
    tight solve to 1e-8."""
    fs = odeckpt.ForwardSensitivity()
    loss = lambda p, y0, t1: _lv_loss(p, y0, t1, fs, solver, 1e-11)
    tight = lambda p, y0, t1: _lv_loss(p, y0, t1, "recursive", "dopri8", 1e-13)
    g_p, g_y0, g_t1 = jax.grad(loss, argnums=(0, 1, 2))(P, Y0, 5.0)
    np.testing.assert_allclose(g_p, central_differences(lambda p: tight(p, Y0, 5.0), P), rtol=1e-8)
    np.testing.assert_allclose(g_y0, central_differences(lambda y: tight(P, y, 5.0), Y0), rtol=1e-8)
    fd_t1 = (tight(P, Y0, 5.0 + 1e-5) - tight(P, Y0, 5.0 - 1e-5)) / 2e-5
    np.testing.assert_allclose(g_t1, fd_t1, rtol=1e-8)
    np.testing.assert_allclose(jax.jacfwd(loss)(P, Y0, 5.0), g_p, rtol=1e-8)
    direction = jnp.array([1.0, -2.0, 0.5, 3.0])
    jvp = jax.jvp(lambda p: loss(p, Y0, 5.0), (P,), (direction,))[1]
    np.testing.assert_allclose(jvp, g_p @ direction, rtol=1e-8)


@pytest.mark.slow
def test_by_name_and_under_vmap():
    """`adjoint="forward_sensitivity"` under `vmap` of `grad` and of `jacfwd`: each lane equals
    its own solve."""
    ks = jnp.array([0.5, 1.0, 2.0])

    def loss(k, adjoint):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y**2, jnp.array([1.0, 2.0]), (0.0, 2.0), k, adjoint=adjoint,
            rtol=1e-9, atol=1e-12, saveat=jnp.array([0.5, 2.0]),
        )  # fmt: skip
        return jnp.sum(sol.ys)

    exact = lambda k: sum(
        -t * y0**2 / (1 + k * t * y0) ** 2 for y0 in (1.0, 2.0) for t in (0.5, 2.0)
    )
    for derivative in (jax.grad, jax.jacfwd):
        batched = jax.vmap(derivative(lambda k: loss(k, "forward_sensitivity")))(ks)
        np.testing.assert_allclose(batched, [exact(float(k)) for k in ks], rtol=1e-7)


def test_closed_over_arrays_t0_and_a_complex_state():
    """Derivatives in an array `f` closes over, in `t0`, and of a complex state, against the
    closed form `y(t1) = y0 exp(lam (t1 - t0))`."""
    lam = jnp.array(-1.0 + 2.0j)

    def final(t0, y0, lam):
        f = lambda t, y, args: lam * y
        sol = odeckpt.solve(
            f, jnp.stack([y0]), (t0, 1.0), adjoint="forward_sensitivity", rtol=1e-10,
            atol=1e-12,
        )  # fmt: skip
        y1 = sol.ys[-1, 0]
        return jnp.real(y1) + 2 * jnp.imag(y1)

    def exact(t0, y0, lam):
        y1 = y0 * jnp.exp(lam * (1.0 - t0))
        return jnp.real(y1) + 2 * jnp.imag(y1)

    args = (0.2, jnp.array(1.0 + 0.5j), lam)
    got = jax.grad(final, argnums=(0, 1, 2))(*args)
    want = jax.grad(exact, argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-8)
    tangent = jax.jvp(lambda t0: final(t0, *args[1:]), (0.2,), (1.0,))[1]
    np.testing.assert_allclose(tangent, want[0], rtol=1e-8)


def test_bad_input_raises_naming_the_fix():
    with pytest.raises(ValueError, match="positive"):
        odeckpt.ForwardSensitivity(rtol=-1.0)
    with pytest.raises(ValueError, match="SaveAt"):
        odeckpt.solve(
            lambda t, y, a: -y, jnp.ones(1), (0.0, 1.0), adjoint="forward_sensitivity",
            saveat=odeckpt.SaveAt(steps=True),
        )  # fmt: skip


def test_traced_sensitivity_tolerances():
    """The sensitivities' tolerances may be traced (one compilation for every tolerance): the
    derivative equals the one with the same tolerances known at trace time."""

    def derivative(k, rtol):
        def final(k):
            adjoint = odeckpt.ForwardSensitivity(rtol=rtol, atol=rtol)
            sol = odeckpt.solve(lambda t, y, k: -k * y**2, jnp.ones(1), (0.0, 2.0), k,
                                rtol=1e-4, atol=1e-4, adjoint=adjoint)  # fmt: skip
            return sol.ys[-1, 0]

        return jax.grad(final)(k)

    traced = jax.jit(derivative)(0.5, 1e-9)
    np.testing.assert_array_equal(traced, derivative(0.5, 1e-9))
    np.testing.assert_allclose(traced, -2.0 / (1 + 0.5 * 2.0) ** 2, rtol=1e-7)


@pytest.mark.parametrize("name", ["radau", "kvaerno5", "bdf", "tsit5"])
def test_wrapped_steppers_are_held_to_the_steppers_tolerances(name):
    """The steppers that wrap a stepper (the sensitivities' augmented steps; the seminorm of
    the continuous adjoints' backward solve) are judged at the tolerances the stepper holds
    its own steps to: the same map of `rtol` (Radau5's error estimate and step proposals
    disagreed with the controller otherwise, and a backward solve rejected most steps)."""
    from odeckpt._adjoints._backsolve._problem import Seminorm
    from odeckpt._adjoints._sensitivity._stepper import SensitivityStepper
    from odeckpt._steppers import STEPPERS

    inner = STEPPERS[name]()
    for wrapper in (SensitivityStepper(inner), Seminorm(inner)):
        assert wrapper.tolerance_exponent == inner.tolerance_exponent
        assert wrapper.tolerance_reference == inner.tolerance_reference


def test_invalid_traced_sensitivity_tolerances_fail():
    """Traced tolerances that are not positive and finite, which `ForwardSensitivity` cannot
    check when it is made, fail the derivative (NaN; an error with `throw=True`), lane by
    lane under `vmap`."""

    def derivative(rtol, throw):
        def final(k):
            sol = odeckpt.solve(lambda t, y, k: -k * y**2, jnp.ones(1), (0.0, 2.0), k,
                                adjoint=odeckpt.ForwardSensitivity(rtol=rtol, atol=1e-10),
                                throw=throw)  # fmt: skip
            return sol.ys[-1, 0]

        return jax.grad(final)(0.5)

    rtols = jnp.array([-1e-6, jnp.inf, jnp.nan, 0.0, 1e-9])
    derivatives = jax.jit(jax.vmap(lambda r: derivative(r, False)))(rtols)
    assert np.all(np.isnan(derivatives[:4]))
    np.testing.assert_allclose(derivatives[4], -2.0 / (1 + 0.5 * 2.0) ** 2, rtol=1e-7)
    with pytest.raises(Exception, match="not positive and finite"):
        jax.block_until_ready(jax.jit(derivative, static_argnums=1)(-1e-6, True))


def test_failed_sensitivity_solve_raises_or_gives_nan():
    """The sensitivities' error control may need more steps than the state's: running out of
    `max_steps` there raises with `throw=True`, and gives NaN derivatives otherwise."""

    def loss(k, throw):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y, jnp.ones(1), (0.0, 1.0), k, rtol=1e-3, atol=1e-12,
            adjoint=odeckpt.ForwardSensitivity(rtol=1e-12), max_steps=16, throw=throw,
        )  # fmt: skip
        return jnp.sum(sol.ys)

    assert np.isfinite(loss(1.0, True))
    assert np.isnan(jax.grad(loss)(1.0, False))
    with pytest.raises(Exception, match="sensitivities failed"):
        jax.block_until_ready(jax.grad(loss)(1.0, True))


# Van der Pol, mu = 1000, x(0) = 2, v(0) = 0, t in [0, 1000] (issue 20): d sum(y(t1)^2) / d log
# mu, against scipy's Radau on the state and its sensitivity at rtol 1e-12.


def _van_der_pol_reference() -> float:
    from scipy.integrate import solve_ivp

    mu = 1000.0

    def rhs(t, z):
        x, v, sx, sv = z
        return [v, mu * (1 - x * x) * v - x, sv,
                (-2 * mu * x * v - 1) * sx + mu * (1 - x * x) * (sv + v)]  # fmt: skip

    def jac(t, z):
        x, v, sx, sv = z
        a, b = -2 * mu * x * v - 1, mu * (1 - x * x)
        return np.array([
            [0, 1, 0, 0], [a, b, 0, 0], [0, 0, 0, 1],
            [-2 * mu * (v * sx + x * sv + x * v), -2 * mu * x * sx + b, a, b],
        ])  # fmt: skip

    sol = solve_ivp(rhs, (0, 1000), [2, 0, 0, 0], "Radau", rtol=1e-12, atol=1e-14, jac=jac)
    x, v, sx, sv = sol.y[:, -1]
    return 2 * (x * sx + v * sv)


def _van_der_pol_gradient(adjoint, rtol, solver="kvaerno5"):
    def loss(log_mu):
        sol = odeckpt.solve(
            lambda t, y, mu: jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]]),
            jnp.array([2.0, 0.0]), (0.0, 1000.0), args=jnp.exp(log_mu), solver=solver,
            rtol=rtol, atol=1e-10, adjoint=adjoint, max_steps=100_000,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    return float(jax.jit(jax.grad(loss))(jnp.log(1000.0)))


def _digits(value, reference):
    return -math.log10(abs(value - reference) / abs(reference))


_ADAPTIVE = ["heun", "bosh3", "tsit5", "dopri5", "dopri8", "trapezoid", "kvaerno3", "kvaerno4",
             "kvaerno5", "rodas5", "radau", "bdf"]  # fmt: skip


@pytest.mark.parametrize("solver", slow_unless(_ADAPTIVE, fast={"radau"}))
def test_the_sensitivities_error_steers_the_steps(solver):
    """From `y(0) = 1`, `y' = -lam (y - cos t) - sin t` (lam = 50) has the solution `cos t`
    whatever `lam`: the state's error sees a slow cosine, while `dy(t1)/dy0 = exp(-lam t1)`
    decays fast. The derivative of the discrete solve, whose steps the state alone chose, is
    2e-3 to 30 (relative) off; `ForwardSensitivity`'s steps also answer to the sensitivity's
    error estimate, and its derivative is within 1e-3 (at rtol 1e-5) and 30 times closer."""
    lam, t1 = 50.0, 0.1

    def final(y0, adjoint):
        sol = odeckpt.solve(
            lambda t, y, lam: -lam * (y - jnp.cos(t)) - jnp.sin(t), y0, (0.0, t1), lam,
            solver=solver, adjoint=adjoint, rtol=1e-5, atol=1e-8, max_steps=10_000,
        )  # fmt: skip
        return sol.ys[-1, 0]

    exact = math.exp(-lam * t1)
    error = lambda adjoint: abs(float(jax.jacfwd(final)(jnp.ones(1), adjoint)[0]) / exact - 1)
    discrete, controlled = error("forward"), error("forward_sensitivity")
    assert controlled <= 1e-3, (discrete, controlled)
    assert controlled <= discrete / 30, (discrete, controlled)


@pytest.mark.slow
def test_van_der_pol_sensitivities_converge_to_the_reference():
    """The error-controlled derivative converges to scipy's as the tolerance shrinks, and at
    rtol 1e-6 has the right sign and magnitude (which the discrete derivative had not when
    issue 20 was filed: -4.57; docs/which-adjoint.md)."""
    reference = _van_der_pol_reference()
    assert abs(reference - 2.8074) < 1e-4
    fs = odeckpt.ForwardSensitivity()
    loose, tight = _van_der_pol_gradient(fs, 1e-6), _van_der_pol_gradient(fs, 1e-8, "rodas5")
    assert abs(loose - reference) < 0.2 * reference  # the right sign and magnitude
    assert _digits(tight, reference) >= 2.5


@pytest.mark.slow
def test_van_der_pol_four_digits_at_rtol_1e_6():
    """Issue 20's target with Radau5 (docs/which-adjoint.md): at rtol 1e-6 the sensitivities
    under the state's own tolerances (CVODES' errconS) give more digits than scipy's Radau with
    the sensitivities in its error test (3.1; the discrete derivative 2.9), and held one decade
    tighter, `ForwardSensitivity(rtol=1e-7)`, at least 4 (the discrete derivative needs
    `rtol = 1e-7` for as many)."""
    reference = _van_der_pol_reference()
    same = _van_der_pol_gradient(odeckpt.ForwardSensitivity(), 1e-6, "radau")
    tighter = _van_der_pol_gradient(odeckpt.ForwardSensitivity(rtol=1e-7), 1e-6, "radau")
    assert _digits(same, reference) >= 3.2
    assert _digits(tighter, reference) >= 4


@pytest.mark.parametrize("solver", slow_unless(["radau", "bdf"], fast={"bdf"}))
def test_steppers_with_a_history(solver):
    """Radau5 (its Newton iteration starts from the last step's polynomial, which does not
    change the converged stages) and BDF (whose steps are linear in its history of differences,
    whose sensitivities travel with it), on the Prothero-Robinson equations
    `y' = -lam (y - cos t) - sin t`, `y = cos t + (y0 - 1) exp(-lam t)`: the derivatives in
    `lam` and `y0` by `jacfwd` and `grad` equal the closed form to the tolerance."""
    lam, y0, t1 = jnp.array([50.0, 2.0]), jnp.array([2.0, 3.0]), 0.2

    def final(lam, y0):
        sol = odeckpt.solve(
            lambda t, y, lam: -lam * (y - jnp.cos(t)) - jnp.sin(t), y0, (0.0, t1), lam,
            solver=solver, adjoint="forward_sensitivity", rtol=1e-8, atol=1e-10,
        )  # fmt: skip
        return sol.ys[-1]

    decay = np.exp(-np.asarray(lam) * t1)
    exact_lam = np.diag(-(np.asarray(y0) - 1) * t1 * decay)
    d_lam, d_y0 = jax.jit(jax.jacfwd(final, argnums=(0, 1)))(lam, y0)
    np.testing.assert_allclose(d_lam, exact_lam, atol=1e-8)
    np.testing.assert_allclose(d_y0, np.diag(decay), atol=1e-8)
    weights = jnp.array([1.0, -2.0])
    g_lam = jax.jit(jax.grad(lambda lam: final(lam, y0) @ weights))(lam)
    np.testing.assert_allclose(g_lam, weights @ exact_lam, atol=1e-8)


@pytest.mark.slow
def test_robertson_to_1e11_with_radau():
    """Radau5's sensitivities on Robertson's kinetics to t1 = 1e11 (k = 0.04, 3e7, 1e4; rtol
    1e-6, atol 1e-10): the Jacobian of y(t1) in log k to 6 digits against scipy's Radau
    sensitivities at rtol 1e-12 (Kvaerno5's reach 3.5; docs/which-adjoint.md), at least as
    many as the discrete derivative's."""
    k, y0, t1 = np.array([0.04, 3e7, 1e4]), np.array([1.0, 0.0, 0.0]), 1e11
    reference = sensitivity_reference(robertson, y0, np.log(k), t1)

    def digits(adjoint, mode):
        final = lambda log_k: odeckpt.solve(
            robertson, jnp.asarray(y0), (0.0, t1), jnp.exp(log_k), solver="radau", rtol=1e-6,
            atol=1e-10, adjoint=adjoint, max_steps=20_000,
        ).ys[-1]  # fmt: skip
        jacobian = np.asarray(jax.jit(mode(final))(jnp.log(k)))
        return -math.log10(np.max(np.abs(jacobian - reference)) / np.max(np.abs(reference)))

    sensitivities = digits("forward_sensitivity", jax.jacfwd)
    assert sensitivities >= 6.0
    assert sensitivities >= digits("recursive", jax.jacrev)
