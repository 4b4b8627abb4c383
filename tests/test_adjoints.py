"""Reverse- and forward-mode derivatives of `solve` through each adjoint."""

import math
import re
import tracemalloc

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest
from problems import central_differences
from selection import slow_unless

import odeckpt
from odeckpt._steppers import STEPPERS
from odeckpt.checkpointing.schedules import (
    binomial,
    offline_schedule,
    online_schedule,
    simulate,
)

ADAPTIVE = sorted(name for name, cls in STEPPERS.items() if cls.error_order is not None)


def vector_field(t, y, args):
    a, b = args
    return jnp.stack([a * y[0] - b * y[0] * y[1] + 0.1 * jnp.sin(t), b * y[0] * y[1] - y[1]])


Y0 = jnp.array([1.5, 0.8])
ARGS = (jnp.asarray(1.1), jnp.asarray(0.6))
TS = jnp.linspace(0.0, 3.0, 100)


def loss(y0, args, adjoint, solver="tsit5", constant=False, t1=3.0, tol=None, **kwargs):
    step = dict(controller=odeckpt.ConstantStep(), dt0=0.05) if constant else {}
    # Low-order methods would need tens of thousands of steps at the tolerance of the others.
    tol = tol or (1e-7 if STEPPERS[solver].order >= 3 else 1e-4)
    sol = odeckpt.solve(
        vector_field,
        y0,
        (0.0, t1),
        args,
        solver=solver,
        adjoint=adjoint,
        rtol=tol,
        atol=tol,
        saveat=odeckpt.SaveAt(ts=TS * t1 / 3.0, t1=True),
        max_steps=4000,
        **step,
        **kwargs,
    )
    return jnp.sum(sol.ys**2 * jnp.arange(1, sol.ys.shape[0] + 1)[:, None])


def grads(adjoint, **kwargs):
    return jax.jit(
        jax.grad(loss, argnums=(0, 1)),
        static_argnums=(2,),
        static_argnames=("solver", "constant", "tol"),
    )(Y0, ARGS, adjoint, **kwargs)


def assert_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.max(np.abs(y)))


@pytest.mark.slow
@pytest.mark.parametrize("solver", sorted(STEPPERS))
def test_recursive_equals_direct_constant_steps(solver):
    # With constant steps the tolerance only stops the Newton iterations. BDF starts at order
    # 1, whose steps of 0.05 are 1e-3 off: from there its iteration cannot reach a small
    # fraction of 1e-7 in its 4 iterations (`newton_failed`), but can of 1e-4.
    kw = dict(solver=solver, constant=True, tol=1e-4 if solver == "bdf" else None)
    direct = grads(odeckpt.DirectAdjoint(), **kw)
    for c in (2, 7):
        recursive = grads(odeckpt.RecursiveCheckpointAdjoint(checkpoints=c), **kw)
        assert_close(recursive, direct, 1e-10)


# Each case compiles two or three gradients (several seconds each): the default run keeps one,
# `pytest -m slow` runs every stepper.
@pytest.mark.parametrize("solver", slow_unless(ADAPTIVE, fast={"tsit5"}))
def test_recursive_equals_direct_adaptive(solver):
    direct = grads(odeckpt.DirectAdjoint(), solver=solver)
    for adjoint in (
        odeckpt.RecursiveCheckpointAdjoint(checkpoints=3),
        odeckpt.RecursiveCheckpointAdjoint(),
    ):
        assert_close(grads(adjoint, solver=solver), direct, 1e-10)


@pytest.mark.slow
def test_recursive_equals_direct_large_state_without_cached_f():
    # 2**13 float64 components (64 KiB): the snapshots leave out Tsit5's cached f(t, y) and a
    # restore recomputes it, rounding differently from the forward run's; the recorded
    # decisions keep the recomputed trajectory on the forward one.
    y0 = jnp.linspace(0.0, 1.0, 2**13)
    field = lambda t, y, a: -a * y + 0.5 * jnp.sin(jnp.roll(y, 1))

    def big_loss(a, adjoint):
        ts = jnp.linspace(0.5, 2.0, 4)
        sol = odeckpt.solve(field, y0, (0.0, 2.0), a, adjoint=adjoint, saveat=ts, rtol=1e-8)
        return jnp.sum(sol.ys**2)

    grad = jax.jit(jax.grad(big_loss), static_argnums=1)
    direct = grad(1.3, odeckpt.DirectAdjoint())
    recursive = grad(1.3, odeckpt.RecursiveCheckpointAdjoint(checkpoints=2))
    np.testing.assert_allclose(recursive, direct, rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ["direct", "recursive"])
