"""DAEs `M y' = f(t, y, args)` against published reference solutions: CHEMAKZO and TRANSAMP
of the Bari test set for IVP solvers, and Robertson's kinetics as a DAE against its ODE form
(problems and references in `dae_problems.py`).

Digits are the test set's "scd", `-log10` of the largest relative error over the components
(`correct_digits` without a floor: every reference component here is far from 0). The bounds
are the digits measured with each stepper less about one digit; tolerances are atol = rtol,
as in the test set's own runs on CHEMAKZO and TRANSAMP.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dae_problems import CHEMAKZO, ROBERTSON, TRANSAMP, correct_digits, robertson_reference

import odeckpt

STEPPERS = {"Radau5": odeckpt.Radau5, "BDF": odeckpt.BDF, "Rodas5": odeckpt.Rodas5}


@functools.cache
def _solver(problem, stepper: str, max_steps: int):
    """`(rtol, atol) -> (ys at reference_ts, status)`, jitted once for every tolerance."""

    @jax.jit
    def solve(rtol, atol):
        sol = odeckpt.solve(
            problem.f, jnp.asarray(problem.y0), problem.t_span, jnp.asarray(problem.args),
            solver=STEPPERS[stepper](), mass_matrix=problem.mass_matrix, rtol=rtol, atol=atol,
            saveat=jnp.asarray(problem.reference_ts), max_steps=max_steps, throw=False,
        )  # fmt: skip
        return sol.ys, sol.status

    return solve


def _digits(problem, stepper: str, rtol: float, atol: float, max_steps: int = 16_384) -> float:
    ys, status = _solver(problem, stepper, max_steps)(rtol, atol)
    assert status == odeckpt.Status.successful, status
    return correct_digits(ys, problem.reference)


# Measured scd at rtol 1e-6 / 1e-8: Radau5 6.6 / 8.5, BDF 4.8 / 7.2, Rodas5 5.8 / 7.1.
CHEMAKZO_MIN_DIGITS = {"Radau5": (5.5, 7.5), "BDF": (3.5, 6.0), "Rodas5": (4.75, 6.0)}


@pytest.mark.parametrize("stepper", STEPPERS)
def test_chemakzo(stepper):
    """The chemical Akzo Nobel problem at t = 180 against the test set's reference: at least
    the digits measured less one, and more at the tighter tolerance."""
    loose, tight = (_digits(CHEMAKZO, stepper, rtol, rtol) for rtol in (1e-6, 1e-8))
    low, high = CHEMAKZO_MIN_DIGITS[stepper]
    assert loose >= low
    assert tight >= high
    assert tight >= loose + 1.0


# Measured scd at rtol 1e-6: Radau5 7.6, BDF 6.2 to 6.4, Rodas5 6.8.
TRANSAMP_MIN_DIGITS = {"Radau5": 6.5, "BDF": 5.0, "Rodas5": 5.5}


@pytest.mark.parametrize("stepper", STEPPERS)
def test_transamp(stepper):
    """The transistor amplifier (non-diagonal singular `M`, 40 periods of the input) at
    t = 0.2 against the test set's reference, rtol = atol = 1e-6."""
    assert _digits(TRANSAMP, stepper, 1e-6, 1e-6) >= TRANSAMP_MIN_DIGITS[stepper]


# Measured scd over the save times at rtol 1e-6, atol 1e-10: Radau5 8.1, BDF 5.7, Rodas5 6.0.
ROBERTSON_MIN_DIGITS = {"Radau5": 7.0, "BDF": 4.5, "Rodas5": 5.0}


@pytest.mark.parametrize("stepper", STEPPERS)
def test_robertson(stepper):
    """Robertson's kinetics with the conservation law as the algebraic equation and an
    inconsistent guess for `y3`, against the ODE form's solution at five save times from 1e-2
    to 1e5; the conservation law holds to rounding at each."""
    ys, status = _solver(ROBERTSON, stepper, 16_384)(1e-6, 1e-10)
    assert status == odeckpt.Status.successful, status
    assert correct_digits(ys, ROBERTSON.reference) >= ROBERTSON_MIN_DIGITS[stepper]
    np.testing.assert_allclose(np.sum(ys, axis=1), 1.0, rtol=0, atol=1e-14)


@pytest.mark.slow
def test_robertson_reference():
    """The stored ODE reference is what `robertson_reference` computes."""
    np.testing.assert_allclose(robertson_reference(), ROBERTSON.reference, rtol=1e-13)
