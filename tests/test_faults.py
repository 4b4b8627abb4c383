"""Fault injection: every run-time failure ends in an exception, a failed status or a NaN
gradient, never in a successful non-finite result or a finite gradient of a failed solve.

Faults (NaN, inf, -inf) are injected into the vector field after a random time, into `args` and
into `y0`, for every stepper and every adjoint, under `jit` and `vmap` (one compiled function per
stepper and adjoint evaluates a whole batch of faulty lanes beside a healthy one, whose gradient
must stay exact). Save times at the ends of the span and repeated ones, with a state holding a
real and a complex leaf, and zero-length spans inside batches are checked against closed
forms.

The default run (about a minute of test time on two cores) takes one or two representatives of
each kind of case: every adjoint with one stepper, explicit and implicit, and the save times,
zero-length spans and events with a few steppers and adjoints; `pytest -m slow` runs the whole
cross product.
"""

import itertools
import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from selection import slow_unless

import odeckpt
from odeckpt._steppers import STEPPERS
from odeckpt._steppers._implicit import AbstractImplicit
from odeckpt._steppers._rosenbrock import AbstractRosenbrock

# Every built-in stepper by name, and the reversible wrapper of one (a stepper object).
SOLVERS = {name: cls() for name, cls in STEPPERS.items()}
SOLVERS["reversible_tsit5"] = odeckpt.Reversible(odeckpt.Tsit5())
STEPPER_NAMES = sorted(SOLVERS)
REVERSE = ("direct", "recursive", "backsolve", "forward_sensitivity", "interpolating",
           "interpolating_resolved", "reversible")  # fmt: skip
ADJOINTS = (*REVERSE, "forward")
# How a case is compiled: by a plain `jax.jit` (failures raise through host callbacks inside the
# program) or by `odeckpt.jit` (as `checkify` checks, raised on the host after the call).
JITS = {"jax.jit": jax.jit, "odeckpt.jit": odeckpt.jit}


def _solver_for(adjoint: str):
    """The default stepper, or for `ReversibleAdjoint` (which undoes the steps of a reversible
    stepper only) the reversible Tsit5."""
    return SOLVERS["reversible_tsit5"] if adjoint == "reversible" else "tsit5"


def _adjoint(name: str, tol: float | None = 1e-10):
    """The adjoint called `name`; "interpolating_resolved" is `InterpolatingAdjoint` with
    tolerances `tol` of its own, which re-solves `y(t)` from `y0` at them."""
    if name == "interpolating_resolved":
        return odeckpt.InterpolatingAdjoint(rtol=tol, atol=tol)
    return name


T1 = 1.0
FAULTS = (np.nan, np.inf, -np.inf)


# The default run: every adjoint once, with explicit steppers of orders 1 to 5 with and
# without an error estimate, and an implicit one (Newton's failures under the staggered
# corrector); `-m slow` runs every stepper with every adjoint.
DEFAULT_PAIRS = {
    ("heun", "forward"), ("ralston", "direct"), ("bosh3", "recursive"),
    ("midpoint", "interpolating"), ("dopri5", "backsolve"), ("kvaerno5", "forward_sensitivity"),
    ("reversible_tsit5", "reversible"),
}  # fmt: skip


def _pairs(fast=DEFAULT_PAIRS, jit="jax.jit"):
    for name, adjoint in itertools.product(STEPPER_NAMES, ADJOINTS):
        if adjoint == "interpolating_resolved" and SOLVERS[name].error_order is None:
            continue  # the re-solve needs an adaptive stepper (a clear error otherwise)
        if adjoint == "reversible" and name != "reversible_tsit5":
            continue  # it undoes reversible steps only (a clear error otherwise)
        marks = () if (name, adjoint) in fast else (pytest.mark.slow,)
        yield pytest.param(name, adjoint, marks=marks, id=f"{name}-{adjoint}")