def test_constant_steps_match_finite_differences(adjoint):
    g_y0, g_args = grads(adjoint, solver="rk4", constant=True)
    forward = lambda y0, args: loss(y0, args, "forward", solver="rk4", constant=True)
    assert_close(g_y0, central_differences(lambda y: forward(y, ARGS), Y0, 1e-6), 1e-7)
    assert_close(g_args, central_differences(lambda a: forward(Y0, a), ARGS, 1e-6), 1e-7)


def test_adaptive_matches_finite_differences():
    """The adaptive solve is piecewise smooth in its inputs (step counts are integers), so the
    difference quotient uses a wide step and a loose tolerance."""
    g_y0, _ = grads("recursive", solver="dopri5")
    fd = central_differences(lambda y: loss(y, ARGS, "forward", solver="dopri5"), Y0, 1e-3)
    assert_close(g_y0, fd, 1e-4)


@pytest.mark.slow
def test_jacfwd_equals_jacrev():
    fn = lambda y0, adjoint: (
        odeckpt.solve(
            vector_field,
            y0,
            (0.0, 3.0),
            ARGS,
            adjoint=adjoint,
            saveat=TS[::10],
            rtol=1e-8,
            atol=1e-8,
        ).ys
    )
    reverse = jax.jacrev(fn)(Y0, "direct")
    for adjoint in ("forward", "direct", "recursive"):
        assert_close(jax.jacfwd(fn)(Y0, adjoint), reverse, 1e-10)
    jitted = jax.jit(jax.jacfwd(lambda y0: fn(y0, "forward")))
    assert_close(jitted(Y0), reverse, 1e-10)


@pytest.mark.slow
def test_gradient_with_respect_to_t1():
    def final(t1):
        return odeckpt.solve(vector_field, Y0, (0.0, t1), ARGS, rtol=1e-10, atol=1e-10).ys[-1]

    cotangent = jnp.array([0.3, -1.2])
    g = jax.grad(lambda t1: jnp.dot(final(t1), cotangent))(3.0)
    expected = jnp.dot(vector_field(3.0, final(3.0), ARGS), cotangent)
    np.testing.assert_allclose(g, expected, rtol=1e-6)


# With -m slow (per-lane derivatives under vmap run by default in test_batching.py).
@pytest.mark.slow
@pytest.mark.parametrize("constant, rtol", [(True, 1e-12), (False, 1e-6)])
def test_vmap_of_grad_equals_per_example(constant, rtol):
    """Lanes step in lockstep; with adaptive steps, batched rounding may flip an accept/reject
    decision near the threshold, so lanes agree to the solve's tolerance, not to rounding."""
    y0s = jnp.array([[1.5, 0.8], [0.5, 2.0], [3.0, 0.1]])
    t1s = jnp.array([1.0, 2.0, 3.0])
    g = jax.grad(lambda y0, t1: loss(y0, ARGS, "recursive", t1=t1, constant=constant))
    batched = jax.jit(jax.vmap(g))(y0s, t1s)
    for i, (y0, t1) in enumerate(zip(y0s, t1s, strict=True)):
        assert_close(batched[i], jax.jit(g)(y0, t1), rtol)
    assert np.all(np.isfinite(batched))


@pytest.mark.slow
def test_float32_gradients():
    y0 = Y0.astype(jnp.float32)
    args = jax.tree.map(lambda a: a.astype(jnp.float32), ARGS)
    g32 = jax.grad(loss)(y0, args, "recursive")
    assert g32.dtype == jnp.float32
    assert_close(g32, grads("recursive")[0], 1e-3)


def test_forward_mode_rejects_reverse_mode_by_name():
    with pytest.raises(TypeError, match="RecursiveCheckpointAdjoint"):
        jax.grad(loss)(Y0, ARGS, "forward")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(checkpoints=0), "int >= 1"),
        (dict(checkpoints=2, memory_budget="1GB"), "not both"),
        (dict(memory_budget="lots"), "memory"),
    ],
)
def test_bad_adjoint_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        odeckpt.RecursiveCheckpointAdjoint(**kwargs)


