"""Radau5 and BDF: their coefficients and orders, stiff reference problems against scipy's
Radau, derivatives through their stages with every adjoint, Newton-Krylov, complex states,
batching, failures, and the contract that lets a stepper propose its own step sizes."""

import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from problems import (
    ROBER,
    ROBERTSON,
    STIFF_REFERENCES,
    STIFF_VAN_DER_POL,
    TEST_SET_REFERENCES,
    VDPOL,
    robertson,
)
from selection import slow_unless
from test_implicit import (
    _A_COMPLEX,
    _K,
    _U0,
    _Y0_COMPLEX,
    _assert_rows_close,
    _heat,
    _phase_decay,
    _phase_decay_exact,
    _robertson_final,
)
from test_steppers import exact, fixed_step_solve, slope, vector_field

import odeckpt
from odeckpt._error_norm import effective_tolerances
from odeckpt._steppers import (
    STEPPERS,
    AbstractProposer,
    BDFCoefficients,
    BDFState,
    CollocationTableau,
    Step,
    with_newton_tolerances,
)
from odeckpt._steppers._bdf import MAX_ORDER
from odeckpt._steppers._radau_tableau import RADAU_IIA_5

NAMES = ["radau", "bdf"]


def test_registry_and_class_attributes():
    expected = {"radau": (odeckpt.Radau5, 5, 3, 3), "bdf": (odeckpt.BDF, 5, 1, 5)}
    for name, (cls, order, error_order, degree) in expected.items():
        assert STEPPERS[name] is cls and issubclass(cls, AbstractProposer)
        assert (cls.order, cls.error_order, cls.dense_degree) == (order, error_order, degree)
    assert odeckpt.Radau5().newton.reuse_rate == 1e-3
    assert odeckpt.BDF().newton.max_iters == 4


_GOOD = dict(a=RADAU_IIA_5.a, c=RADAU_IIA_5.c, error=RADAU_IIA_5.error)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(c=[0.1, 0.6, 1.0]), "c_i must equal"),
        (dict(a=RADAU_IIA_5.a + np.outer([1, -1, 0], [1, -1, 0]) * 1e-3), "collocation"),
        (dict(error=RADAU_IIA_5.error * 1.01), "embedded"),
        (dict(a=np.eye(3)[:2]), "Shapes"),
    ],
)
def test_collocation_tableau_rejects_bad_data(change, message):
    CollocationTableau(**_GOOD)
    with pytest.raises(ValueError, match=message):
        CollocationTableau(**{**_GOOD, **change})


def test_radau_tableau_decouples_the_newton_matrix():
    # T^{-1} A T = [[gamma, 0, 0], [0, alpha, beta], [0, -beta, alpha]] (Hairer & Wanner IV.8).
    t = RADAU_IIA_5
    alpha, beta = t.eigenvalue.real, t.eigenvalue.imag
    blocks = np.array([[t.gamma, 0, 0], [0, alpha, beta], [0, -beta, alpha]])
    np.testing.assert_allclose(t.inverse @ t.a @ t.transform, blocks, atol=1e-14)
    # RADAU5's u1 = 1 / gamma = 3 + 3^(2/3) - 3^(1/3).
    assert 1 / t.gamma == pytest.approx(3 + 3 ** (2 / 3) - 3 ** (1 / 3), rel=1e-14)


def test_bdf_coefficients_reject_bad_kappa():
    with pytest.raises(ValueError, match="kappa"):
        BDFCoefficients(kappa=np.ones(MAX_ORDER + 1) * 0.1)
    with pytest.raises(ValueError, match="kappa"):
        BDFCoefficients(kappa=np.zeros(3))


def test_bad_configuration_raises_with_the_fix():
    with pytest.raises(ValueError, match="Newton-Krylov never forms the Jacobian.*Fix"):
        odeckpt.Radau5(jac=lambda t, y, a: -jnp.eye(1), newton=odeckpt.NewtonKrylov())
    with pytest.raises(ValueError, match="rtol=-1.*positive.*Fix"):
        odeckpt.BDF(rtol=-1.0)
    with pytest.raises(TypeError, match="ndf"):
        odeckpt.BDF(ndf="yes")


