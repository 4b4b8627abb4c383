"""Explicit Runge-Kutta steppers: tableaux, convergence orders, error estimates, dense output."""

from typing import ClassVar

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from selection import slow_unless

from odeckpt._steppers import (
    RK4,
    STEPPERS,
    AbstractExplicitRK,
    AbstractStepper,
    Bosh3,
    ButcherTableau,
    Dopri5,
    Dopri8,
    Euler,
    Heun,
    Midpoint,
    Ralston,
    Tsit5,
    stepper_from_name,
)
from odeckpt._steppers._fence import FENCE_MIN_SIZE, fence

# name: (class, order, error_order, fn_evals_per_step, dense_degree), written out from the
# methods' definitions rather than read back from the classes.
EXPECTED = {
    "euler": (Euler, 1, None, 1, 3),
    "heun": (Heun, 2, 1, 2, 3),
    "midpoint": (Midpoint, 2, None, 2, 3),
    "ralston": (Ralston, 2, None, 2, 3),
    "rk4": (RK4, 4, None, 4, 3),
    "bosh3": (Bosh3, 3, 2, 3, 3),
    "tsit5": (Tsit5, 5, 4, 6, 4),
    "dopri5": (Dopri5, 5, 4, 6, 4),
    "dopri8": (Dopri8, 8, 5, 12, 3),
}
NAMES = list(EXPECTED)
WITH_ERROR = [name for name in NAMES if EXPECTED[name][2] is not None]

# Step counts over [0, 1] for the global-order fits: asymptotic, yet well above rounding.
NUM_STEPS = {
    "euler": (64, 128, 256, 512, 1024),
    "heun": (16, 32, 64, 128, 256),
    "midpoint": (16, 32, 64, 128, 256),
    "ralston": (16, 32, 64, 128, 256),
    "rk4": (8, 16, 32, 64, 128),
    "bosh3": (16, 32, 64, 128, 256),
    "tsit5": (24, 32, 40, 48, 64),
    "dopri5": (24, 32, 40, 48, 64),
    "dopri8": (6, 7, 8, 10, 12),
}
# Single-step sizes for the local-error, error-estimate and dense-output fits.
STEP_SIZES = {
    "euler": np.geomspace(1e-3, 1e-2, 5),
    "heun": np.geomspace(1e-3, 1e-2, 5),
    "midpoint": np.geomspace(1e-3, 1e-2, 5),
    "ralston": np.geomspace(1e-3, 1e-2, 5),
    "rk4": np.geomspace(5e-3, 5e-2, 5),
    "bosh3": np.geomspace(5e-3, 5e-2, 5),
    "tsit5": np.geomspace(1e-2, 5e-2, 5),
    "dopri5": np.geomspace(1e-2, 5e-2, 5),
    "dopri8": np.geomspace(2e-2, 1e-1, 5),
}


# A nonlinear, non-autonomous problem with a known solution (manufactured): y' = g(y) + s(t)
# with g(y) = 0.3 (sin y_2, -y_1 y_2) and s(t) chosen so that y(t) = (exp(sin 2t), cos^2 t).
# The 5(4) pairs have very small principal error coefficients, so on many problems their
# observed order exceeds 5 until errors near 1e-12; on this one every method reaches its
# asymptotic rate at errors well above rounding, in both directions. Its nonlinearity is strong
# enough that breaking one stage coefficient drops Tsit5 to order 2 (see
# `test_order_test_detects_a_broken_tableau`).
def _g(y):
    return 0.3 * jnp.stack([jnp.sin(y[1]), -y[0] * y[1]])


def exact(t):
    return jnp.stack([jnp.exp(jnp.sin(2 * t)), jnp.cos(t) ** 2])


def vector_field(t, y, args):
    exact_derivative = jnp.stack([2 * jnp.cos(2 * t) * jnp.exp(jnp.sin(2 * t)), -jnp.sin(2 * t)])
    return _g(y) + exact_derivative - _g(exact(t))


def slope(hs, errors):
    return np.polyfit(np.log(np.asarray(hs)), np.log(np.asarray(errors)), 1)[0]


def evaluate_dense(dense, theta):
    powers = theta ** jnp.arange(dense.shape[0], dtype=dense.dtype)
    return jnp.tensordot(powers, dense, axes=1)


