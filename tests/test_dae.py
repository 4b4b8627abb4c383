"""Differential-algebraic equations `M y' = f(t, y, args)` (`solve(mass_matrix=...)`): closed-form
solutions, consistent initial values, gradients of every adjoint that takes DAEs against the
exact ones, pytree, complex and batched states, events and known discontinuities, and the
failures (inconsistent values, index 2, a stepper or adjoint that cannot) as clear errors.

The problem of most tests is `y1' = -k y1`, `0 = y2 - y1^2`: `y1 = a e^{-k t}`, `y2 = y1^2`, with
the algebraic part of `y0` only a guess."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dae_problems import ROBERTSON
from selection import slow_unless

import odeckpt

STEPPERS = {"radau5": odeckpt.Radau5(), "bdf": odeckpt.BDF(), "rodas5": odeckpt.Rodas5()}
ADJOINTS = {
    "direct": "direct",
    "recursive": "recursive",
    "forward": "forward",
    "forward_sensitivity": odeckpt.ForwardSensitivity(),
}
M = np.diag([1.0, 0.0])
T = 1.5


def decay(t, y, k):
    return jnp.stack([-k * y[0], y[1] - y[0] ** 2])


def exact(a, k, t):
    y1 = a * jnp.exp(-k * t)
    return jnp.stack([y1, y1**2], axis=-1)


def _solve(y0, k, solver="radau5", t1=T, **options):
    options = dict(rtol=1e-8, atol=1e-10) | options
    return odeckpt.solve(decay, y0, (0.0, t1), k, solver=STEPPERS[solver], mass_matrix=M, **options)


@pytest.mark.parametrize("solver", STEPPERS)
def test_closed_form_from_an_inconsistent_guess(solver):
    ts = jnp.array([0.0, 0.5, T])
    sol = _solve(jnp.array([2.0, -3.0]), 0.7, solver, saveat=ts)
    assert sol.status == odeckpt.Status.successful
    np.testing.assert_allclose(sol.ys, exact(2.0, 0.7, ts), rtol=1e-6)
    assert sol.ys[0, 1] == pytest.approx(4.0, rel=1e-10)  # the solve starts consistent


@pytest.mark.parametrize(
    "solver, adjoint",
    slow_unless(
        [(s, a) for s in STEPPERS for a in ADJOINTS],
        fast={("radau5", "recursive"), ("bdf", "forward_sensitivity"), ("rodas5", "direct")},
    ),
)
def test_gradients_equal_the_exact_ones(solver, adjoint):
    weights = jnp.array([1.0, 3.0])

    def loss(y0, k):
        sol = _solve(y0, k, solver, adjoint=ADJOINTS[adjoint])
        return jnp.sum(sol.ys[-1] * weights)

    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    y0, k = jnp.array([2.0, 0.0]), 0.7
    got = derivative(loss, argnums=(0, 1))(y0, k)
    want = jax.grad(lambda y0, k: jnp.sum(exact(y0[0], k, T) * weights), argnums=(0, 1))(y0, k)
    # The algebraic part of y0 is a guess that the solution does not depend on.
    assert got[0][1] == 0
    np.testing.assert_allclose(got[0][0], want[0][0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


@pytest.mark.parametrize(
    "adjoint", slow_unless(["recursive", "forward_sensitivity"], fast={"recursive"})
)
def test_derivatives_in_the_times_follow_the_slope_of_the_dae(adjoint):
    """`dy/dt` of a DAE is not `f` (its algebraic rows are constraints): derivatives in the end
    time, in save times and of a zero-length span use the solution's slope."""
    y0, k = jnp.array([2.0, 0.0]), 0.7
    slope = lambda t: jax.jacfwd(lambda t: exact(2.0, k, t))(t)
    end = jax.grad(lambda t1: _solve(y0, k, t1=t1, adjoint=ADJOINTS[adjoint]).ys[-1, 1])(T)
    np.testing.assert_allclose(end, slope(T)[1], rtol=1e-7)

    def saved(ts):
        sol = _solve(y0, k, t1=2.0, saveat=ts, adjoint=ADJOINTS[adjoint])
        return jnp.sum(sol.ys[:, 1])

    ts = jnp.array([0.5, 1.0])
    np.testing.assert_allclose(jax.grad(saved)(ts), jax.vmap(slope)(ts)[:, 1], rtol=1e-7)
    zero = jax.grad(lambda t1: _solve(y0, k, t1=t1, adjoint=ADJOINTS[adjoint]).ys[-1, 1])(0.0)
    np.testing.assert_allclose(zero, slope(0.0)[1], rtol=1e-12)