def _step_options(name: str) -> dict:
    """Constant steps for the steppers without an error estimate, adaptive for the others (at
    a tolerance the low-order ones reach in a few hundred steps)."""
    if SOLVERS[name].error_order is None:
        return dict(controller=odeckpt.ConstantStep(), dt0=T1 / 64)
    tol = 1e-6 if SOLVERS[name].order >= 3 else 1e-4
    return dict(rtol=tol, atol=tol)


def _accuracy(name: str, adjoint: str) -> float:
    """How close the healthy lanes' gradients come to the exact one. The continuous adjoints
    that read `y(t)` from forward re-solves (`InterpolatingAdjoint`; `BacksolveAdjoint` after
    an implicit stepper) are as accurate as the continuous extension, whose error is that of
    its degree when that is below the stepper's order (cubic ones: Dopri8 2e-4, Kvaerno4
    4e-4 here)."""
    stepper = SOLVERS[name]
    implicit = isinstance(stepper, AbstractImplicit | AbstractRosenbrock)
    reads_dense = adjoint.startswith("interpolating") or (adjoint == "backsolve" and implicit)
    if reads_dense and stepper.dense_degree < stepper.order:
        return 1e-3
    return {1: 0.1, 2: 1e-2}.get(stepper.order, 1e-4)


def faulty_field(t, y, p):
    """`-k y`, replaced by `value` (NaN or inf) after `t_fault`."""
    k, t_fault, value = p
    return jnp.where(t > t_fault, value, -k * y)


class Lanes:
    """A batch of cases: `y0`, the rate `k`, the time after which `f` returns `value`."""

    def __init__(self, rows):
        y0, k, t_fault, value = (np.array(column, float) for column in zip(*rows, strict=True))
        self.y0, self.k, self.t_fault, self.value = y0, k, t_fault, value

    @property
    def healthy(self) -> np.ndarray:
        return np.isfinite(self.y0) & np.isfinite(self.k) & (self.t_fault >= T1)


def _lanes_strategy():
    """Five faulty lanes (one fault each: in `f` from a random time, in `k`, or in `y0`) and
    a healthy one last."""
    fault = st.sampled_from(FAULTS)
    in_f = st.tuples(st.just(1.0), st.just(1.3), st.floats(0.0, 0.95), fault)
    in_k = st.tuples(st.just(1.0), fault, st.just(2.0), st.just(0.0))
    in_y0 = st.tuples(fault, st.just(1.3), st.just(2.0), st.just(0.0))
    one = st.one_of(in_f, in_k, in_y0)
    healthy = (0.7, 1.3, 2.0, 0.0)
    return st.lists(one, min_size=5, max_size=5).map(lambda rows: Lanes([*rows, healthy]))


_COMPILED = {}


def _batched(name: str, adjoint: str, jit: str = "jax.jit"):
    """`(status, ys, dloss/d(y0, k))` for a batch of lanes, compiled once per pair by `jit`."""
    key = (name, adjoint, jit)
    if key in _COMPILED:
        return _COMPILED[key]

    options = _step_options(name)
    # A re-solve at the forward solve's tolerance, within its `max_steps`.
    resolved = _adjoint(adjoint, options.get("rtol"))

    def solve(y0, k, t_fault, value):
        return odeckpt.solve(
            faulty_field, jnp.stack([y0]), (0.0, T1), (k, t_fault, value), solver=SOLVERS[name],
            adjoint=resolved, throw=False, max_steps=256, **options,
        )  # fmt: skip

    def loss(y0, k, t_fault, value):
        sol = solve(y0, k, t_fault, value)
        return jnp.sum(sol.ys**2), sol

    def lane(y0, k, t_fault, value):
        # The solution is the derivative's own primal solve: one solve is compiled, not two.
        derivative = jax.jacfwd if adjoint == "forward" else jax.grad
        d, sol = derivative(loss, argnums=(0, 1), has_aux=True)(y0, k, t_fault, value)
        ok = sol.status == odeckpt.Status.successful
        return ok, sol.ys, jnp.stack(d)

    _COMPILED[key] = JITS[jit](jax.vmap(lane))
    return _COMPILED[key]


