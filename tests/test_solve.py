"""`odeckpt.solve`: accuracy against scipy, SaveAt semantics, pytrees, vmap, jit, statuses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from problems import LOTKA_VOLTERRA, PLEIADES, VAN_DER_POL, lotka_volterra, reference
from selection import slow_unless

import odeckpt
from odeckpt._steppers import stepper_from_name

ADAPTIVE = ["heun", "bosh3", "tsit5", "dopri5", "dopri8"]


@pytest.mark.parametrize(
    "problem",
    [
        pytest.param(LOTKA_VOLTERRA, marks=pytest.mark.slow),
        VAN_DER_POL,
        pytest.param(PLEIADES, marks=pytest.mark.slow),
    ],
    ids=["lv", "vdp", "pleiades"],
)
@pytest.mark.parametrize("solver", slow_unless(["tsit5", "dopri5", "dopri8"], fast={"tsit5"}))
def test_adaptive_matches_scipy(problem, solver):
    t0, t1 = problem["t_span"]
    ts = np.linspace(t0, t1, 7)
    rtol = atol = 1e-9
    sol = odeckpt.solve(
        problem["f"],
        jnp.asarray(problem["y0"]),
        (t0, t1),
        problem["args"],
        solver=solver,
        rtol=rtol,
        atol=atol,
        saveat=ts,
        max_steps=100_000,
    )
    expected = reference(problem, ts)
    scale = np.max(np.abs(expected))
    # Global error is a modest multiple of the local tolerance on these non-stiff problems.
    assert np.max(np.abs(np.asarray(sol.ys) - expected)) < 1e3 * rtol * scale
    assert sol.status == odeckpt.Status.successful
    assert int(sol.stats.num_rejected_steps) < int(sol.stats.num_accepted_steps)


# With -m slow: Tsit5's error falling with the tolerance is checked by default in
# test_tolerances.py::test_traced_rtol_compiles_once_and_controls_the_error.
@pytest.mark.slow
@pytest.mark.parametrize("solver", ADAPTIVE)
def test_error_falls_with_tolerance(solver):
    problem = VAN_DER_POL
    expected = reference(problem, [problem["t_span"][1]])[0]
    errors = []
    for tol in (1e-4, 1e-7):
        sol = odeckpt.solve(
            problem["f"],
            jnp.asarray(problem["y0"]),
            problem["t_span"],
            problem["args"],
            solver=solver,
            rtol=tol,
            atol=tol,
            max_steps=200_000,
        )
        errors.append(np.max(np.abs(sol.ys[-1] - expected)))
    assert errors[1] < errors[0] / 30


@pytest.mark.parametrize(
    "solver",
    # Every stepper's order is checked step by step in test_steppers.py; through `solve`,
    # by default, the classic fourth-order one.
    slow_unless(
        sorted(
            ["euler", "heun", "midpoint", "ralston", "rk4", "bosh3", "tsit5", "dopri5", "dopri8"]
        ),
        fast={"rk4"},
    ),
)
def test_constant_step_order_through_solve(solver):
    """The loop preserves each stepper's order (the strict 0.2 check is in test_steppers)."""
    stepper = stepper_from_name(solver)
    f = lambda t, y, a: jnp.stack([y[0] * jnp.cos(t), -y[1] * y[0]])
    y0, t_span = jnp.array([1.0, 1.0]), (0.0, 3.0)
    exact = odeckpt.solve(f, y0, t_span, solver="dopri8", rtol=1e-14, atol=1e-14).ys[-1]
    dts = {8: 0.3, 5: 0.1, 4: 0.1}.get(stepper.order, 0.05) / 1.5 ** np.arange(3)
    errors = []
    for dt in dts:
        controller = odeckpt.ConstantStep()
        sol = odeckpt.solve(f, y0, t_span, solver=solver, controller=controller, dt0=dt)
        errors.append(np.max(np.abs(sol.ys[-1] - exact)))
    slope = np.polyfit(np.log(dts), np.log(errors), 1)[0]
    assert abs(slope - stepper.order) < 0.4, (slope, errors)