def _stats_solve(adjoint, constant=False, max_steps=500):
    f = lambda t, y, a: jnp.stack([y[1], -a * jnp.sin(y[0])])
    step = dict(controller=odeckpt.ConstantStep(), dt0=0.05) if constant else {}
    return odeckpt.solve(
        f, jnp.array([1.0, 0.0]), (0.0, 6.0), 2.0, adjoint=adjoint, max_steps=max_steps, **step
    ).stats


@pytest.mark.parametrize("c", slow_unless([2, 5, 40], fast={5}))
def test_stats_report_the_reverse_sweep(c):
    from odeckpt.checkpointing.schedules import offline_schedule, online_schedule, simulate

    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=c)
    # adaptive steps: the online schedule over max_steps, stopped at the steps taken
    stats = _stats_solve(adjoint)
    n = int(stats.num_steps)
    expected = simulate(online_schedule(500, c), n).forward_steps - (n - 1)
    assert int(stats.num_checkpoints) == c and int(stats.num_recomputed_steps) == expected
    # constant steps: the offline schedule for the known count (plus its spare step)
    stats = _stats_solve(adjoint, constant=True)
    n = int(stats.num_steps)
    expected = simulate(offline_schedule(n + 1, c), n).forward_steps - (n - 1)
    assert int(stats.num_recomputed_steps) == expected
    assert expected > 0 or c >= n


def test_stats_of_a_constant_step_solve_one_step_short_of_its_schedule():
    """19 constant steps: the offline schedule is planned for 20 (a spare step) with 5 slots,
    and the last segment at the stop keeps more than one free slot."""
    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=5)
    f = lambda t, y, a: -a * y
    stats = odeckpt.solve(f, jnp.ones(2), (0.0, 0.95), 1.0, adjoint=adjoint, solver="rk4",
                          controller=odeckpt.ConstantStep(), dt0=0.05).stats  # fmt: skip
    n = int(stats.num_steps)
    assert n == 19
    expected = simulate(offline_schedule(n + 1, 5), n).forward_steps - (n - 1)
    assert int(stats.num_recomputed_steps) == expected


def test_stats_of_the_other_adjoints():
    # DirectAdjoint keeps a snapshot of every step up to max_steps (500) and recomputes none
    for adjoint, checkpoints in (("direct", 500), ("forward", 0), (odeckpt.BacksolveAdjoint(), 0)):
        stats = _stats_solve(adjoint)
        assert int(stats.num_checkpoints) == checkpoints
        assert int(stats.num_recomputed_steps) == 0
    stats = _stats_solve(odeckpt.BacksolveAdjoint(checkpoints=4))
    assert int(stats.num_checkpoints) == 4
    # InterpolatingAdjoint re-solves every forward step (retraced from its checkpoints), and
    # with tolerances of its own the whole solve from t0 once more (counted as the forward's)
    stats = _stats_solve(odeckpt.InterpolatingAdjoint(checkpoints=8))
    assert int(stats.num_checkpoints) == 8
    assert int(stats.num_recomputed_steps) == int(stats.num_steps) > 0
    stats = _stats_solve(odeckpt.InterpolatingAdjoint(rtol=1e-8, atol=1e-8))
    assert int(stats.num_recomputed_steps) == 2 * int(stats.num_steps)
    # the default plan: the fewest c with C(c+2, 2) >= max_steps (C(32, 2) = 496 < 500)
    assert int(_stats_solve("recursive").num_checkpoints) == 31


@pytest.mark.parametrize("max_steps", slow_unless([10**6, 10**9], fast={10**9}))
def test_a_large_max_steps_costs_no_table_over_the_steps(max_steps):
    """A 5-step solve with `max_steps` of a million or a billion: its gradient and statistics
    hold no constant larger than the schedule's table of binomials (`O(c r)` integers) and
    tracing them allocates a few MiB; the default plan keeps the fewest `c` with
    `C(c+2, 2) >= max_steps`."""

    def solve(y0):
        return odeckpt.solve(lambda t, y, a: -y, y0, (0.0, 1.0), max_steps=max_steps)

    tracemalloc.start()
    lowered = jax.jit(jax.grad(lambda y0: solve(y0).ys[-1].sum())).lower(Y0).as_text()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    shapes = re.findall(r"stablehlo\.constant dense<.*?> : tensor<([0-9x]*)[a-z]", lowered)
    largest = max(math.prod(int(d) for d in s.split("x") if d) for s in shapes)
    stats = jax.jit(solve)(Y0).stats
    c = int(stats.num_checkpoints)
    assert binomial(c - 1, 2) < max_steps <= binomial(c, 2)
    assert largest <= online_schedule(max_steps, c).binomials.size < 8 * c
    assert peak < 64 * 2**20, peak
    assert int(stats.num_steps) == 5 and int(stats.num_recomputed_steps) == 0