@pytest.mark.parametrize("name, adjoint", _pairs())
@settings(max_examples=3, deadline=None)
@given(lanes=_lanes_strategy())
def test_faults_fail_loudly_per_lane(name, adjoint, lanes):
    _check_lanes(name, adjoint, lanes, "jax.jit")


# `odeckpt.jit` compiles another program (checks as `checkify` checks, no host callback): the
# same cases, with one pair (the checkpointing engine's adjoint) by default.
@pytest.mark.parametrize("name, adjoint", _pairs({("kvaerno5", "backsolve")}, "odeckpt.jit"))
@settings(max_examples=3, deadline=None)
@given(lanes=_lanes_strategy())
def test_faults_fail_loudly_per_lane_under_odeckpt_jit(name, adjoint, lanes):
    _check_lanes(name, adjoint, lanes, "odeckpt.jit")


def _check_lanes(name: str, adjoint: str, lanes: Lanes, jit: str):
    """Each faulty lane fails with a NaN gradient, and the healthy one keeps its own."""
    batched = _batched(name, adjoint, jit)
    ok, ys, grad = batched(lanes.y0, lanes.k, lanes.t_fault, lanes.value)
    ok, ys, grad = np.asarray(ok), np.asarray(ys), np.asarray(grad)
    for i in range(len(ok)):
        if ok[i]:
            assert np.all(np.isfinite(ys[i])), f"lane {i}: successful, non-finite result"
            assert lanes.healthy[i], f"lane {i}: a fault went unnoticed"
        else:
            assert np.all(np.isnan(grad[i])), f"lane {i}: failed, gradient {grad[i]}"
    # The healthy lane keeps its gradient: that of a batch of healthy lanes, which is the
    # derivative of y(1)^2 = y0^2 exp(-2k) to the accuracy of the stepper.
    healthy = Lanes([(lanes.y0[-1], lanes.k[-1], lanes.t_fault[-1], 0.0)] * len(ok))
    ok_alone, _, alone = batched(healthy.y0, healthy.k, healthy.t_fault, healthy.value)
    assert ok[-1] and np.all(ok_alone)
    np.testing.assert_allclose(grad[-1], alone[0], rtol=1e-10)
    y0, k = healthy.y0[0], healthy.k[0]
    exact = [2 * y0 * np.exp(-2 * k), -2 * y0**2 * np.exp(-2 * k)]
    np.testing.assert_allclose(alone[0], exact, rtol=_accuracy(name, adjoint))


@pytest.mark.parametrize(
    "name",
    [
        n if n in ("tsit5", "rodas5") else pytest.param(n, marks=pytest.mark.slow)
        for n in STEPPER_NAMES
    ],
)
def test_throw_raises_for_a_failing_lane(name):
    def final(k):
        sol = odeckpt.solve(
            faulty_field, jnp.ones(1), (0.0, T1), (k, 0.5, jnp.nan), solver=SOLVERS[name],
            max_steps=256, **_step_options(name),
        )  # fmt: skip
        return sol.ys

    with pytest.raises(Exception, match="non-finite|Newton"):
        jax.block_until_ready(jax.jit(jax.vmap(final))(jnp.array([1.0, 2.0])))


# A faulty lane `(y0, k, t_fault, value)` and the status its solve ends with.
_LANE_FAULTS = {
    "f": ((1.0, 1.3, 0.5, np.nan), odeckpt.Status.nonfinite),
    "f-inf": ((1.0, 1.3, 0.3, -np.inf), odeckpt.Status.nonfinite),
    "args": ((1.0, np.inf, 2.0, 0.0), odeckpt.Status.nonfinite_f0),
    "y0": ((np.nan, 1.3, 2.0, 0.0), odeckpt.Status.nonfinite_y0),
}