# ------------------------------------------------------------------------------------- orders


def test_radau5_global_convergence_order():
    # Newton converged far below the discretisation error, so the slope is the method's.
    stepper = with_newton_tolerances(odeckpt.Radau5(), 1e-13, 1e-13)
    num_steps = (3, 4, 5, 6, 8)
    y1 = fixed_step_solve(stepper, vector_field, 0.0, 1.0, exact(0.0), num_steps)
    errors = jnp.linalg.norm(y1 - exact(1.0)[None], axis=-1)
    assert np.all(errors > 1e-12), errors
    assert slope(1 / np.asarray(num_steps), errors) == pytest.approx(5, abs=0.3)


@jax.jit
def _radau_single_steps(hs):
    stepper = with_newton_tolerances(odeckpt.Radau5(), 1e-13, 1e-13)
    y0 = exact(0.3)
    state = stepper.init(vector_field, 0.3, y0, None)
    return jax.vmap(lambda h: stepper.step(vector_field, 0.3, 0.3 + h, y0, None, state))(hs)


@pytest.mark.slow
def test_radau5_local_orders_of_solution_estimate_and_dense_output():
    hs = np.geomspace(0.05, 0.2, 5)
    step = _radau_single_steps(jnp.asarray(hs))
    local = jnp.linalg.norm(step.y1 - jax.vmap(exact)(0.3 + hs), axis=-1)
    assert slope(hs, local) == pytest.approx(6, abs=0.4)
    # The embedded solution is of order 3 (local error h^4), and the estimate dominates.
    estimate = jnp.linalg.norm(step.y_error, axis=-1)
    assert slope(hs, estimate) == pytest.approx(4, abs=0.4)
    assert np.all(estimate > 3 * local)
    np.testing.assert_allclose(jnp.sum(step.dense, axis=1), step.y1, rtol=1e-14)
    assert jnp.array_equal(step.dense[:, 0], jnp.broadcast_to(exact(0.3), (5, 2)))
    # The collocation polynomial (stage order 3): local error h^4 inside the step (asymptotic
    # from shorter steps).
    hs = hs / 5
    step = _radau_single_steps(jnp.asarray(hs))
    mid = jnp.tensordot(0.5 ** jnp.arange(4.0), step.dense, axes=(0, 1))
    dense_error = jnp.linalg.norm(mid - jax.vmap(exact)(0.3 + hs / 2), axis=-1)
    assert slope(hs, dense_error) == pytest.approx(4, abs=0.3)


def _history(t0, h, order):
    """Backward differences of the exact solution at `t0, t0 - h, ..., t0 - order h`."""
    values = [np.asarray(exact(t0 - i * h)) for i in range(order + 1)]
    differences = [values[0]]
    for _ in range(order):
        values = [values[i] - values[i + 1] for i in range(len(values) - 1)]
        differences.append(values[0])
    rows = np.zeros((MAX_ORDER + 3, 2))
    rows[: order + 1] = differences
    return rows


# A low and the highest order by default; every order with -m slow.
@pytest.mark.parametrize("order", slow_unless(list(range(1, MAX_ORDER + 1)), fast={2, MAX_ORDER}))
def test_bdf_formula_of_each_order(order):
    """One step of order `k` from the exact equally spaced history: local error `h^(k+1)`. (A
    variable-order solve starts at order 1, so its global error with constant steps is
    dominated by its first steps; each formula's order is checked here.)"""
    # Newton to rounding (four iterations do not reach 1e-13 at the longer steps).
    stepper = with_newton_tolerances(odeckpt.BDF(newton=odeckpt.Newton(max_iters=12)), 1e-13, 1e-13)
    t0 = 0.3
    init = stepper.init(vector_field, t0, exact(t0), None)

    @jax.jit
    def step(h, differences):
        state = BDFState(
            implicit=init.implicit, differences=differences, h=h,
            order=jnp.asarray(order, jnp.int32), equal_steps=jnp.zeros((), jnp.int32),
        )  # fmt: skip
        return stepper.step(vector_field, t0, t0 + h, exact(t0), None, state).y1

    hs = np.geomspace(0.01, 0.04, 4) if order >= 4 else np.geomspace(0.005, 0.02, 4)
    errors = [np.linalg.norm(step(h, _history(t0, h, order)) - exact(t0 + h)) for h in hs]
    assert slope(hs, errors) == pytest.approx(order + 1, abs=0.35)