def fixed_step_solve(stepper, f, t0, t1, y0, num_steps):
    """`y(t1)` for each of `num_steps` equal steps: one `lax.scan`, vmapped over the counts
    (lanes with fewer steps stop updating once they reach `t1`)."""
    length = max(num_steps)

    def solve(n):
        def body(carry, k):
            y, state = carry
            ta = t0 + (t1 - t0) * (jnp.minimum(k, n) / n)
            tb = t0 + (t1 - t0) * (jnp.minimum(k + 1, n) / n)
            step = stepper.step(f, ta, tb, y, None, state)
            keep = lambda new, old: jnp.where(k < n, new, old)
            return (jax.tree.map(keep, step.y1, y), jax.tree.map(keep, step.state, state)), None

        init = (y0, stepper.init(f, t0, y0, None))
        (y1, _), _ = jax.lax.scan(body, init, jnp.arange(length))
        return y1

    return jax.jit(jax.vmap(solve))(jnp.asarray(num_steps))


@jax.jit
def _single_steps(stepper, t0, hs):
    """One step from the exact solution at `t0` for each size in `hs`."""

    def one(h):
        y0 = exact(t0)
        return stepper.step(vector_field, t0, t0 + h, y0, None, vector_field(t0, y0, None))

    return jax.vmap(one)(hs)


# ---------------------------------------------------------------------------- tableau, registry


def test_tableau_accepts_and_derives():
    tableau = Dopri5.tableau
    assert tableau.fsal and tableau.num_stages == 7 and tableau.dense_degree == 4
    assert not RK4.tableau.fsal and RK4.tableau.dense_weights.shape == (3, 5)
    with pytest.raises(ValueError):
        tableau.a[1, 0] = 0.0  # frozen data


_GOOD = dict(a=[[0.0, 0.0], [0.5, 0.0]], b=[0.0, 1.0], c=[0.0, 0.5])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(a=[[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]), "Shapes must be"),
        (dict(c=[0.0, 0.5, 1.0]), "Shapes must be"),
        (dict(a=[0.0, 0.5]), "must be a 2-d array"),
        (dict(a=[[0.0, 0.0], [0.5, 0.0]], b=[[0.0, 1.0]]), "must be a 1-d array"),
        (dict(a=[[0.0, 0.1], [0.5, 0.0]], c=[0.1, 0.5]), "strictly lower triangular"),
        (dict(a=[[0.1, 0.0], [0.5, 0.0]], c=[0.1, 0.5]), "strictly lower triangular"),
        (dict(c=[0.0, 0.6]), r"c_i must equal sum_j a_ij; violated at rows \[1\]"),
        (dict(b=[0.1, 1.0]), r"sum\(b\) must equal 1"),
        (dict(b=[0.0, float("nan")]), "must be finite"),
        (dict(b_error=[0.5, -0.4]), r"sum\(b_error\) must equal 0"),
        (dict(b_error=[0.5, -0.5, 0.0]), "`b_error` must have shape"),
        (dict(b_dense=[[0.0, 1.0], [0.0, 0.1]]), "summed over powers must equal `b`"),
        (dict(b_dense=[[0.0, 1.0, 0.0]]), "`b_dense` must have shape"),
        (dict(a=np.zeros((0, 0)), b=[], c=[]), "at least one stage"),
    ],
)
def test_tableau_rejects_bad_data(change, message):
    ButcherTableau(**_GOOD)
    with pytest.raises(ValueError, match=message):
        ButcherTableau(**{**_GOOD, **change})


def test_tableau_tolerance_is_tight():
    ButcherTableau(**{**_GOOD, "c": [0.0, 0.5 + 1e-14]})
    with pytest.raises(ValueError, match="c_i must equal"):
        ButcherTableau(**{**_GOOD, "c": [0.0, 0.5 + 1e-10]})


def test_registry_and_class_attributes():
    # The implicit steppers are checked in test_implicit.py.
    assert {n for n, c in STEPPERS.items() if issubclass(c, AbstractExplicitRK)} == set(EXPECTED)
    for name, (cls, order, error_order, fn_evals, degree) in EXPECTED.items():
        assert STEPPERS[name] is cls and cls.name == name
        assert issubclass(cls, AbstractStepper)
        assert (cls.order, cls.error_order) == (order, error_order)
        assert (cls.fn_evals_per_step, cls.dense_degree) == (fn_evals, degree)
        assert (cls.tableau.b_error is None) == (error_order is None)
        assert cls.tableau.fsal == (name in ("bosh3", "tsit5", "dopri5"))
    assert isinstance(stepper_from_name("TSIT5"), Tsit5)
    assert isinstance(stepper_from_name("Dopri8"), Dopri8)