def _throwing_loss(y0, k, t_fault, value):
    sol = odeckpt.solve(faulty_field, jnp.stack([y0]), (0.0, T1), (k, t_fault, value),
                        rtol=1e-8, atol=1e-8)  # fmt: skip
    return jnp.sum(sol.ys**2)


# Module-level, so that every fault reuses the compiled programs.
_THROWING = {
    "solve": odeckpt.jit(jax.vmap(_throwing_loss)),
    "grad": odeckpt.jit(jax.vmap(jax.grad(_throwing_loss, argnums=(0, 1)))),
}


@pytest.mark.parametrize("fault", slow_unless(list(_LANE_FAULTS), fast={"f"}))
def test_odeckpt_jit_raises_a_failing_lanes_status_after_the_call(fault):
    """`throw=True` under `odeckpt.jit`: one faulty lane beside a healthy one makes the call
    raise its status's message, naming the lane, from the solve and from its gradient (whose
    checks XLA keeps); the same program on healthy lanes returns the exact gradient."""
    row, status = _LANE_FAULTS[fault]
    lanes = Lanes([row, (0.7, 1.3, 2.0, 0.0)])
    for program in _THROWING.values():
        with pytest.raises(eqx.EquinoxRuntimeError) as raised:
            program(lanes.y0, lanes.k, lanes.t_fault, lanes.value)
        message = str(raised.value)
        assert message.startswith("Lane 0 of 2 failed: " + status.message)  # then the call's line
    healthy = Lanes([(0.7, 1.3, 2.0, 0.0), (1.5, 0.4, 2.0, 0.0)])
    d_y0, d_k = _THROWING["grad"](healthy.y0, healthy.k, healthy.t_fault, healthy.value)
    decay = np.exp(-2 * healthy.k)
    np.testing.assert_allclose(d_y0, 2 * healthy.y0 * decay, rtol=1e-6)
    np.testing.assert_allclose(d_k, -2 * healthy.y0**2 * decay, rtol=1e-6)


@pytest.mark.parametrize("compile_", [jax.jit, odeckpt.jit], ids=["jax.jit", "odeckpt.jit"])
def test_the_message_names_the_first_failing_lane_of_nested_vmaps(compile_):
    """Lanes (1, 0) and (1, 2) of a 2 x 3 batch have a NaN rate: the error names lane 3 of 6
    (row-major, outermost `vmap` first), from the solve and from its gradient (under `jax.jit`
    too: the check is an effect that XLA keeps although the gradient does not read it); the
    healthy batch's gradient (backsolve, whose backward pass has checks of its own) is exact."""
    k = np.ones((2, 3))
    k[1, 0] = k[1, 2] = np.nan
    decay = lambda t, y, k: -k * y
    solve = lambda k, adjoint="recursive": odeckpt.solve(
        decay, jnp.ones(1), (0.0, 1.0), k, adjoint=adjoint, rtol=1e-10, atol=1e-10
    ).ys[-1, 0]
    gradient = jax.vmap(jax.vmap(jax.grad(lambda k: solve(k, "backsolve"))))
    expected = r"Lane 3 of 6 failed \(the first of 2 failing lanes\): The vector field is NaN"
    for program in (jax.vmap(jax.vmap(solve)), gradient):
        with pytest.raises(Exception, match=expected):
            jax.block_until_ready(compile_(program)(k))
    np.testing.assert_allclose(compile_(gradient)(np.ones((2, 3))), -np.exp(-1.0), rtol=1e-8)


