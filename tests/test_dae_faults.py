"""Fault injection for DAEs (`solve(mass_matrix=...)`): NaN and inf in the vector field after a
time, in its algebraic equation, in `args` and in `y0` (its differential part, and its
algebraic guess), one fault per lane of a batch beside a healthy lane, under `jax.jit` and
`odeckpt.jit`, for each DAE stepper and each adjoint that takes DAEs. A faulty lane fails (a
status that is not `successful`) with a NaN gradient; the healthy lane's gradient is exact.

The problem: `y1' = -k y1`, `0 = y2 - y1^2` (`y1 = a e^{-k t}`, `y2 = y1^2`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

STEPPERS = {"radau5": odeckpt.Radau5(), "bdf": odeckpt.BDF(), "rodas5": odeckpt.Rodas5()}
ADJOINTS = ("direct", "recursive", "forward", "forward_sensitivity")
JITS = {"jax.jit": jax.jit, "odeckpt.jit": odeckpt.jit}
M = np.diag([1.0, 0.0])
T = 1.0


def faulty(t, y, p):
    """The DAE, its differential row replaced by `value` after `t_fault`, its algebraic row
    after `t_algebraic`."""
    k, t_fault, t_algebraic, value = p
    return jnp.stack([
        jnp.where(t > t_fault, value, -k * y[0]),
        jnp.where(t > t_algebraic, value, y[1] - y[0] ** 2),
    ])  # fmt: skip


# One lane per fault: (a, guess, k, t_fault, t_algebraic, value); the healthy one last.
LANES = np.array([
    [1.0, 0.0, 1.3, 0.4, 9.0, np.nan],
    [1.0, 0.0, 1.3, 9.0, 0.6, np.inf],
    [1.0, 0.0, np.nan, 9.0, 9.0, 0.0],
    [np.inf, 0.0, 1.3, 9.0, 9.0, 0.0],
    [1.0, np.nan, 1.3, 9.0, 9.0, 0.0],
    [0.7, 0.3, 1.3, 9.0, 9.0, 0.0],
])  # fmt: skip


def _pairs():
    fast = {("radau5", "recursive", "jax.jit"), ("bdf", "forward_sensitivity", "odeckpt.jit")}
    cases = [(s, a, j) for s in STEPPERS for a in ADJOINTS for j in JITS]
    return slow_unless(cases, fast)


@pytest.mark.parametrize("solver, adjoint, jit", _pairs())
def test_faults_fail_per_lane_with_nan_gradients(solver, adjoint, jit):
    def loss(a, guess, k, t_fault, t_algebraic, value):
        sol = odeckpt.solve(
            faulty, jnp.stack([a, guess]), (0.0, T), (k, t_fault, t_algebraic, value),
            solver=STEPPERS[solver], adjoint=odeckpt.ForwardSensitivity()
            if adjoint == "forward_sensitivity" else adjoint, mass_matrix=M, throw=False,
            rtol=1e-8, atol=1e-10, max_steps=512,
        )  # fmt: skip
        return jnp.sum(sol.ys), sol.status == odeckpt.Status.successful

    def lane(*row):
        derivative = jax.jacfwd if adjoint == "forward" else jax.grad
        d, ok = derivative(loss, argnums=(0, 1, 2), has_aux=True)(*row)
        return ok, jnp.stack(d)

    ok, grads = JITS[jit](jax.vmap(lane))(*(jnp.asarray(c) for c in LANES.T))
    assert ok.tolist() == [False] * 5 + [True]
    assert np.all(np.isnan(grads[:5]))
    a, k = 0.7, 1.3
    y1 = a * np.exp(-k * T)
    # d(y1 + y1^2)/da, /d guess (0: the guess is not part of the solution), /dk
    want = [(1 + 2 * y1) * y1 / a, 0.0, (1 + 2 * y1) * (-T * y1)]
    np.testing.assert_allclose(grads[5], want, rtol=1e-6, atol=1e-14)


def test_throw_raises_for_a_failing_lane_naming_the_status():
    def solve(a):
        return odeckpt.solve(faulty, jnp.stack([a, 0.0]), (0.0, T), (1.3, 9.0, 9.0, 0.0),
                             solver=odeckpt.Radau5(), mass_matrix=M).ys  # fmt: skip

    with pytest.raises(Exception, match="y0 contains NaN or inf"):
        jax.vmap(solve)(jnp.array([1.0, np.nan]))


@pytest.mark.parametrize("name", slow_unless(list(STEPPERS), fast={"rodas5"}))
def test_save_times_at_the_span_ends_and_zero_length_spans(name):
    """Rows at `t0` and `t1` hold the consistent states; a zero-length span returns the
    consistent `y0` (its algebraic part solved) in zero steps."""
    solver = STEPPERS[name]
    sol = odeckpt.solve(faulty, jnp.array([2.0, 0.0]), (0.0, T), (0.5, 9.0, 9.0, 0.0),
                        solver=solver, mass_matrix=M, saveat=jnp.array([0.0, 0.0, T]),
                        rtol=1e-9, atol=1e-11)  # fmt: skip
    y1 = 2.0 * np.exp(-0.5 * T)
    np.testing.assert_allclose(sol.ys, [[2.0, 4.0], [2.0, 4.0], [y1, y1**2]], rtol=1e-7)
    empty = odeckpt.solve(faulty, jnp.array([2.0, 0.0]), (0.3, 0.3), (0.5, 9.0, 9.0, 0.0),
                          solver=solver, mass_matrix=M)  # fmt: skip
    assert empty.stats.num_steps == 0
    np.testing.assert_allclose(empty.ys[-1], [2.0, 4.0], rtol=1e-12)