# ------------------------------------------------------------- stiff problems against scipy


def _solve(problem, t1, solver, rtol, atol, **kwargs):
    return odeckpt.solve(
        problem["f"], jnp.asarray(problem["y0"]), (0.0, t1), args=jnp.asarray(problem["args"]),
        solver=solver, rtol=rtol, atol=atol, max_steps=20000, **kwargs,
    )  # fmt: skip


def _relative_error(y, reference):
    return np.max(np.abs(np.asarray(y) - reference) / np.abs(reference))


# (solver, t1): the bound on the relative error at rtol 1e-8 against scipy's Radau at 1e-12
# (itself 3e-9 from the test set's reference at t = 1e11). Measured: Radau5 3.6e-11 (1e5) and
# 1.0e-8 (1e11); BDF 2.3e-8 and 9.8e-6.
_ROBERTSON_BOUNDS = {
    ("radau", 1e5): 1e-9,
    ("radau", 1e11): 5e-8,
    ("bdf", 1e5): 2e-7,
    ("bdf", 1e11): 1e-4,
}


@pytest.mark.parametrize(
    "solver, t1",
    [
        ("radau", 1e5),
        pytest.param("radau", 1e11, marks=pytest.mark.slow),
        pytest.param("bdf", 1e5, marks=pytest.mark.slow),
        pytest.param("bdf", 1e11, marks=pytest.mark.slow),
    ],
)
def test_robertson_against_scipy_radau(solver, t1):
    sol = _solve(ROBERTSON, t1, solver, rtol=1e-8, atol=1e-12)
    reference = STIFF_REFERENCES[("robertson", t1)]
    assert _relative_error(sol.ys[-1], reference) < _ROBERTSON_BOUNDS[(solver, t1)]
    # Jacobians are reused across steps.
    assert 0 < sol.stats.num_jacobian_evals < sol.stats.num_steps / 2


# Radau5 on Van der Pol runs by default in test_error_falls_about_a_decade_per_decade_of_rtol.
@pytest.mark.slow
@pytest.mark.parametrize("solver", NAMES)
def test_van_der_pol_against_scipy_radau(solver):
    # mu = 1000 over [0, 3000]: the error at t1 is a phase error of the relaxation
    # oscillation. Measured at rtol 1e-8: Radau5 9.1e-9, BDF 3.7e-7 (relative).
    sol = _solve(STIFF_VAN_DER_POL, 3000.0, solver, rtol=1e-8, atol=1e-8)
    reference = STIFF_REFERENCES[("van_der_pol", 3000.0)]
    assert _relative_error(sol.ys[-1], reference) < (1e-7 if solver == "radau" else 5e-6)


# ---------------------------------------------------------------------------- derivatives


def _central_jacobian(final, eps_scale=1e-3):
    """Central differences of `final(k)` in each rate constant, steps `eps_scale * k_i`."""
    columns = []
    for i in range(3):
        eps = eps_scale * _K[i]
        columns.append((final(_K.at[i].add(eps)) - final(_K.at[i].add(-eps))) / (2 * eps))
    return np.stack(columns, axis=1)


def _jacobian(solver, adjoint, transform=jax.jacrev):
    function = jax.jit(transform(_robertson_final), static_argnums=(1, 2))
    return np.asarray(function(_K, adjoint, solver))