@pytest.mark.parametrize(
    "t_span, dt0, steps",
    [
        pytest.param((0.0, 1.0), 0.1, 10, marks=pytest.mark.slow),
        ((0.0, 1.0), 0.3, 4),
        ((2.0, -1.0), -0.25, 12),
        ((0.0, 1.0), 2.0, 1),
    ],
)
def test_constant_step_count(t_span, dt0, steps):
    sol = odeckpt.solve(
        lambda t, y, a: -y,
        jnp.ones(3),
        t_span,
        solver="rk4",
        controller=odeckpt.ConstantStep(),
        dt0=dt0,
        saveat=odeckpt.SaveAt(steps=True, t1=True),
    )
    assert int(sol.stats.num_steps) == steps == int(sol.stats.num_accepted_steps)
    assert sol.ts[steps - 1] == t_span[1] == sol.ts[-1]
    np.testing.assert_allclose(sol.ys[-1], np.exp(-(t_span[1] - t_span[0])) * np.ones(3), rtol=3e-2)
    assert np.all(np.isinf(sol.ts[steps:-1]))


# Backwards with -m slow (a backward span is stepped by default in test_constant_step_count).
@pytest.mark.parametrize("backwards", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_saveat_blocks(backwards):
    t0, t1 = (3.0, 0.0) if backwards else (0.0, 3.0)
    ts = np.linspace(t0, t1, 50)
    f = lambda t, y, a: jnp.stack([y[1], -y[0]])
    y0 = jnp.array([1.0, 0.0])
    exact = lambda t: np.stack([np.cos(t - t0), -np.sin(t - t0)], axis=-1)
    saveat = odeckpt.SaveAt(t0=True, ts=ts, steps=True, t1=True, dense=True)
    max_steps = 200
    sol = odeckpt.solve(f, y0, (t0, t1), saveat=saveat, rtol=1e-10, atol=1e-10, max_steps=max_steps)
    n = int(sol.stats.num_accepted_steps)
    assert sol.ts.shape == (1 + len(ts) + max_steps + 1,)
    assert sol.ts[0] == t0 and sol.ts[-1] == t1
    np.testing.assert_array_equal(sol.ts[1 : 1 + len(ts)], ts)
    steps = np.asarray(sol.ts[1 + len(ts) : 1 + len(ts) + n])
    assert np.all(np.diff(steps) * np.sign(t1 - t0) > 0) and steps[-1] == t1
    assert np.all(np.isinf(sol.ts[1 + len(ts) + n : -1]))
    finite = np.isfinite(np.asarray(sol.ts))
    np.testing.assert_allclose(sol.ys[finite], exact(np.asarray(sol.ts)[finite]), atol=1e-8)
    # Dense output between and at step ends, and outside-of-step times clamp to the span.
    probe = np.linspace(t0, t1, 333)
    np.testing.assert_allclose(sol.evaluate(probe), exact(probe), atol=1e-7)
    np.testing.assert_allclose(sol.evaluate(steps), exact(steps), atol=1e-8)


def test_many_save_times_inside_one_step_are_all_written():
    ts = np.linspace(0.0, 1.0, 1000)
    sol = odeckpt.solve(
        lambda t, y, a: -y, jnp.array([1.0]), (0.0, 1.0), saveat=ts, rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(sol.ys[:, 0], np.exp(-ts), rtol=1e-8)


def test_dense_requires_saveat():
    sol = odeckpt.solve(lambda t, y, a: -y, jnp.array([1.0]), (0.0, 1.0))
    with pytest.raises(ValueError, match="SaveAt\\(dense=True\\)"):
        sol.evaluate(0.5)


def test_pytree_state_and_module_args():
    import equinox as eqx

    class Decay(eqx.Module):
        rate: jax.Array

        def __call__(self, t, y, args):
            del t, args
            return {"a": -self.rate * y["a"], "b": (-2 * self.rate * y["b"][0], y["b"][1] * 0.0)}

    decay = Decay(jnp.asarray(0.5))
    y0 = {"a": jnp.ones((2, 3)), "b": (jnp.full((4,), 2.0), jnp.zeros(()))}
    sol = odeckpt.solve(
        lambda t, y, m: m(t, y, None),
        y0,
        (0.0, 2.0),
        args=decay,
        saveat=odeckpt.SaveAt(ts=[1.0, 2.0]),
        rtol=1e-9,
        atol=1e-9,
    )
    np.testing.assert_allclose(sol.ys["a"][:, 0, 0], np.exp(-0.5 * np.array([1.0, 2.0])), rtol=1e-7)
    np.testing.assert_allclose(sol.ys["b"][0][:, 0], 2 * np.exp(-np.array([1.0, 2.0])), rtol=1e-7)
    assert sol.ys["a"].shape == (2, 2, 3) and sol.ys["b"][1].shape == (2,)


def test_float32_and_complex_states():
    sol32 = odeckpt.solve(
        lambda t, y, a: -y, jnp.ones(3, jnp.float32), (0.0, 1.0), rtol=1e-5, atol=1e-6
    )
    assert sol32.ys.dtype == jnp.float32 and sol32.ts.dtype == jnp.float32
    np.testing.assert_allclose(sol32.ys[-1], np.exp(-1.0), rtol=1e-4)
    solc = odeckpt.solve(
        lambda t, y, a: 1j * y, jnp.ones(2, jnp.complex128), (0.0, 2.0), rtol=1e-10, atol=1e-10
    )
    assert solc.ys.dtype == jnp.complex128
    np.testing.assert_allclose(solc.ys[-1], np.exp(2j) * np.ones(2), rtol=1e-8)


# With -m slow: `solve` under `vmap` runs by default in test_progress_bar_under_jit_and_vmap
# and test_batching.py.
@pytest.mark.slow
def test_vmap_over_y0_args_and_span_matches_loop():
    f, args = (
        lotka_volterra,
        jnp.array([[1.1, 0.4, 0.4, 0.1], [1.0, 0.5, 0.3, 0.2], [0.9, 0.3, 0.5, 0.1]]),
    )
    y0 = jnp.array([[10.0, 5.0], [4.0, 2.0], [1.0, 1.0]])
    t1 = jnp.array([5.0, 7.0, 3.0])
    ts_fraction = jnp.linspace(0.0, 1.0, 5)

    def one(y0, args, t1):
        sol = odeckpt.solve(
            f, y0, (0.0, t1), tuple(args), saveat=ts_fraction * t1, rtol=1e-8, atol=1e-8
        )
        return sol.ys, sol.stats.num_accepted_steps

    batched_ys, batched_steps = jax.jit(jax.vmap(one))(y0, args, t1)
    for i in range(3):
        ys, steps = one(y0[i], args[i], t1[i])
        np.testing.assert_allclose(batched_ys[i], ys, rtol=1e-12)
        assert int(batched_steps[i]) == int(steps)


def test_jit_and_zero_length_span():
    f = lambda t, y, a: -y
    solve = jax.jit(
        lambda y0, t1: odeckpt.solve(
            f, y0, (1.0, t1), saveat=odeckpt.SaveAt(t0=True, ts=jnp.array([1.0]), t1=True)
        )
    )
    sol = solve(jnp.ones(2), 1.0)
    np.testing.assert_array_equal(sol.ys, np.ones((3, 2)))
    assert int(sol.stats.num_steps) == 0
    sol = odeckpt.solve(f, jnp.ones(2), (1.0, 1.0))
    np.testing.assert_array_equal(sol.ys, np.ones((1, 2)))
    assert int(sol.stats.num_steps) == 0 and sol.status == odeckpt.Status.successful


def test_stats_count_function_evaluations():
    calls = []

    def f(t, y, a):
        jax.debug.callback(lambda: calls.append(1))
        return -y

    sol = odeckpt.solve(f, jnp.ones(2), (0.0, 5.0), solver="dopri5")
    jax.effects_barrier()
    assert int(sol.stats.num_fn_evals) == len(calls)
    assert int(sol.stats.num_steps) == int(sol.stats.num_accepted_steps) + int(
        sol.stats.num_rejected_steps
    )


def test_progress_bar_under_jit_and_vmap(capsys):
    f = lambda t, y, a: -y
    run = jax.jit(jax.vmap(lambda y0: odeckpt.solve(f, y0, (0.0, 1.0), progress=True).ys))
    ys = run(jnp.ones((3, 2)))
    jax.effects_barrier()
    np.testing.assert_allclose(ys[:, -1], np.exp(-1.0) * np.ones((3, 2)), rtol=1e-5)
    assert "100%" in capsys.readouterr().err


def test_status_max_steps_and_throw():
    f, y0 = VAN_DER_POL["f"], jnp.asarray(VAN_DER_POL["y0"])
    sol = odeckpt.solve(
        f, y0, (0.0, 10.0), 1.0, max_steps=5, throw=False, saveat=odeckpt.SaveAt(t1=True)
    )
    assert sol.status == odeckpt.Status.max_steps_reached
    assert int(sol.stats.num_steps) == 5 and float(sol.ts[-1]) < 10.0
    with pytest.raises(Exception, match="max_steps"):
        odeckpt.solve(f, y0, (0.0, 10.0), 1.0, max_steps=5)


def test_status_nonfinite_and_underflow():
    blow_up = lambda t, y, a: y**2  # y(t) = 1 / (1 - t): infinite at t = 1
    sol = odeckpt.solve(
        blow_up,
        jnp.ones(1),
        (0.0, 2.0),
        solver="rk4",
        controller=odeckpt.ConstantStep(),
        dt0=0.01,
        throw=False,
    )
    assert sol.status == odeckpt.Status.nonfinite
    with pytest.raises(Exception, match="non-finite"):
        odeckpt.solve(
            blow_up,
            jnp.ones(1),
            (0.0, 2.0),
            solver="rk4",
            controller=odeckpt.ConstantStep(),
            dt0=0.01,
        )
    sol = odeckpt.solve(blow_up, jnp.ones(1), (0.0, 2.0), throw=False, max_steps=100_000)
    assert sol.status in (odeckpt.Status.dt_underflow, odeckpt.Status.nonfinite)
    assert float(sol.ts[-1]) < 1.01
    sol = odeckpt.solve(
        blow_up,
        jnp.ones(1),
        (0.0, 0.9),
        max_steps=100_000,
        controller=odeckpt.PIDController(dtmin=0.05),
        throw=False,
    )
    assert sol.status == odeckpt.Status.dt_underflow


@pytest.mark.slow
def test_constant_step_count_is_predicted_exactly():
    """`constant_step_count` (which lets checkpointing use the offline schedule) replays the
    loop's arithmetic: it must match the steps taken, in both dtypes, directions, with save
    times forcing extra steps. (Each case compiles a solve: 10 here, 40 more with -m slow.)"""
    _check_constant_step_counts(cases=10, seed=0)


@pytest.mark.slow
def test_constant_step_count_is_predicted_exactly_many():
    _check_constant_step_counts(cases=40, seed=1)


def _check_constant_step_counts(cases: int, seed: int) -> None:
    from odeckpt._loop._landing import constant_step_count, saves_per_step

    rng = np.random.default_rng(seed)
    for _ in range(cases):
        t0 = float(rng.uniform(-5, 5))
        t1 = t0 + float(rng.choice([-1, 1]) * rng.uniform(0.01, 10))
        dt = abs(t1 - t0) / float(rng.choice([1, 3, 7, 10, 33, 0.7 * rng.integers(1, 50)]))
        ts = np.sort(rng.uniform(min(t0, t1), max(t0, t1), int(rng.integers(1, 80))))
        ts = None if rng.random() < 0.4 else (ts if t1 > t0 else ts[::-1])
        dtype = rng.choice([np.float32, np.float64])
        solver = str(rng.choice(["rk4", "dopri8"]))
        sol = odeckpt.solve(
            lambda t, y, a: -y,
            jnp.ones(1, dtype),
            (t0, t1),
            solver=solver,
            controller=odeckpt.ConstantStep(),
            dt0=dt * np.sign(t1 - t0),
            saveat=ts,
            adjoint="forward",
            max_steps=10_000,
        )
        per_step = saves_per_step(stepper_from_name(solver))
        predicted = constant_step_count(t0, t1, dt, ts, per_step, np.dtype(dtype), 10_000)
        assert predicted == int(sol.stats.num_steps)


def test_step_record_packs_its_decisions_in_one_byte():
    from odeckpt._loop._state import StepRecord

    verdicts = [
        StepRecord.rejected, StepRecord.accepted, StepRecord.newton_failed, StepRecord.nonfinite
    ]  # fmt: skip
    cases = [(v, c) for v in verdicts for c in (False, True)]
    v, c = (jnp.asarray(x) for x in zip(*cases, strict=True))
    record = jax.vmap(StepRecord.make)(v, c, jnp.ones(len(cases)))
    assert record.code.dtype == jnp.uint8
    np.testing.assert_array_equal(record.verdict, v)
    np.testing.assert_array_equal(record.clipped, c)