@pytest.mark.parametrize(
    "solver", slow_unless(["tsit5", "kvaerno5", "rodas5"], {"tsit5", "rodas5"})
)
def test_leaving_the_domain_is_a_failure(solver):
    """`-sqrt(y)` reaches y = 0 at t = 2 and its steps overshoot into the NaNs of sqrt."""
    sol = odeckpt.solve(
        lambda t, y, a: -jnp.sqrt(y), jnp.ones(1), (0.0, 3.0), solver=solver, throw=False
    )
    assert sol.status != odeckpt.Status.successful
    assert np.all(np.isfinite(sol.ys)) and float(sol.ts[-1]) < 2.01


def test_non_finite_args_fail_before_the_first_step():
    sol = odeckpt.solve(faulty_field, jnp.ones(1), (0.0, T1), (jnp.nan, 2.0, 0.0), throw=False)
    assert sol.status == odeckpt.Status.nonfinite_f0 and int(sol.stats.num_steps) == 0


@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast={"forward"}))
def test_faulty_traced_tolerances_fail_per_lane(adjoint):
    """Tolerances traced per lane: NaN, inf, zero or negative ones end their lane with
    `invalid_settings` before its first step, with a NaN derivative; a healthy lane beside
    them keeps its exact one."""

    def lane(rtol, atol, k):
        def final(k):
            sol = odeckpt.solve(faulty_field, jnp.ones(1), (0.0, T1), (k, 2.0, 0.0), rtol=rtol,
                                atol=atol, adjoint=_adjoint(adjoint), throw=False,
                                solver=_solver_for(adjoint))  # fmt: skip
            return jnp.sum(sol.ys**2), sol

        sol = final(k)[1]
        derivative = jax.jacfwd if adjoint == "forward" else jax.grad
        grad = derivative(lambda k: final(k)[0])(k)
        return sol.status == odeckpt.Status.invalid_settings, sol.stats.num_steps, grad

    rtol = jnp.array([np.nan, np.inf, 0.0, -1e-6, 1e-6, 1e-8])
    atol = jnp.array([1e-8, 1e-8, 1e-8, 1e-8, np.nan, 1e-10])
    invalid, steps, grad = jax.jit(jax.vmap(lane, in_axes=(0, 0, None)))(rtol, atol, 1.3)
    assert np.asarray(invalid).tolist() == [True] * 5 + [False]
    assert np.all(np.asarray(steps)[:5] == 0)
    assert np.all(np.isnan(np.asarray(grad)[:5]))
    np.testing.assert_allclose(grad[5], -2 * np.exp(-2 * 1.3), rtol=1e-6)


def test_error_norm_keeps_nan():
    from odeckpt._error_norm import rms as _rms

    assert np.isnan(_rms(jnp.array([jnp.nan, 1.0]), jnp.ones(2)))
    assert float(_rms(jnp.zeros(2), jnp.ones(2))) == 0.0
    assert np.isnan(_rms(jnp.array([jnp.inf, 1.0]), jnp.array([jnp.inf, 1.0])))


_NAN_MODE = """
import jax, jax.numpy as jnp, numpy as np, odeckpt
jax.config.update("jax_enable_x64", True)
f = lambda t, y, k: jnp.where(t > 0.5, jnp.nan, -k * y)
ts = jnp.array([0.2, 0.9])
sol = odeckpt.solve(f, jnp.array([1.0, 2.0]), (0.0, 1.0), 1.0,
                    saveat=odeckpt.SaveAt(ts=ts, t1=True, dense=True))
assert np.all(np.isnan(sol.ys)) and np.all(np.isnan(sol.ts)), sol.ys
assert np.all(np.isnan(sol.dense.coeffs)), "dense"
sol = odeckpt.solve(lambda t, y, a: -y, jnp.array([1.0 + 1j]), (0.0, 1.0), max_steps=2)
assert np.all(np.isnan(sol.ys.real)) and np.all(np.isnan(sol.ys.imag)), sol.ys
g = jax.grad(lambda k: odeckpt.solve(f, jnp.ones(1), (0.0, 1.0), k).ys.sum())(1.0)
assert np.isnan(g), g
# odeckpt.jit honours it too (NaN outputs, no raise, no callback)
final = odeckpt.jit(lambda k: odeckpt.solve(f, jnp.ones(1), (0.0, 1.0), k).ys)
assert np.all(np.isnan(final(1.0))) and "callback" not in final.lower(1.0).as_text()
print("ok")
"""