# Radau5 by default (reverse mode through its stages), BDF with -m slow.
@pytest.mark.parametrize("solver", slow_unless(NAMES, fast={"radau"}))
def test_recursive_equals_direct(solver):
    """d y(10) / d k of Robertson in reverse mode, the stages through the implicit function
    theorem: the checkpointed sweep replays the forward steps (and BDF's orders) exactly."""
    direct = _jacobian(solver, odeckpt.DirectAdjoint())
    recursive = _jacobian(solver, odeckpt.RecursiveCheckpointAdjoint(checkpoints=3))
    _assert_rows_close(recursive, direct, 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("solver", NAMES)
def test_forward_mode_and_central_differences_equal_direct(solver):
    direct = _jacobian(solver, odeckpt.DirectAdjoint())
    forward = _jacobian(solver, odeckpt.ForwardMode(), jax.jacfwd)
    _assert_rows_close(forward, direct, 1e-9)
    # Central differences also see the step sizes move (the derivative holds them fixed).
    final = jax.jit(lambda k: _robertson_final(k, odeckpt.DirectAdjoint(), solver))
    _assert_rows_close(_central_jacobian(final), direct, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("solver", NAMES)
def test_backsolve_with_radau_or_bdf_backward(solver):
    """Each as BacksolveAdjoint's backward solver (re-solving y forwards from checkpoints):
    the continuous adjoint agrees with the discrete one to about the backward tolerance."""
    adjoint = odeckpt.BacksolveAdjoint(
        solver=STEPPERS[solver](), checkpoints=4, rtol=1e-8, atol=1e-12
    )
    backsolve = _jacobian("kvaerno5", adjoint)
    direct = _jacobian("kvaerno5", odeckpt.DirectAdjoint())
    _assert_rows_close(backsolve, direct, 1e-5)


# ----------------------------------------------------- Newton-Krylov, complex states, batches


# With -m slow: Newton-Krylov against dense Newton runs by default in test_implicit.py.
@pytest.mark.slow
@pytest.mark.parametrize("solver", [odeckpt.Radau5, odeckpt.BDF], ids=NAMES)
def test_newton_krylov_matches_dense_newton(solver):
    # The heat equation with a cubic sink, solved with each Newton method at rtol 1e-7.
    @functools.partial(jax.jit, static_argnums=0)
    def solve(newton):
        return odeckpt.solve(_heat, _U0, (0.0, 0.2), solver=solver(newton=newton), rtol=1e-7,
                             atol=1e-9)  # fmt: skip

    dense = solve(odeckpt.Newton())
    krylov = solve(odeckpt.NewtonKrylov())
    np.testing.assert_allclose(krylov.ys[-1], dense.ys[-1], rtol=0, atol=1e-6)
    assert krylov.stats.num_lu_factorisations == 0 < dense.stats.num_lu_factorisations


@pytest.mark.parametrize("solver", slow_unless(NAMES, fast={"bdf"}))
def test_complex_linear_system_against_matrix_exponential(solver):
    rtol = 1e-8 if solver == "radau" else 1e-7
    sol = odeckpt.solve(
        lambda t, y, a: a @ y, jnp.asarray(_Y0_COMPLEX), (0.0, 1.0),
        args=jnp.asarray(_A_COMPLEX), solver=solver, rtol=rtol, atol=rtol, max_steps=20000,
    )  # fmt: skip
    assert sol.ys.dtype == jnp.complex128
    exact_y1 = scipy.linalg.expm(_A_COMPLEX) @ _Y0_COMPLEX
    assert np.max(np.abs(np.asarray(sol.ys[-1]) - exact_y1)) < 100 * rtol


@pytest.mark.parametrize("solver", slow_unless(NAMES, fast={"radau"}))
def test_complex_non_holomorphic_field(solver):
    y0 = np.array([0.8 + 0.6j])
    sol = odeckpt.solve(_phase_decay, jnp.asarray(y0), (0.0, 2.0), solver=solver, rtol=1e-9,
                        atol=1e-10, max_steps=20000)  # fmt: skip
    np.testing.assert_allclose(sol.ys[-1], _phase_decay_exact(2.0, y0), rtol=1e-6)


@pytest.mark.parametrize("solver", slow_unless(NAMES, fast={"bdf"}))
def test_pytree_float32_and_vmap(solver):
    """A dict state in float32, a batch of rate constants under `vmap`: the dtype stays, and
    each lane equals its unbatched solve to within the tolerance (float32 rounding under
    `vmap` can move a discrete decision: a BDF order, a Jacobian refresh)."""
    k32 = _K.astype(jnp.float32)

    def final(k):
        y0 = {"fast": jnp.zeros(1, jnp.float32), "slow": jnp.array([1.0, 0.0], jnp.float32)}

        def f(t, y, k):
            dy = robertson(t, jnp.stack([y["slow"][0], y["fast"][0], y["slow"][1]]), k)
            return {"fast": dy[1:2], "slow": jnp.stack([dy[0], dy[2]])}

        sol = odeckpt.solve(f, y0, (0.0, 40.0), args=k, solver=solver, rtol=1e-4, atol=1e-7)
        return sol.ys["slow"][-1], sol.ys["fast"][-1]

    batch = jax.jit(jax.vmap(final))(jnp.stack([k32, k32 * 1.5]))
    assert batch[0].dtype == jnp.float32
    alone = jax.jit(final)(k32 * 1.5)
    np.testing.assert_allclose(batch[0][1], alone[0], rtol=1e-3)
    np.testing.assert_allclose(batch[1][1], alone[1], rtol=1e-3)
    # Robertson at t = 40 (scipy Radau at 1e-12, analytic Jacobian): y1 = 0.7158.
    np.testing.assert_allclose(batch[0][0][0], 0.7158270687, rtol=1e-3)


# ---------------------------------------------- the contract: a stepper's own step-size rule


class _Proposing(odeckpt.AbstractStepper):
    """Explicit Euler with a constant error estimate `error`, proposing the ratio `factor` of
    step sizes (`Step.dt_factor`)."""

    error: float
    factor: float

    name: ClassVar[str] = "proposing"
    order: ClassVar[int] = 1
    error_order: ClassVar[int | None] = 1
    fn_evals_per_step: ClassVar[int] = 1
    dense_degree: ClassVar[int] = 1
    implicit: ClassVar[bool] = False
    multistep: ClassVar[bool] = False

    def init(self, f, t0, y0, args):
        return f(t0, y0, args)

    def step(self, f, t0, t1, y0, args, state):
        y1 = y0 + (t1 - t0) * state
        return Step(
            y1=y1, y_error=jnp.full_like(y1, self.error), dense=jnp.stack([y0, y1 - y0]),
            state=f(t1, y1, args), dt_factor=jnp.asarray(self.factor),
        )  # fmt: skip


def test_controller_follows_a_proposed_step_size_ratio():
    solve = lambda stepper, **kw: odeckpt.solve(
        lambda t, y, a: -y, jnp.ones(1), (1.0, 2.0), solver=stepper, dt0=0.01, max_steps=200,
        saveat=odeckpt.SaveAt(steps=True), throw=False, **kw,
    )  # fmt: skip
    sol = solve(_Proposing(error=0.0, factor=1.5))
    ts = np.concatenate([[1.0], np.asarray(sol.ts)[: int(sol.stats.num_accepted_steps)]])
    sizes = np.diff(ts)[:-1]  # the last step lands on t1
    np.testing.assert_allclose(sizes[1:] / sizes[:-1], 1.5, rtol=1e-9)
    # Within the controller's bounds: at most `factormax`.
    sol = solve(_Proposing(error=0.0, factor=50.0))
    ts = np.concatenate([[1.0], np.asarray(sol.ts)[:2]])
    assert ts[2] - ts[1] == pytest.approx(10 * (ts[1] - ts[0]), rel=1e-9)
    # A rejected step shrinks at least as the PID rule says, whatever the proposal: here the
    # steps keep failing until they underflow, never repeating one size until `max_steps`.
    sol = solve(_Proposing(error=1e3, factor=2.0))
    assert sol.status == odeckpt.Status.dt_underflow and sol.stats.num_steps < 40


# ------------------------------------------------------------------- memory per snapshot


def _reals(tree) -> int:
    """Real numbers in the inexact arrays of `tree` that are not scalars (a complex number
    counts two)."""
    leaves = [x for x in jax.tree.leaves(tree) if x.ndim and jnp.issubdtype(x.dtype, jnp.inexact)]
    return sum(x.size * (2 if jnp.iscomplexobj(x) else 1) for x in leaves)


@pytest.mark.parametrize("n", [3, 10])
def test_stepper_state_is_what_the_docs_say(n):
    """What a checkpointing adjoint's snapshot holds of the stepper (beyond scalars and the
    integer pivots): Radau5 `4 n^2 + 4 n` real numbers, BDF `2 n^2 + 9 n`."""
    f = lambda t, y, args: -y
    y0 = jnp.ones(n)
    radau = jax.eval_shape(lambda: odeckpt.Radau5().init(f, 0.0, y0, None))
    bdf = jax.eval_shape(lambda: odeckpt.BDF().init(f, 0.0, y0, None))
    assert _reals(radau) == 4 * n**2 + 4 * n
    assert _reals(bdf) == 2 * n**2 + 9 * n
    # Newton-Krylov keeps no matrices.
    krylov = jax.eval_shape(
        lambda: odeckpt.BDF(newton=odeckpt.NewtonKrylov()).init(f, 0.0, y0, None)
    )
    assert _reals(krylov) == 9 * n


# ------------------------------------------------------------- tolerance proportionality


def test_effective_tolerances():
    assert effective_tolerances(1e-6, 1e-8, 1.0, "float64") == (1e-6, 1e-8)
    rtol, atol = effective_tolerances(1e-7, 1e-9, 1.25, "float64")
    assert rtol == pytest.approx(1e-3 * 1e-4**1.25) and atol / rtol == pytest.approx(1e-2)
    # Never tighter than 1000 eps (unless the solve asks for it), nor looser than asked.
    assert effective_tolerances(1e-12, 1e-12, 2.0, "float64")[0] == pytest.approx(2.2e-13, 1e-2)
    assert effective_tolerances(1e-5, 1e-5, 1.25, "float32") == (1e-5, 1e-5)


_PROBLEMS = {"rober": ROBER, "vdpol": VDPOL}
_ATOL_PER_RTOL = {"rober": 1e-4, "vdpol": 1.0}


def _achieved_error(name: str, problem: str, rtol: float) -> float:
    """The relative error at t1 against the test set's reference (max over components)."""
    p = _PROBLEMS[problem]
    sol = odeckpt.solve(
        p["f"], jnp.asarray(p["y0"]), (0.0, p["t1"]), args=jnp.asarray(p["args"]), solver=name,
        rtol=rtol, atol=_ATOL_PER_RTOL[problem] * rtol, max_steps=100_000, adjoint="forward",
    )  # fmt: skip
    return _relative_error(sol.ys[-1], TEST_SET_REFERENCES[problem])


_PROPORTIONAL = [
    *[(name, problem) for name in ("radau", "bdf", "rodas5", "kvaerno5", "kvaerno4", "kvaerno3")
      for problem in ("rober", "vdpol")],
    ("implicit_euler", "vdpol"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, problem",
    slow_unless(_PROPORTIONAL, fast={("radau", "vdpol")}),
)  # fmt: skip
def test_error_falls_about_a_decade_per_decade_of_rtol(name, problem):
    """Every stiff stepper on Robertson (t1 = 1e11, atol = 1e-4 rtol) and Van der Pol (mu =
    1000, atol = rtol): the error at t1 against rtol has a slope between 0.7 and 1.5 on a
    log-log fit over three or four decades (`AbstractStepper.tolerance_exponent` makes it so;
    the slopes and constants are in docs/guide.md). The trapezoidal rule is not L-stable and
    fails on Robertson; implicit Euler, first order, is checked where it takes few steps."""
    rtols = (1e-3, 3e-4, 1e-4) if name == "implicit_euler" else (1e-5, 1e-6, 1e-7, 1e-8)
    if (name, problem) == ("radau", "vdpol"):
        rtols = rtols[1:]  # the fast one of these tests
    errors = [_achieved_error(name, problem, rtol) for rtol in rtols]
    fitted = slope(rtols, errors)
    print(f"{name} {problem}: slope {fitted:.2f}, errors {errors}")
    assert 0.7 <= fitted <= 1.5, (fitted, errors)
