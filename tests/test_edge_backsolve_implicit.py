"""`BacksolveAdjoint()` with an implicit stepper, at its default settings: `y(t)` is read from
forward re-solves, and only the adjoint `a` and the parameter integral `g` are integrated
backwards. A forcing of `f` in time shows in the integrand of `g` but hardly in `a` (constant
between two saves where `f` does not depend on `y`), so only the error control of `g` resolves
it; a known discontinuity of `f` (`jump_ts`) must end the backward steps as it ends the forward
ones; and the stages of `g`, which `a` drives but which drive nothing, must be solved to the
Newton tolerance like the rest. Each test checks a gradient, or the integral itself, against its
closed form: a piecewise forcing with every implicit stepper, a smooth one, and the backward
system alone with Radau5.

The default run keeps a few representative cases (a few seconds); `pytest -m slow` runs all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

IMPLICIT = [
    "radau", "bdf", "kvaerno3", "kvaerno4", "kvaerno5", "implicit_euler", "trapezoid", "rodas5",
]  # fmt: skip
SAVES = np.array([0.5, 1.5, 2.0])


def _gradient(f, solver, **kwargs):
    """`d/da` of the sum of the states saved at `SAVES` of `y' = f(t, y, a)`, `y(0) = 0`, under
    `BacksolveAdjoint()` at `rtol = atol = 1e-8`."""

    def loss(a):
        sol = odeckpt.solve(f, jnp.zeros(1), (0.0, 2.0), a, solver=solver,
                            adjoint=odeckpt.BacksolveAdjoint(), rtol=1e-8, atol=1e-8,
                            saveat=jnp.asarray(SAVES), **kwargs)  # fmt: skip
        return jnp.sum(sol.ys)

    return jax.grad(loss)(1.0)


def piecewise(t, y, a):
    return jnp.where(t < 1.0, a, -0.5 * a) * jnp.ones_like(y)


@pytest.mark.parametrize("solver", slow_unless(IMPLICIT, fast={"radau", "bdf"}))
def test_piecewise_forcing(solver):
    """`y' = a` before `t = 1` and `-a / 2` after: `y = 0.5 a, 0.75 a, 0.5 a` at the saves, so
    the derivative of their sum is 1.75."""
    gradient = _gradient(piecewise, solver, jump_ts=jnp.array([1.0]))
    np.testing.assert_allclose(gradient, 1.75, rtol=1e-6)


RATE = 0.1


def smooth(t, y, a):
    return -RATE * y + a * jnp.cos(3 * t)


SMOOTH = ["radau", "bdf", "kvaerno3", "kvaerno4", "kvaerno5", "rodas5"]


@pytest.mark.slow
@pytest.mark.parametrize("solver", SMOOTH)
def test_smooth_forcing(solver):
    """`y' = -r y + a cos(3t)`, `y(0) = 0`: `y = a u` with
    `u(t) = (r cos 3t + 3 sin 3t - r exp(-r t)) / (r^2 + 9)`, so the derivative is the sum of
    `u` at the saves."""
    u = (RATE * np.cos(3 * SAVES) + 3 * np.sin(3 * SAVES) - RATE * np.exp(-RATE * SAVES)) / (
        RATE**2 + 9
    )
    np.testing.assert_allclose(_gradient(smooth, solver), np.sum(u), rtol=1e-6)


def test_driven_integral_converges_in_every_stage():
    """The backward system of `y' = -r y + a cos(3t)` from `t = 1.5`, in `s = 1.5 - t`:
    `a' = r a`, `g' = a cos(3 (1.5 - s))`, so `g(s) = Re[e^{4.5i} (e^{(r - 3i) s} - 1) / (r - 3i)]`.
    A first step far too long is rejected down to an accepted one whose Newton iteration
    starts from the contraction the rejected ones measured; `a`'s stages are exact after one
    iteration, `g`'s only after two."""

    def backward(s, z, args):
        a, g = z
        return RATE * a, a * jnp.cos(3 * (1.5 - s))

    z0 = (jnp.ones(1), jnp.zeros(1))
    sol = odeckpt.solve(backward, z0, (0.0, 1.5), solver="radau", rtol=1e-8, atol=1e-8, dt0=10.0)
    rate = RATE - 3j
    exact = np.real(np.exp(4.5j) * (np.exp(rate * 1.5) - 1) / rate)
    np.testing.assert_allclose(sol.ys[1][-1, 0], exact, rtol=1e-9)