def test_eqx_on_error_nan_makes_failed_outputs_nan():
    env = dict(os.environ, EQX_ON_ERROR="nan", JAX_PLATFORMS="cpu")
    script = textwrap.dedent(_NAN_MODE)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# Save times at the ends of the span and repeated ones, against the closed form exp(-t); one
# compiled solve per stepper, forwards and backwards (the span is traced).

_EDGE_TIMES = {
    "forward": ((0.0, 1.0), [0.0, 0.0, 0.3, 0.3, 0.3, 0.7, 1.0, 1.0]),
    "backward": ((1.0, 0.0), [1.0, 1.0, 0.6, 0.6, 0.2, 0.0, 0.0, 0.0]),
}


LAMBDA = -1.0 + 2.0j


def _exact(t):
    """The solution of `_decay`: a real and a complex leaf."""
    t = np.asarray(t)
    return {"real": np.exp(-t), "complex": np.exp(LAMBDA * t)}


def _decay(t, y, args):
    return {"real": -y["real"], "complex": LAMBDA * y["complex"]}


def _edge_solver(name: str, jit: str = "jax.jit"):
    order = SOLVERS[name].order
    if SOLVERS[name].error_order is None:
        options = dict(controller=odeckpt.ConstantStep())
        tol = {1: 2e-2, 2: 1e-4}.get(order, 1e-8)
    else:
        # Steppers with a `tolerance_exponent` above 1 hold their steps tighter still (implicit
        # Euler's to 1e-9, Kvaerno3's to 2e-12: tens of thousands of steps).
        options = dict(rtol=1e-10, atol=1e-10) if order >= 3 else dict(rtol=1e-6, atol=1e-6)
        # Error per step: a first-order method's global error is far above rtol.
        tol = {1: 1e-2, 2: 1e-4}.get(order, 1e-8)

    def solve(t0, t1, ts):
        constant = "controller" in options
        y0 = {"real": jnp.exp(-jnp.stack([t0])), "complex": jnp.exp(LAMBDA * jnp.stack([t0]))}
        return odeckpt.solve(
            _decay, y0, (t0, t1), solver=SOLVERS[name], saveat=odeckpt.SaveAt(ts=ts, dense=True),
            max_steps=2**16, dt0=(t1 - t0) / 256 if constant else None, **options,
        )  # fmt: skip

    return JITS[jit](solve), tol


# By default an explicit Runge-Kutta method and an ESDIRK (whose zero-length first step class 7
# was); every stepper under -m slow.
EDGE_STEPPERS = {"tsit5", "kvaerno5"}


@pytest.mark.parametrize(
    "name, jit",
    slow_unless(
        [(name, jit) for jit in JITS for name in STEPPER_NAMES],
        fast={(name, "jax.jit") for name in EDGE_STEPPERS},
    ),
)
def test_save_times_at_the_ends_and_repeated(name, jit):
    """A state with a real and a complex leaf, against the closed form (the span's ends and
    the save times traced, as Python floats under `odeckpt.jit`)."""
    solve, tol = _edge_solver(name, jit)
    for (t0, t1), ts in _EDGE_TIMES.values():
        sol = solve(t0, t1, jnp.asarray(ts))
        assert sol.status == odeckpt.Status.successful
        np.testing.assert_allclose(sol.ts, ts)
        for key, exact in _exact(ts).items():
            np.testing.assert_allclose(sol.ys[key][:, 0], exact, rtol=tol)
            # Repeated save times hold the same value, bit for bit.
            for i in range(1, len(ts)):
                if ts[i] == ts[i - 1]:
                    assert sol.ys[key][i, 0] == sol.ys[key][i - 1, 0]
        # The dense output covers the span and is never extrapolated.
        with pytest.raises(ValueError, match="outside the solved span"):
            sol.evaluate(t1 + (t1 - t0))
        inside = 0.5 * (t0 + t1)
        # Dopri8's continuous extension is cubic: less accurate than its steps.
        rtol = 1e-3 if name == "dopri8" else max(tol, 1e-6)
        values = sol.evaluate(inside)
        for key, exact in _exact(inside).items():
            np.testing.assert_allclose(values[key], np.atleast_1d(exact), rtol=rtol)