def test_unknown_name_lists_valid_names():
    listed = ", ".join(sorted(STEPPERS))
    with pytest.raises(ValueError, match=f"Unknown stepper 'rk45'; valid names are: {listed}"):
        stepper_from_name("rk45")


@pytest.mark.parametrize("name", NAMES)
def test_evaluations_per_step(name):
    calls = []

    def f(t, y, args):
        calls.append(t)
        return -y

    stepper = STEPPERS[name]()
    y0 = jnp.ones(3)
    state = jax.eval_shape(lambda: stepper.init(f, 0.0, y0, None))
    assert len(calls) == 1
    calls.clear()
    jax.eval_shape(lambda s: stepper.step(f, 0.0, 0.1, y0, None, s), state)
    assert len(calls) == EXPECTED[name][3]


# ---------------------------------------------------------------------------- orders


# Every tableau's order is checked step by step below (test_local_error_order, all but
# Dopri8); globally, by default, the classic fourth-order method, the default Tsit5 and Dopri8.
@pytest.mark.parametrize("name", slow_unless(NAMES, fast={"rk4", "tsit5", "dopri8"}))
@pytest.mark.parametrize("backwards", [False, True], ids=["forwards", "backwards"])
def test_global_convergence_order(name, backwards):
    stepper = STEPPERS[name]()
    t0, t1 = (1.0, 0.0) if backwards else (0.0, 1.0)
    num_steps = NUM_STEPS[name]
    y1 = fixed_step_solve(stepper, vector_field, t0, t1, exact(t0), num_steps)
    errors = jnp.linalg.norm(y1 - exact(t1)[None], axis=-1)
    assert np.all(errors > 1e-13), errors  # not at rounding error
    assert slope(1 / np.asarray(num_steps), errors) == pytest.approx(stepper.order, abs=0.2)


# Dopri8's local error (h^9) drops below rounding before it is asymptotic; its order is
# checked globally above.
@pytest.mark.parametrize("name", [name for name in NAMES if name != "dopri8"])
def test_local_error_order(name):
    stepper = STEPPERS[name]()
    hs = STEP_SIZES[name]
    step = _single_steps(stepper, 0.3, hs)
    local = jnp.linalg.norm(step.y1 - jax.vmap(exact)(0.3 + hs), axis=-1)
    assert slope(hs, local) == pytest.approx(stepper.order + 1, abs=0.3)


@pytest.mark.parametrize("name", WITH_ERROR)
def test_error_estimate_order(name):
    stepper = STEPPERS[name]()
    hs = STEP_SIZES[name]
    step = _single_steps(stepper, 0.3, hs)
    local = jnp.linalg.norm(step.y1 - jax.vmap(exact)(0.3 + hs), axis=-1)
    estimate = jnp.linalg.norm(step.y_error, axis=-1)
    assert slope(hs, estimate) == pytest.approx(stepper.error_order + 1, abs=0.3)
    # The estimate is the lower-order method's local error, which dominates y1's own.
    assert np.all(estimate > 3 * local)


def _broken_tsit5_stages():
    a = Tsit5.tableau.a.copy()
    a[2, 1] += 1e-3
    a[2, 0] -= 1e-3  # keeps c_3 = a_31 + a_32
    return a


class _BrokenTsit5(AbstractExplicitRK):
    """Tsit5 with one stage coefficient moved by 1e-3: consistent, but only second order."""

    tableau: ClassVar[ButcherTableau] = ButcherTableau(
        a=_broken_tsit5_stages(), b=Tsit5.tableau.b, c=Tsit5.tableau.c
    )
    name: ClassVar[str] = "broken_tsit5"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = None
    fn_evals_per_step: ClassVar[int] = 6
    dense_degree: ClassVar[int] = 3


def test_order_test_detects_a_broken_tableau():
    num_steps = NUM_STEPS["tsit5"]
    y1 = fixed_step_solve(_BrokenTsit5(), vector_field, 0.0, 1.0, exact(0.0), num_steps)
    errors = jnp.linalg.norm(y1 - exact(1.0)[None], axis=-1)
    assert slope(1 / np.asarray(num_steps), errors) < 2.5


# ---------------------------------------------------------------------------- dense output


