"""Edges of the span and of the state that a solve must get right or refuse, never answer
wrongly: spans so short that the square of the step underflows (the derivative in `t1` of an
implicit step divided its increment by the step, whose derivative forms `h**2`), states with
empty leaves (a mean over no components is 0/0), and tolerances of the adjoints that are not
finite. Each case is checked against its closed form.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

IMPLICIT = ("radau", "bdf", "kvaerno5", "kvaerno3", "implicit_euler", "trapezoid", "rodas5")


_TINY = [(solver, adjoint) for solver in IMPLICIT for adjoint in ("forward", "recursive")]


@pytest.mark.parametrize("solver, adjoint", slow_unless(_TINY, fast={("kvaerno5", "forward")}))
def test_derivative_in_t1_over_a_tiny_span(solver, adjoint):
    """`y' = -k y` over `[0, span]`: `dy(t1)/dt1 = -k y0` and `dy(t1)/dk = 0` to rounding
    (1e-310 is subnormal)."""
    k, spans = 1.5, jnp.array([1e-200, 1e-310])

    def final(t1, k):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y, jnp.ones(1), (0.0, t1), k, solver=solver, adjoint=adjoint
        )
        return sol.ys[-1, 0]

    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    d_t1, d_k = jax.vmap(lambda t1: derivative(final, argnums=(0, 1))(t1, k))(spans)
    np.testing.assert_allclose(d_t1, -k, rtol=1e-12)
    np.testing.assert_allclose(d_k, 0.0, atol=1e-12)


@pytest.mark.parametrize(
    "adjoint",
    slow_unless(
        ["recursive", "direct", "forward_sensitivity", "backsolve", "interpolating"],
        fast={"forward_sensitivity"},
    ),
)
def test_state_with_an_empty_leaf(adjoint):
    """A leaf of shape (0,) beside a real one changes nothing: the same steps, the closed
    form's value and derivative (ForwardSensitivity's error norm once averaged over it)."""
    k = 0.8

    def solve(k, empty):
        y0 = {"y": jnp.ones(1), "empty": jnp.zeros((0,))}
        if not empty:
            y0.pop("empty")
        return odeckpt.solve(
            lambda t, y, k: jax.tree.map(lambda x: -k * x, y), y0, (0.0, 1.0), k,
            adjoint=adjoint, rtol=1e-8, atol=1e-10,
        )  # fmt: skip

    sol = solve(k, True)
    assert sol.ys["empty"].shape == (1, 0)
    assert int(sol.stats["num_steps"]) == int(solve(k, False).stats["num_steps"])
    d_k = jax.grad(lambda k: solve(k, True).ys["y"][-1, 0])(k)
    np.testing.assert_allclose(d_k, -np.exp(-k), rtol=1e-6)


@pytest.mark.parametrize("solver", slow_unless(["tsit5", "radau", "bdf"], fast={"tsit5"}))
def test_state_of_empty_leaves_only(solver):
    """No components: nothing to go wrong, a successful solve (it ended `nonfinite`: 0/0)."""
    sol = odeckpt.solve(lambda t, y, a: -y, jnp.zeros((0,)), (0.0, 1.0), solver=solver)
    assert sol.status == odeckpt.Status.successful
    assert sol.ys.shape == (1, 0)


@pytest.mark.parametrize("value", [np.inf, np.nan, -1.0, 0.0])
@pytest.mark.parametrize("field", ["rtol", "atol"])
def test_adjoint_tolerances_must_be_positive_and_finite(field, value):
    for adjoint in (odeckpt.ForwardSensitivity, odeckpt.BacksolveAdjoint,
                    odeckpt.InterpolatingAdjoint):  # fmt: skip
        with pytest.raises(ValueError, match="must be positive and finite"):
            adjoint(**{field: value})


def test_a_traced_first_step_is_a_hint():
    """`dt0` is a hint of the adaptive controller, like the automatic first step: a `dt0` that
    depends on a parameter gives the same derivative as a constant one of the same value (it
    added a term of the size of the tolerance)."""
    k = 0.8

    def final(k, dt0):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y, jnp.ones(1), (0.0, 1.0), k, rtol=1e-3, atol=1e-3, dt0=dt0
        )
        return sol.ys[-1, 0]

    fixed = jax.grad(final)(k, 0.4)
    np.testing.assert_array_equal(jax.grad(lambda k: final(k, 0.5 * k))(k), fixed)