def test_check_accepts_consistent_values_and_fails_inconsistent_ones():
    check = odeckpt.MassMatrix(M, initial="check")
    run = lambda y0: odeckpt.solve(
        decay, y0, (0.0, T), 0.7, solver=odeckpt.Radau5(), mass_matrix=check, throw=False
    )
    assert run(jnp.array([2.0, 4.0])).status == odeckpt.Status.successful
    bad = run(jnp.array([2.0, 4.5]))
    assert bad.status == odeckpt.Status.inconsistent_initial_values
    assert bad.stats.num_steps == 0
    with pytest.raises(Exception, match="inconsistent|do not satisfy the algebraic"):
        odeckpt.solve(decay, jnp.array([2.0, 4.5]), (0.0, T), 0.7, solver=odeckpt.Radau5(),
                      mass_matrix=check)  # fmt: skip
    grad = jax.grad(lambda y0: run(y0).ys[-1, 0])(jnp.array([2.0, 4.5]))
    assert np.all(np.isnan(grad))


def test_constraints_without_a_solution_fail():
    def no_root(t, y, k):
        return jnp.stack([-k * y[0], y[1] ** 2 + 1.0])  # 0 = y2^2 + 1 has no real root

    sol = odeckpt.solve(no_root, jnp.array([1.0, 0.5]), (0.0, 1.0), 0.7, solver=odeckpt.Radau5(),
                        mass_matrix=M, throw=False)  # fmt: skip
    assert sol.status == odeckpt.Status.inconsistent_initial_values


@pytest.mark.parametrize("solver", slow_unless(list(STEPPERS), fast={"bdf"}))
def test_index_two_is_detected(solver):
    """`x' = z`, `0 = x - sin(t)`: the constraint does not involve `z` (index 2)."""

    def index_two(t, y, args):
        return jnp.stack([y[1], y[0] - jnp.sin(t)])

    def run(throw):
        return odeckpt.solve(index_two, jnp.array([0.0, 1.0]), (0.0, 1.0),
                             solver=STEPPERS[solver], mass_matrix=M, throw=throw)  # fmt: skip

    assert run(False).status == odeckpt.Status.dae_index
    with pytest.raises(Exception, match="not of index 1"):
        run(True)


@pytest.mark.parametrize("solver", ["tsit5", "kvaerno5", "euler"])
def test_steppers_without_mass_matrices_refuse_naming_those_with(solver):
    with pytest.raises(ValueError, match="Radau5.*BDF.*Rodas5"):
        odeckpt.solve(decay, jnp.array([2.0, 4.0]), (0.0, T), 0.7, solver=solver, mass_matrix=M)


@pytest.mark.parametrize("adjoint", [odeckpt.BacksolveAdjoint(), odeckpt.InterpolatingAdjoint()])
def test_continuous_adjoints_refuse_with_the_reason(adjoint):
    with pytest.raises(ValueError, match="Cao, Li, Petzold & Serban.*recursive"):
        _solve(jnp.array([2.0, 4.0]), 0.7, adjoint=adjoint)


def test_forward_sensitivity_refuses_jumps_of_a_dae():
    event = odeckpt.Event(lambda t, y, k: t - 0.5, terminal=False,
                          update=lambda t, y, k: y.at[0].mul(2.0))  # fmt: skip
    with pytest.raises(ValueError, match="update.*recursive"):
        _solve(jnp.array([2.0, 4.0]), 0.7, adjoint=odeckpt.ForwardSensitivity(), event=event)


def test_bad_mass_matrices_raise_naming_the_fix():
    with pytest.raises(ValueError, match="exactly one"):
        odeckpt.MassMatrix()
    with pytest.raises(ValueError, match="square"):
        odeckpt.MassMatrix(np.ones((2, 3)))
    with pytest.raises(ValueError, match="initial"):
        odeckpt.MassMatrix(M, initial="guess")
    run = lambda mass: odeckpt.solve(decay, jnp.array([2.0, 4.0]), (0.0, T), 0.7,
                                     solver=odeckpt.Radau5(), mass_matrix=mass)  # fmt: skip
    with pytest.raises(ValueError, match="must be \\(2, 2\\)"):
        run(np.eye(3))
    with pytest.raises(ValueError, match="traced.*belongs in `f`"):
        jax.jit(run)(M)