@pytest.mark.parametrize("name", NAMES)
def test_dense_endpoints_and_derivatives(name):
    stepper = STEPPERS[name]()
    t0, t1 = 0.3, 0.45
    y0 = exact(t0)
    step = stepper.step(vector_field, t0, t1, y0, None, vector_field(t0, y0, None))
    assert (step.y_error is None) == (stepper.error_order is None)
    dense = step.dense
    assert dense.shape == (stepper.dense_degree + 1, 2)
    assert jnp.array_equal(evaluate_dense(dense, 0.0), y0)
    np.testing.assert_allclose(evaluate_dense(dense, 1.0), step.y1, rtol=1e-15, atol=1e-15)
    # C^1 across steps: d/dtheta at 0 and 1 equals h f(t0, y0) and h f(t1, y1).
    powers = jnp.arange(1.0, dense.shape[0])
    derivative = lambda theta: jnp.tensordot(powers * theta ** (powers - 1.0), dense[1:], axes=1)
    h = t1 - t0
    np.testing.assert_allclose(derivative(0.0), h * vector_field(t0, y0, None), rtol=1e-14)
    np.testing.assert_allclose(derivative(1.0), h * step.state, rtol=1e-13)
    np.testing.assert_allclose(step.state, vector_field(t1, step.y1, None), rtol=1e-15)


@pytest.mark.parametrize("name", NAMES)
def test_dense_mid_step_order(name):
    stepper = STEPPERS[name]()
    # Native extensions (Tsit5, Dopri5) are fourth order: local error h^5. The cubic Hermite
    # interpolant has local error h^4, or that of y1 (h^{order+1}) if larger.
    expected = 5 if name in ("tsit5", "dopri5") else min(stepper.order + 1, 4)
    t0 = 0.3
    hs = STEP_SIZES[name]
    step = _single_steps(stepper, t0, hs)
    mid = jax.vmap(evaluate_dense, in_axes=(0, None))(step.dense, 0.5)
    errors = jnp.linalg.norm(mid - jax.vmap(exact)(t0 + hs / 2), axis=-1)
    assert slope(hs, errors) == pytest.approx(expected, abs=0.3)


_DIFFRAX = {
    "euler": diffrax.Euler,
    "heun": diffrax.Heun,
    "midpoint": diffrax.Midpoint,
    "ralston": diffrax.Ralston,
    "bosh3": diffrax.Bosh3,
    "tsit5": diffrax.Tsit5,
    "dopri5": diffrax.Dopri5,
}


@pytest.mark.parametrize("name", slow_unless(list(_DIFFRAX), fast={"dopri5"}))
def test_matches_diffrax_step(name):
    """Same tableau, same step: y1 agrees; for the pairs so does |y_error| (diffrax's sign
    convention varies between its solvers); for Tsit5 and Dopri5 the native dense output agrees
    with diffrax's interpolation (an independent implementation of the same polynomials)."""
    stepper = STEPPERS[name]()
    t0, t1 = 0.2, 0.5
    y0 = exact(t0)
    ours = stepper.step(vector_field, t0, t1, y0, None, vector_field(t0, y0, None))
    solution = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        _DIFFRAX[name](),
        t0,
        t1,
        dt0=t1 - t0,
        y0=y0,
        stepsize_controller=diffrax.ConstantStepSize(),
        saveat=diffrax.SaveAt(t1=True, dense=True),
    )
    np.testing.assert_allclose(ours.y1, solution.ys[-1], rtol=1e-14, atol=1e-15)
    if name in ("tsit5", "dopri5"):
        thetas = jnp.linspace(0.0, 1.0, 7)
        theirs = jax.vmap(solution.evaluate)(t0 + (t1 - t0) * thetas)
        mine = jax.vmap(evaluate_dense, in_axes=(None, 0))(ours.dense, thetas)
        np.testing.assert_allclose(mine, theirs, rtol=1e-13, atol=1e-14)
    if ours.y_error is not None:
        solver = _DIFFRAX[name]()
        term = diffrax.ODETerm(vector_field)
        solver_state = solver.init(term, t0, t1, y0, None)
        _, their_error, _, _, _ = solver.step(term, t0, t1, y0, None, solver_state, False)
        if name == "dopri5":
            # Dormand & Prince (1980) publish b_hat with b_hat_7 = 1/40 (as in HNW's DOPRI5 and
            # MATLAB's ode45); diffrax uses another member of the same embedded family
            # (b_hat_7 = 1/60) whose error weights are exactly 2/3 of the published ones.
            their_error = 1.5 * their_error
        np.testing.assert_allclose(jnp.abs(ours.y_error), jnp.abs(their_error), rtol=1e-10)