def test_dense_output_is_nan_outside_the_span_under_jit():
    sol = odeckpt.solve(
        lambda t, y, a: -y, jnp.ones(1), (0.0, 2.0), saveat=odeckpt.SaveAt(dense=True)
    )
    values = jax.jit(lambda s, t: s.evaluate(t))(sol, jnp.array([-0.1, 1.0, 2.5]))
    assert np.isnan(values[0]).all() and np.isnan(values[2]).all()
    np.testing.assert_allclose(values[1], np.exp(-1.0), rtol=1e-5)


# With -m slow: rows at t0 are differentiated by default in
# test_derivatives_with_repeated_save_times.
@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_derivatives_in_save_times_at_t0(adjoint):
    """`y(ts)` at `ts = t0`: d/dts = f(t0, y0), d/dt0 = -f(t0, y0)."""
    k = 0.7

    def saved(t0, ts):
        sol = odeckpt.solve(
            lambda t, y, a: -k * y,
            jnp.ones(1),
            (t0, 1.0),
            saveat=ts,
            adjoint=_adjoint(adjoint),
            solver=_solver_for(adjoint),
        )
        return sol.ys[0, 0]

    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    d_t0, d_ts = derivative(saved, argnums=(0, 1))(0.0, jnp.array([0.0, 0.5]))
    np.testing.assert_allclose([d_t0, d_ts[0], d_ts[1]], [k, -k, 0.0], atol=1e-12)


@pytest.mark.parametrize(
    "adjoint", slow_unless(ADJOINTS, fast={"recursive", "forward_sensitivity"})
)
def test_derivatives_with_repeated_save_times(adjoint):
    """Save times at `t0`, repeated and at `t1`: the derivatives of every row in `k`, `y0`,
    the save times and `t1` are the closed form's (a repeat is a row the loop never writes,
    holding inf, whose zero cotangent must not make NaN). Each row moves with its own save
    time only (a repeat too, and a save time equal to `t1`), never with `t1`."""
    k, ts = 0.7, jnp.array([0.0, 0.5, 0.5, 1.0, 1.0])

    def saved(k, y0, ts, t1):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y, y0, (0.0, t1), k, saveat=ts, adjoint=_adjoint(adjoint),
            rtol=1e-10, atol=1e-12, solver=_solver_for(adjoint),
        )  # fmt: skip
        return sol.ys[:, 0]

    derivative = jax.jacfwd if adjoint == "forward" else jax.jacrev
    d_k, d_y0 = derivative(saved, argnums=(0, 1))(k, jnp.ones(1), ts, 1.0)
    decay = np.exp(-k * np.asarray(ts))
    np.testing.assert_allclose(d_k, -np.asarray(ts) * decay, atol=1e-8)
    np.testing.assert_allclose(d_y0[:, 0], decay, atol=1e-8)
    # The times alone (ForwardSensitivity then integrates no sensitivity at all).
    d_ts, d_t1 = derivative(saved, argnums=(2, 3))(k, jnp.ones(1), ts, 1.0)
    np.testing.assert_allclose(d_ts, np.diag(-k * decay), atol=1e-8)
    np.testing.assert_allclose(d_t1, 0.0, atol=1e-8)