def test_pytree_state_with_a_diagonal_equals_the_flat_solve():
    def tree_field(t, y, k):
        return {"x": -k * y["x"], "z": y["z"] - y["x"] ** 2}

    y0 = {"x": jnp.array([2.0, 1.0]), "z": jnp.zeros(2)}
    mass = odeckpt.MassMatrix(diagonal={"x": 1.0, "z": 0.0})
    tree = odeckpt.solve(tree_field, y0, (0.0, T), 0.7, solver=odeckpt.Radau5(), mass_matrix=mass,
                         rtol=1e-8, atol=1e-10)  # fmt: skip
    want = exact(jnp.array([2.0, 1.0]), 0.7, T)
    np.testing.assert_allclose(tree.ys["x"][-1], want[:, 0], rtol=1e-7)
    np.testing.assert_allclose(tree.ys["z"][-1], want[:, 1], rtol=1e-7)


@pytest.mark.parametrize("solver", slow_unless(list(STEPPERS), fast={"radau5"}))
def test_complex_state(solver):
    """`z' = i w z`, `0 = u - z^2` over complex components: `z = e^{i w t}`, `u = z^2`."""

    def rotation(t, y, w):
        return jnp.stack([1j * w * y[0], y[1] - y[0] ** 2])

    def end(w):
        return odeckpt.solve(rotation, jnp.array([1.0 + 0j, 0j]), (0.0, 2.0), w,
                             solver=STEPPERS[solver], mass_matrix=M, rtol=1e-8,
                             atol=1e-10).ys[-1]  # fmt: skip

    z = np.exp(1.3j * 2.0)
    np.testing.assert_allclose(end(1.3), [z, z**2], rtol=1e-6)
    grad = jax.grad(lambda w: jnp.real(end(w)[1]))(1.3)
    np.testing.assert_allclose(grad, np.real(4j * np.exp(2.6j * 2.0)), rtol=1e-6)


@pytest.mark.parametrize("solver", slow_unless(list(STEPPERS), fast={"rodas5"}))
def test_invertible_mass_matrix_is_an_implicit_ode(solver):
    mass = np.array([[2.0, 1.0], [1.0, 1.0]])
    rhs = lambda t, y, args: jnp.stack([y[1], -y[0]])
    explicit = lambda t, y, args: jnp.linalg.solve(mass, rhs(t, y, args))
    y0 = jnp.array([1.0, 0.5])
    got = odeckpt.solve(rhs, y0, (0.0, 3.0), solver=STEPPERS[solver], mass_matrix=mass,
                        rtol=1e-9, atol=1e-11).ys  # fmt: skip
    want = odeckpt.solve(explicit, y0, (0.0, 3.0), solver="dopri8", rtol=1e-12, atol=1e-14).ys
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_vmap_lanes_equal_solo_lanes_and_fail_alone():
    check = odeckpt.MassMatrix(M, initial="check")

    def lane(a, guess, k):
        sol = odeckpt.solve(decay, jnp.stack([a, guess]), (0.0, T), k, solver=odeckpt.BDF(),
                            mass_matrix=check, throw=False, rtol=1e-8, atol=1e-10)  # fmt: skip
        return sol.ys[-1], sol.status == odeckpt.Status.successful

    a = jnp.array([2.0, 1.0, 3.0])
    guess = jnp.array([4.0, 1.0, 0.0])  # the last lane inconsistent
    k = jnp.array([0.7, 1.3, 0.2])
    ys, ok = jax.jit(jax.vmap(lane))(a, guess, k)
    assert ok.tolist() == [True, True, False]
    for i in range(2):
        solo, _ = lane(a[i], guess[i], k[i])
        np.testing.assert_allclose(ys[i], solo, rtol=1e-12)


@pytest.mark.parametrize(
    "solver, adjoint",
    slow_unless([(s, a) for s in STEPPERS for a in ("direct", "forward")],
                fast={("radau5", "forward")}),
)  # fmt: skip
def test_event_update_makes_the_jumped_state_consistent(solver, adjoint):
    """At `t = 0.5` the differential part doubles; the algebraic part is solved again there
    (the update leaves it inconsistent)."""
    event = odeckpt.Event(lambda t, y, k: t - 0.5, terminal=False,
                          update=lambda t, y, k: y.at[0].mul(2.0))  # fmt: skip
    derivative = jax.jacfwd if adjoint == "forward" else jax.jacrev

    def end(k):
        return _solve(jnp.array([2.0, 4.0]), k, solver, event=event, adjoint=adjoint).ys[-1]

    np.testing.assert_allclose(end(0.7), exact(4.0, 0.7, T), rtol=1e-6)
    dk = derivative(end)(0.7)
    np.testing.assert_allclose(dk, jax.jacfwd(lambda k: exact(4.0, k, T))(0.7), rtol=1e-5)