# ---------------------------------------------------------------------------- states


def _decoupled_field(t, y, args):
    # Time may be float64 while the state is float32: cast, as a vector field must return y's
    # dtypes.
    a, b = y["a"], y["b"]
    return {"a": -jnp.asarray(1 + t, a.dtype) * a, "b": jnp.cos(t).astype(b.dtype) * b - b**2}


@pytest.mark.parametrize("name", NAMES)
def test_pytree_state_matches_flat_state(name):
    stepper = STEPPERS[name]()
    y0 = {"a": jnp.array([1.0, -0.5, 2.0]), "b": jnp.array([[0.3, 0.1], [0.2, 0.4]])}
    flat0, unravel = ravel_pytree(y0)
    flat_field = lambda t, v, args: ravel_pytree(_decoupled_field(t, unravel(v), args))[0]
    t0, t1 = 0.1, -0.15  # backwards, for good measure

    tree = stepper.step(_decoupled_field, t0, t1, y0, None, _decoupled_field(t0, y0, None))
    flat = stepper.step(flat_field, t0, t1, flat0, None, flat_field(t0, flat0, None))

    assert jax.tree.structure(tree.y1) == jax.tree.structure(y0)
    assert jax.tree.structure(tree.state) == jax.tree.structure(y0)
    assert tree.dense["b"].shape == (stepper.dense_degree + 1, 2, 2)
    rtol = 1e-14
    np.testing.assert_allclose(ravel_pytree(tree.y1)[0], flat.y1, rtol=rtol)
    np.testing.assert_allclose(ravel_pytree(tree.state)[0], flat.state, rtol=rtol)
    dense = jax.vmap(lambda d: ravel_pytree(d)[0])(tree.dense)
    np.testing.assert_allclose(dense, flat.dense, rtol=rtol, atol=1e-16)
    if stepper.error_order is not None:
        np.testing.assert_allclose(ravel_pytree(tree.y_error)[0], flat.y_error, atol=1e-16)


@pytest.mark.parametrize("name", slow_unless(NAMES, fast={"rk4", "tsit5"}))
def test_float32_state_stays_float32(name):
    stepper = STEPPERS[name]()
    y0 = {"a": jnp.array([1.0, -0.5, 2.0], jnp.float32), "b": jnp.array([[0.3]], jnp.float32)}
    t0, t1 = jnp.float64(0.1), jnp.float64(0.2)  # time in float64, state in float32
    step = jax.jit(stepper.step, static_argnums=0)(
        _decoupled_field, t0, t1, y0, None, _decoupled_field(t0, y0, None)
    )
    for part in (step.y1, step.y_error, step.dense, step.state):
        for leaf in jax.tree.leaves(part):
            assert leaf.dtype == jnp.float32
    y0_64 = jax.tree.map(lambda x: x.astype(jnp.float64), y0)
    reference = stepper.step(
        _decoupled_field, t0, t1, y0_64, None, _decoupled_field(t0, y0_64, None)
    )
    np.testing.assert_allclose(ravel_pytree(step.y1)[0], ravel_pytree(reference.y1)[0], rtol=1e-6)


@pytest.mark.parametrize("name", slow_unless(NAMES, fast={"rk4", "tsit5"}))
@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.complex128])
def test_complex_state(name, dtype):
    """y' = (i - 1/2) y, exact solution exp((i - 1/2) t): the right dtype and the local error
    order of the method."""
    stepper = STEPPERS[name]()
    rate = jnp.asarray(1j - 0.5, dtype)
    f = lambda t, y, args: rate * y
    y0 = jnp.array([1.0 + 0.5j, -0.25j], dtype)
    hs = np.array([0.05, 0.1]) if stepper.order < 8 else np.array([0.2, 0.4])

    @jax.jit
    def one(h):
        return stepper.step(f, 0.0, h, y0, None, f(0.0, y0, None))

    steps = [one(h) for h in hs]
    for step in steps:
        for part in (step.y1, step.y_error, step.dense, step.state):
            if part is not None:
                assert part.dtype == dtype
    if dtype == jnp.complex128:
        exact_y1 = [y0 * jnp.exp(rate * float(h)) for h in hs]
        errors = [jnp.linalg.norm(s.y1 - y) for s, y in zip(steps, exact_y1, strict=True)]
        assert slope(hs, errors) == pytest.approx(stepper.order + 1, abs=0.3)