# The engine's record stays bounded by default: test_bounded_while_loop.py::
# test_the_record_of_decisions_is_bounded_whatever_max_steps.
@pytest.mark.slow
def test_a_large_max_steps_costs_no_memory_over_the_steps():
    """The gradient of a 5-step solve with `max_steps` of a billion: its temporary memory is
    its `c = 44721` snapshots and the record of at most 2**20 steps' decisions (9 bytes each),
    not a record of `max_steps` (8.4 GiB), and its value is exact (`y(1) / y0`: the solve is
    linear)."""

    def solve(y0):
        return odeckpt.solve(lambda t, y, a: -y, y0, (0.0, 1.0), max_steps=10**9)

    compiled = jax.jit(jax.grad(lambda y0: solve(y0).ys[-1].sum())).lower(Y0).compile()
    sol = jax.jit(solve)(Y0)
    c = int(sol.stats.num_checkpoints)
    # a snapshot (t, y, dt, the stepper's and the controller's states, counters) < 1 KiB
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 2**20 * 9 + c * 2**10, (temp, c)
    np.testing.assert_allclose(compiled(Y0), sol.ys[-1] / Y0, rtol=1e-14)


def test_the_loop_cotangent_names_every_array_field():
    """A field of the loop that holds inexact arrays and is given no cotangent raises at trace
    time, rather than getting a zero gradient."""
    from odeckpt._adjoints._custom_rule import loop_cotangent
    from odeckpt._loop import IntegrationLoop, PIDController
    from odeckpt._saveat import SaveAt

    loop = IntegrationLoop(
        f=lambda t, y, a: -a * y, args=jnp.array(2.0), stepper=odeckpt.Tsit5(),
        controller=PIDController(rtol=1e-6, atol=1e-8), t_end=jnp.array(1.0), ts=None,
        saveat=SaveAt(t1=True), max_steps=10,
    )  # fmt: skip
    with pytest.raises(TypeError, match="args"):
        loop_cotangent(loop, t_end=jnp.array(1.0))
    ct = loop_cotangent(loop, args=jnp.array(3.0), t_end=None)
    assert float(ct.args) == 3.0 and ct.t_end is None and not jax.tree.leaves(ct.controller)


def test_the_crossing_cotangents_are_the_transpose_of_its_tangents():
    """<ct, T v> = <T^T ct, v> for the crossing time's tangent map, and its time tangent is
    -(dg) / (g_t + g_y f)."""
    from odeckpt._adjoints._derivatives import crossing_cotangents, crossing_tangent

    g = lambda t, y, p: y[0] * p - jnp.sin(t) - 0.3
    t, y, p = jnp.array(0.4), jnp.array([0.7, -1.1]), jnp.array(1.3)
    rate = jnp.array([0.5, 2.0])
    dy, dp = jnp.array([0.2, -0.4]), jnp.array(0.9)
    dtau, dy_at = crossing_tangent(g, t, y, p, rate, dy, dp)
    expected = -(p * dy[0] + y[0] * dp) / (-jnp.cos(t) + p * rate[0])
    np.testing.assert_allclose(dtau, expected, rtol=1e-12)
    np.testing.assert_allclose(dy_at, dy + rate * expected, rtol=1e-12)
    ct_tau, ct_y = jnp.array(-0.6), jnp.array([1.5, 0.25])
    ct_dy, ct_dp = crossing_cotangents(g, t, y, p, rate, ct_tau, ct_y)
    left = ct_tau * dtau + jnp.dot(ct_y, dy_at)
    np.testing.assert_allclose(left, jnp.dot(ct_dy, dy) + ct_dp * dp, rtol=1e-12)