# Every adjoint with the default stepper, and the steppers that carry more than the last step
# in their state (Radau5's collocation polynomial, BDF's history) with one adjoint each; a
# discrete adjoint (whose derivatives in t0 and t1 class 5 was) by default.
_ZERO_LENGTH = [
    *[(adjoint, _solver_for(adjoint)) for adjoint in ADJOINTS],
    ("recursive", "radau"), ("backsolve", "radau"), ("direct", "bdf"), ("forward", "bdf"),
    ("forward_sensitivity", "radau"), ("forward_sensitivity", "bdf"),
]  # fmt: skip


def _zero_length_cases():
    """Every case evaluated op by op (one by default), and compiled by `odeckpt.jit` (slow)."""
    eager = [(adjoint, solver, "eager") for adjoint, solver in _ZERO_LENGTH]
    yield from slow_unless(eager, fast=[("direct", "tsit5", "eager")])
    for adjoint, solver in _ZERO_LENGTH:
        yield pytest.param(adjoint, solver, "odeckpt.jit", marks=[pytest.mark.slow])


@pytest.mark.parametrize("adjoint, solver, jit", list(_zero_length_cases()))
def test_zero_length_spans_inside_a_batch(adjoint, solver, jit):
    """A lane with t1 == t0 has y(t1) = y0 and the exact derivatives in t0, t1, y0 and k
    (evaluated op by op, or compiled by `odeckpt.jit`, where it must not raise)."""
    k = 0.8

    def final(t1, y0, k):
        sol = odeckpt.solve(
            lambda t, y, k: -k * y, jnp.stack([y0]), (0.2, t1), k, adjoint=_adjoint(adjoint),
            rtol=1e-10, atol=1e-10, saveat=odeckpt.SaveAt(ts=jnp.stack([t1]), t1=True),
            solver=solver,
        )  # fmt: skip
        return jnp.sum(sol.ys)

    t1s = jnp.array([0.2, 1.0, 0.2])
    y0 = 1.5
    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    batched = jax.vmap(derivative(final, argnums=(0, 1, 2)), in_axes=(0, None, None))
    d_t1, d_y0, d_k = (batched if jit == "eager" else odeckpt.jit(batched))(t1s, y0, k)
    span = np.asarray(t1s) - 0.2
    decay = np.exp(-k * span)
    np.testing.assert_allclose(d_t1, 2 * -k * y0 * decay, rtol=1e-7)
    np.testing.assert_allclose(d_y0, 2 * decay, rtol=1e-7)
    np.testing.assert_allclose(d_k, 2 * -span * y0 * decay, rtol=1e-7, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("throw", [False, True])
def test_faults_in_a_complex_state_under_odeckpt_jit(throw):
    """`y' = i k y` from 1, NaN from `t_fault` on, one program per lane: a faulty lane fails
    (its status, a NaN derivative; with `throw=True` the call raises the status's message),
    and a healthy one has d Re y(1) / dk = -sin k."""

    def final(k, t_fault):
        field = lambda t, y, p: jnp.where(t > p[1], jnp.nan, 1j * p[0] * y)
        sol = odeckpt.solve(field, jnp.ones(1, complex), (0.0, 1.0), (k, t_fault), rtol=1e-10,
                            atol=1e-10, throw=throw)  # fmt: skip
        return jnp.real(sol.ys[-1, 0]), sol.status == odeckpt.Status.successful

    program = odeckpt.jit(jax.grad(final, has_aux=True))
    if throw:
        with pytest.raises(eqx.EquinoxRuntimeError) as raised:
            program(1.3, 0.5)
        assert str(raised.value).startswith(odeckpt.Status.nonfinite.message)
    else:
        d, ok = program(1.3, 0.5)
        assert not ok and np.isnan(d)
    d, ok = program(1.3, 2.0)
    assert ok
    np.testing.assert_allclose(d, -np.sin(1.3), rtol=1e-8)