def _count_conditionals(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text().count(" conditional(")


def test_fence_is_the_identity_for_every_transformation():
    """`fence` returns its input bit for bit (also down the NaN-time branch), passes tangents
    and cotangents through unchanged, and under `vmap` keeps each lane."""
    y = jnp.linspace(-1.0, 1.0, FENCE_MIN_SIZE).reshape(32, -1) ** 3
    for t in (jnp.float64(0.5), jnp.float64(jnp.nan)):
        out = jax.jit(fence)(t, y)
        assert out.dtype == y.dtype and jnp.array_equal(out, y)
    dy = jnp.cos(y)
    _, tangent = jax.jvp(lambda y: fence(jnp.float64(0.5), y), (y,), (dy,))
    _, pullback = jax.vjp(lambda y: fence(jnp.float64(0.5), y), y)
    assert jnp.array_equal(tangent, dy) and jnp.array_equal(pullback(dy)[0], dy)
    ys = jnp.stack([y, 2 * y])
    assert jnp.array_equal(jax.vmap(fence)(jnp.array([0.1, 0.2]), ys), ys)
    assert jnp.array_equal(jax.vmap(fence, (None, 0))(jnp.float64(0.1), ys), ys)
    second = jax.jacfwd(jax.grad(lambda a: jnp.sum(fence(a, a * y) ** 2)))(jnp.float64(0.5))
    assert second == pytest.approx(2 * float(jnp.sum(y**2)), rel=1e-12)


def test_fence_materialises_large_leaves_only():
    """A leaf of `FENCE_MIN_SIZE` elements or more goes through one `cond` (the fusion
    boundary), a smaller leaf through none; so do the tangent of the linearised step and the
    cotangent of its transpose. A batched leaf is not fenced."""
    t = jnp.float64(0.3)  # an argument: a constant time is folded, and the fence with it
    large, small = jnp.ones(FENCE_MIN_SIZE), jnp.ones(FENCE_MIN_SIZE - 1)
    twice = lambda t, y: fence(t, y) * 2
    assert _count_conditionals(twice, t, large) == 1
    assert _count_conditionals(twice, t, small) == 0
    assert _count_conditionals(lambda y: twice(0.3, y), large) == 0
    pullback = lambda t, y, ct: jax.vjp(lambda y: fence(t, y), y)[1](ct)[0]
    jaxpr = jax.make_jaxpr(pullback)(t, large, large).jaxpr
    ct = jaxpr.invars[2]
    assert any(e.primitive.name == "cond" and ct in e.invars for e in jaxpr.eqns)
    assert _count_conditionals(jax.vmap(twice, (None, 0)), t, jnp.ones((2, 4096))) == 0


@pytest.mark.parametrize("name", slow_unless(["rk4", "tsit5", "dopri8"], fast={"rk4", "tsit5"}))
def test_stage_states_of_a_large_state_are_fenced(name):
    """Every stage state and `y1` of an explicit step on a large state reaches `f` through a
    fence (the fix for stencil vector fields: `benchmarks/bench_gradients.py`, problem (c)),
    and equals the unfenced step: the same rows stepped under `vmap`, which skips the fence."""
    stepper = STEPPERS[name]()
    f = lambda t, y, a: a * (jnp.roll(y, 1) - 2 * y + jnp.roll(y, -1)) - jnp.tanh(y)
    y0 = jnp.sin(jnp.linspace(0.0, 2 * np.pi, 4 * FENCE_MIN_SIZE))
    step = lambda t0, y0: stepper.step(f, t0, t0 + 1e-3, y0, 0.5, f(t0, y0, 0.5)).state
    assert _count_conditionals(step, 0.0, y0) == stepper.fn_evals_per_step
    rows = y0.reshape(-1, 8)  # 512 independent periodic problems of 8 points
    small = jax.vmap(lambda r: stepper.step(f, 0.0, 1e-3, r, 0.5, f(0.0, r, 0.5)).y1)(rows)
    f_rows = lambda t, y, a: a * (jnp.roll(y, 1, 1) - 2 * y + jnp.roll(y, -1, 1)) - jnp.tanh(y)
    large = stepper.step(f_rows, 0.0, 1e-3, rows, 0.5, f_rows(0.0, rows, 0.5)).y1
    np.testing.assert_allclose(large, small, rtol=1e-14, atol=1e-15)
