"""Gradients with a user Jacobian (`jac=`) that is approximate or stale, against closed forms.

A user `jac` is a hint for the speed of Newton's iteration, which converges to the same stages
with any matrix close enough: the values do not depend on it, and neither may the derivatives.
The implicit function theorem differentiates a converged stage with the exact Jacobian of `f`;
taking the user's there gave gradients that were wrong and reported as success (`-0.8 k` for
`-k`: `d y(1) / dk` 8% off with BDF and Kvaerno5, 0.2% with Radau5), and made the sensitivity
solve of `ForwardSensitivity` with Radau5 fail. The continuous adjoints called the user's
`jac` of `f` on their augmented backward system, and crashed inside it with any `jac`.

A Rosenbrock step has its Jacobian in its formula (Rodas5 needs an exact one for its order):
there the derivative is that of the steps computed with the user's `jac`, checked against
finite differences of the same discrete solve.

Problem: `y' = -k y`, `y(0) = 1`, `k = 0.8`, so `y(1) = exp(-k)` and `dy(1)/dk = -exp(-k)`.
The "approximate" Jacobian is `-0.8 k`, the "stale" one `-0.5` (exact at `k = 0.5`, and with
no derivative in `k`).

The default run keeps three representative cases (a few seconds); `pytest -m slow` runs all.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

K = 0.8
EXACT = -np.exp(-K)
JACOBIANS = {
    "approximate": lambda t, y, k: -0.8 * k * jnp.eye(1),
    "stale": lambda t, y, k: -0.5 * jnp.eye(1),
    "exact": lambda t, y, k: -k * jnp.eye(1),
}
ADJOINTS = ["recursive", "direct", "forward_sensitivity", "backsolve", "interpolating", "forward"]
DISCRETE = ["recursive", "direct", "forward_sensitivity", "forward"]
STEPPERS = {
    "kvaerno3": odeckpt.Kvaerno3, "kvaerno4": odeckpt.Kvaerno4, "kvaerno5": odeckpt.Kvaerno5,
    "radau": odeckpt.Radau5, "bdf": odeckpt.BDF, "implicit_euler": odeckpt.ImplicitEuler,
    "trapezoid": odeckpt.Trapezoid, "rodas5": odeckpt.Rodas5,
}  # fmt: skip


def decay(t, y, k):
    return -k * y


def _gradient(solver, adjoint, **kwargs):
    """`d y(1) / dk` at `K`; `adjoint="forward"` by `jax.jacfwd`, any other by `jax.grad`."""

    def final(k):
        sol = odeckpt.solve(decay, jnp.ones(1), (0.0, 1.0), k, solver=solver, adjoint=adjoint,
                            **kwargs)  # fmt: skip
        return sol.ys[-1, 0]

    differentiate = jax.jacfwd if adjoint == "forward" else jax.grad
    return float(differentiate(final)(K))


NEWTON_CASES = list(
    itertools.product(["kvaerno3", "kvaerno4", "kvaerno5", "radau", "bdf"], ADJOINTS,
                      ["approximate", "stale"])
)  # fmt: skip


@pytest.mark.parametrize(
    ("stepper", "adjoint", "jac"),
    slow_unless(
        NEWTON_CASES,
        fast={("kvaerno5", "recursive", "approximate"), ("radau", "backsolve", "stale")},
    ),
)
def test_inexact_jac_gives_the_exact_gradient(stepper, adjoint, jac):
    """Adaptive steps at `rtol = 1e-8`: the gradient is the closed form's. Before the fix,
    with the approximate Jacobian: -0.48727 for BDF and Kvaerno5, -0.45023 for Radau5
    (recursive); Radau5's sensitivity solve failed; both continuous adjoints crashed."""
    solver = STEPPERS[stepper](jac=JACOBIANS[jac])
    gradient = _gradient(solver, adjoint, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(gradient, EXACT, rtol=1e-6)


def _one_step_factor(stepper: str, z: float) -> float:
    """The factor `R(z)` of one step of `y' = lambda y` with `z = h lambda`."""
    return {"implicit_euler": 1 / (1 - z), "trapezoid": (1 + z / 2) / (1 - z / 2)}[stepper]


LOW_ORDER_CASES = list(
    itertools.product(["implicit_euler", "trapezoid"], DISCRETE, ["approximate", "stale"])
)


@pytest.mark.parametrize(("stepper", "adjoint", "jac"), slow_unless(LOW_ORDER_CASES, fast=()))
def test_inexact_jac_gives_the_discrete_solves_gradient(stepper, adjoint, jac):
    """First- and second-order steppers at 32 constant steps `h`: `y(1) = R(-k h)^32`, whose
    derivative in `k` is `-32 h R(-k h)^31 R'(-k h)`."""
    h, n = 1 / 32, 32
    solver = STEPPERS[stepper](jac=JACOBIANS[jac])
    gradient = _gradient(solver, adjoint, controller=odeckpt.ConstantStep(), dt0=h, rtol=1e-10,
                         atol=1e-12)  # fmt: skip
    r = lambda k: _one_step_factor(stepper, -k * h) ** n
    expected = jax.grad(r)(K)
    np.testing.assert_allclose(gradient, expected, rtol=1e-8)


@pytest.mark.parametrize(
    ("adjoint", "jac"),
    slow_unless(
        list(itertools.product(DISCRETE, ["approximate", "stale"])), fast={("forward", "stale")}
    ),
)
def test_rosenbrock_gradient_is_that_of_the_steps_computed(adjoint, jac):
    """Rodas5 at 20 constant steps: its Jacobian is part of each step's formula, so the
    gradient is that of the discrete solve with the user's `jac`, against its central finite
    differences. Before the fix, the refinement of the main stages (whose correction an
    approximate Jacobian makes more than rounding) was not differentiated: -0.449631 against
    -0.449328 with the approximate Jacobian, -0.450485 against -0.449323 with the stale
    one."""
    solver = odeckpt.Rodas5(jac=JACOBIANS[jac])
    steps = dict(controller=odeckpt.ConstantStep(), dt0=0.05)

    @jax.jit
    def final(k):
        return odeckpt.solve(decay, jnp.ones(1), (0.0, 1.0), k, solver=solver, **steps).ys[-1, 0]

    eps = 1e-5
    differences = (final(K + eps) - final(K - eps)) / (2 * eps)
    gradient = _gradient(solver, adjoint, **steps)
    np.testing.assert_allclose(gradient, differences, rtol=1e-8)
    # The discrete solve is about as accurate as its values (Rodas5 loses its order with an
    # inexact Jacobian).
    np.testing.assert_allclose(gradient, EXACT, rtol=3e-5)


CONTINUOUS_CASES = list(itertools.product(STEPPERS, ["backsolve", "interpolating"]))
# Tolerances at which a solve ends within a few steps' budget; implicit Euler's gradient is
# then 0.2% off the closed form (`rtol` 1e-6 at the others').
LOOSER = {"implicit_euler": (1e-4, 5e-3), "trapezoid": (1e-6, 1e-6)}


@pytest.mark.parametrize(("stepper", "adjoint"), slow_unless(CONTINUOUS_CASES, fast=()))
def test_continuous_adjoints_take_an_exact_user_jac(stepper, adjoint):
    """The backward solve's stepper is one of the augmented system (`jax.jacfwd` of it), the
    forward re-solves keep the user's `jac` of `f`. Before the fix, every case raised
    `TypeError` inside the user's `jac` (called with the backward system's state and
    arguments). The gradient is the closed form's, and for implicit Euler (whose solve is
    coarse) that of the same solve without `jac`."""
    rtol, accuracy = LOOSER.get(stepper, (1e-8, 1e-6))
    solve = lambda jac: _gradient(STEPPERS[stepper](jac=jac), adjoint, rtol=rtol, atol=rtol / 100)
    gradient = solve(JACOBIANS["exact"])
    np.testing.assert_allclose(gradient, EXACT, rtol=accuracy)
    if stepper == "implicit_euler":
        np.testing.assert_allclose(gradient, solve(None), rtol=1e-7)


SECOND_CASES = [
    ("kvaerno5", "forward", "forward over forward"),
    ("radau", "recursive", "forward over reverse"),
    ("bdf", "direct", "forward over reverse"),
    ("radau", "forward_sensitivity", "forward over reverse"),
]


@pytest.mark.parametrize(("stepper", "adjoint", "mode"), slow_unless(SECOND_CASES, fast=()))
def test_inexact_jac_gives_the_exact_second_derivative(stepper, adjoint, mode):
    """`d2 y(1) / dk2 = exp(-k)`, with the approximate Jacobian. (Forward over reverse through
    the ESDIRK steppers is a known defect of its own: tests/test_implicit.py.)"""
    solver = STEPPERS[stepper](jac=JACOBIANS["approximate"])

    def final(k):
        sol = odeckpt.solve(decay, jnp.ones(1), (0.0, 1.0), k, solver=solver, adjoint=adjoint,
                            rtol=1e-8, atol=1e-10)  # fmt: skip
        return sol.ys[-1, 0]

    inner = jax.jacfwd if mode == "forward over forward" else jax.grad
    second = jax.jacfwd(inner(final))(K)
    np.testing.assert_allclose(second, np.exp(-K), rtol=1e-6)