@pytest.mark.parametrize("adjoint", slow_unless(list(ADJOINTS), fast={"forward_sensitivity"}))
def test_terminal_event_on_an_algebraic_variable(adjoint):
    stop = odeckpt.Event(lambda t, y, k: y[1] - 1.0)  # y2 = 1 at t = ln(4) / (2 k)
    derivative = jax.jacfwd if adjoint == "forward" else jax.grad

    def crossing(k):
        sol = _solve(jnp.array([2.0, 0.0]), k, t1=5.0, event=stop, adjoint=ADJOINTS[adjoint])
        return sol.ts[-1]

    np.testing.assert_allclose(crossing(0.7), np.log(4) / 1.4, rtol=1e-7)
    np.testing.assert_allclose(derivative(crossing)(0.7), -np.log(4) / (2 * 0.49), rtol=1e-6)


def test_known_discontinuities():
    def forcing(t, y, k):
        return jnp.stack([jnp.where(t < 0.5, -k, k) * y[0], y[1] - y[0] ** 2])

    sol = odeckpt.solve(forcing, jnp.array([2.0, 0.0]), (0.0, 1.0), 0.7, solver=odeckpt.Rodas5(),
                        mass_matrix=M, jump_ts=jnp.array([0.5]), rtol=1e-9, atol=1e-11)  # fmt: skip
    np.testing.assert_allclose(sol.ys[-1], [2.0, 4.0], rtol=1e-7)


def test_newton_krylov_and_dense_output():
    solver = odeckpt.Radau5(newton=odeckpt.NewtonKrylov())
    sol = odeckpt.solve(decay, jnp.array([2.0, 0.0]), (0.0, T), 0.7, solver=solver, mass_matrix=M,
                        rtol=1e-8, atol=1e-10, saveat=odeckpt.SaveAt(dense=True))  # fmt: skip
    ts = jnp.linspace(0.0, T, 7)
    np.testing.assert_allclose(jax.vmap(sol.evaluate)(ts), exact(2.0, 0.7, ts), rtol=1e-5)


@pytest.mark.parametrize("solver", slow_unless(list(STEPPERS), fast={"radau5"}))
def test_vmap_gradients_of_lanes_that_finish_at_different_steps(solver):
    """A lane that has finished steps on masked with zero-length steps, whose equations
    `M Z = 0` are singular with `M`: its gradient must stay exact (d x1(1)/dk = e^k)."""

    def x1(k):
        return odeckpt.solve(
            lambda t, y, k: jnp.stack([-k * y[1], y[0] + y[1] - 1.0]), jnp.array([2.0, -1.0]),
            (0.0, 1.0), k, solver=STEPPERS[solver], mass_matrix=M, rtol=1e-9, atol=1e-11,
        ).ys[-1, 0]  # fmt: skip

    ks = jnp.array([0.5, 0.7, 3.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(x1))(ks), np.exp(ks), rtol=1e-6)


def test_ensemble():
    a = jnp.array([[2.0, 0.0], [1.0, 0.0]])
    k = jnp.array([0.7, 1.3])
    sol = odeckpt.ensemble(decay, a, (0.0, T), k, solver=odeckpt.Rodas5(), mass_matrix=M,
                           rtol=1e-8, atol=1e-10)  # fmt: skip
    np.testing.assert_allclose(sol.ys[:, -1], jax.vmap(exact, (0, 0, None))(a[:, 0], k, T),
                               rtol=1e-6)  # fmt: skip


@pytest.mark.parametrize("adjoint", slow_unless(list(ADJOINTS), fast={"recursive"}))
def test_rate_constant_gradients_of_robertson_equal_finite_differences(adjoint):
    """Robertson's kinetics with its conservation law as the algebraic equation: the gradient
    of the concentrations at t = 40 in the log rate constants, against central differences of
    tight solves."""

    def end(log_k, rtol):
        sol = odeckpt.solve(ROBERTSON.f, jnp.asarray(ROBERTSON.y0), (0.0, 40.0), jnp.exp(log_k),
                            solver=odeckpt.Radau5(), mass_matrix=ROBERTSON.mass_matrix,
                            rtol=rtol, atol=rtol * 1e-4, adjoint=ADJOINTS[adjoint])  # fmt: skip
        return sol.ys[-1] @ jnp.array([1.0, 1e4, 1.0])

    log_k = jnp.log(jnp.asarray(ROBERTSON.args))
    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    got = derivative(end)(log_k, 1e-8)
    step = 1e-4
    basis = np.eye(3) * step
    fd = np.array([(end(log_k + e, 1e-11) - end(log_k - e, 1e-11)) / (2 * step) for e in basis])
    np.testing.assert_allclose(got, fd, rtol=1e-5, atol=1e-9)
