"""Rodas5 on problems whose vector field depends on time.

On `y' = g(t)` a Rosenbrock step is a quadrature rule over `g(t0 + c_i h)` and `h g'(t0)`.
Rodas5's published embedded solution uses the same rule as its main one (the freedom its
order-4 conditions leave lies on the last three stages, which share the node `c = 1`), so
its embedded estimate alone is exactly 0 there and the controller grows the step unchecked:
a wrong answer reported as success. These tests check the answer against closed forms, that
the error estimate of a pure-time forcing is nonzero and of the estimate's order, and the
global order on non-autonomous problems with a state dependence (a forced decay, and a
Prothero-Robinson problem) by regression slope.

The default run takes a few seconds; `pytest -m slow` adds the Prothero-Robinson order.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from test_steppers import fixed_step_solve, slope

import odeckpt


def cosine(t, y, args):
    return jnp.cos(3 * t) * jnp.ones_like(y)


def _solve_cosine(rtol):
    return odeckpt.solve(cosine, jnp.zeros(1), (0.0, 2.0), solver="rodas5", rtol=rtol, atol=rtol)


def test_pure_time_forcing_meets_the_tolerance():
    """`y' = cos 3t`, `y(0) = 0`: `y(2) = sin(6) / 3`."""
    sol = _solve_cosine(1e-8)
    error = abs(float(sol.ys[-1, 0]) - np.sin(6.0) / 3)
    assert error <= 2e-8, (error, sol.stats.num_steps)


def test_pure_time_forcing_steps_follow_the_tolerance():
    """A nonzero estimate makes the step count grow as the tolerance shrinks (for an order-4
    estimate, by about `10^(4/5)` per four decades)."""
    counts = [int(_solve_cosine(rtol).stats.num_steps) for rtol in (1e-4, 1e-8)]
    assert counts[1] > 2 * counts[0], counts


def test_pure_time_forcing_error_estimate_order():
    """One step of `y' = cos 3t` from the exact solution: the estimate is of order
    `error_order + 1` in `h` and dominates the true local error (order 6)."""
    stepper = odeckpt.Rodas5()
    t0, hs = 0.3, np.geomspace(1e-2, 1e-1, 5)
    y0 = jnp.full((1,), np.sin(3 * t0) / 3)
    estimates, local = [], []
    for h in hs:
        step = stepper.step(cosine, t0, t0 + h, y0, None, cosine(t0, y0, None))
        estimates.append(float(jnp.abs(step.y_error[0])))
        local.append(abs(float(step.y1[0]) - np.sin(3 * (t0 + h)) / 3))
    assert min(estimates) > 0, estimates
    assert slope(hs, estimates) == pytest.approx(stepper.error_order + 1, abs=0.3)
    assert np.all(np.asarray(estimates) > 3 * np.asarray(local)), (estimates, local)


RATE = 1.0


def forced_decay(t, y, args):
    return -RATE * y + jnp.cos(3 * t)


def forced_decay_exact(t):
    u = (RATE * jnp.cos(3 * t) + 3 * jnp.sin(3 * t) - RATE * jnp.exp(-RATE * t)) / (RATE**2 + 9)
    return u * jnp.ones(1)


# Non-stiff: at |LAMBDA h| >> 1 Rodas5 shows the order reduction of Rosenbrock methods on
# Prothero-Robinson problems (its stage order is 1), which is not what this checks.
LAMBDA = -2.0


def prothero_robinson(t, y, args):
    return LAMBDA * (y - jnp.sin(t)) + jnp.cos(t)


def prothero_robinson_exact(t):
    return jnp.sin(t) * jnp.ones(1)


@pytest.mark.parametrize(
    "f, exact, num_steps",
    [
        (forced_decay, forced_decay_exact, (8, 10, 12, 16, 20)),
        pytest.param(
            prothero_robinson, prothero_robinson_exact, (16, 20, 24, 32, 40),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["forced-decay", "prothero-robinson"],
)  # fmt: skip
def test_global_order_non_autonomous(f, exact, num_steps):
    """Constant steps over `[0, 2]`: the global error falls at order 5."""
    y1 = fixed_step_solve(odeckpt.Rodas5(), f, 0.0, 2.0, exact(0.0), num_steps)
    errors = jnp.linalg.norm(y1 - exact(2.0)[None], axis=-1)
    assert np.all(errors > 1e-13), errors
    assert slope(1 / np.asarray(num_steps), errors) == pytest.approx(5, abs=0.3), errors
