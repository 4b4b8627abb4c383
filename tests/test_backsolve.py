"""BacksolveAdjoint: continuous-adjoint gradients against finite differences of the forward
solve, save-time jumps, time gradients, batching, float32, checkpointed re-anchoring, and the
backward step counts `on_backward` reports."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt
from odeckpt import BacksolveAdjoint

TIGHT = dict(rtol=1e-12, atol=1e-12)


def oscillator(t, y, args):
    """A forced, damped pendulum: nonlinear in `y`, explicitly time-dependent."""
    a, b = args
    return jnp.stack([y[1], -a * jnp.sin(y[0]) - b * y[1] + 0.3 * jnp.cos(t)])


Y0 = jnp.array([1.0, 0.5])
ARGS = (jnp.array(1.3), jnp.array(0.2))


def central_difference(fun, x, eps=1e-4):
    """Central finite differences of the scalar `fun` at the float array `x`."""
    x = np.asarray(x, dtype=np.float64)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = eps
        grad[index] = (fun(jnp.asarray(x + step)) - fun(jnp.asarray(x - step))) / (2 * eps)
    return grad


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual), np.asarray(expected)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300))


def final_loss(y0, args, t0, t1, adjoint, **kwargs):
    sol = odeckpt.solve(oscillator, y0, (t0, t1), args, adjoint=adjoint, **kwargs)
    return jnp.sum(sol.ys[-1] ** 2) + sol.ys[-1][0]


def reference_gradients(loss, y0, args, t0, t1):
    """Central differences of the forward solve at tight tolerance, w.r.t. y0, args, t0, t1."""
    forward = jax.jit(lambda y0, args, t0, t1: loss(y0, args, t0, t1, "forward", **TIGHT))
    args_flat = jnp.stack(args)
    return (
        central_difference(lambda y: forward(y, args, t0, t1), y0),
        central_difference(lambda p: forward(y0, tuple(p), t0, t1), args_flat),
        central_difference(lambda t: forward(y0, args, t, t1), t0),
        central_difference(lambda t: forward(y0, args, t0, t), t1),
    )


def backsolve_gradients(loss, y0, args, t0, t1, adjoint, **kwargs):
    grad = jax.jit(jax.grad(lambda *x: loss(*x, adjoint, **kwargs), argnums=(0, 1, 2, 3)))
    g_y0, g_args, g_t0, g_t1 = grad(y0, args, jnp.asarray(t0), jnp.asarray(t1))
    return g_y0, jnp.stack(g_args), g_t0, g_t1


@pytest.mark.parametrize(
    "t_span, tols",
    [
        # Both with -m slow: the default run checks gradients w.r.t. y0, args, t0 and t1
        # against finite differences, over a backward span, in
        # test_forward_reconstruction_matches_finite_differences[backwards-window-4].
        pytest.param((0.0, 3.0), (1e-5, 1e-9), marks=pytest.mark.slow),
        pytest.param((3.0, 0.0), (1e-9,), marks=pytest.mark.slow),
    ],
    ids=["forwards", "backwards"],
)
def test_gradients_converge_to_finite_differences(t_span, tols):
    """Gradients w.r.t. y0, args, t0 and t1 approach central differences of a tight forward
    solve as the backward tolerance shrinks (also integrating backwards in time, t1 < t0)."""
    t0, t1 = map(jnp.asarray, t_span)
    expected = reference_gradients(final_loss, Y0, ARGS, t0, t1)
    errors = {}
    for tol in tols:
        actual = backsolve_gradients(
            final_loss, Y0, ARGS, t0, t1, BacksolveAdjoint(rtol=tol, atol=tol), **TIGHT
        )
        errors[tol] = max(relative_error(a, e) for a, e in zip(actual, expected, strict=True))
    # Measured: 1e-5 -> 1.0e-5, 1e-9 -> 2.2e-8 (the finite differences' own error).
    assert errors[1e-9] < 1e-6
    if 1e-5 in errors:
        assert errors[1e-5] < 1e-4
        assert errors[1e-9] < errors[1e-5] / 30


class Pendulum(eqx.Module):
    """Arguments as an equinox module: an array, a Python float and a static string."""

    stiffness: jax.Array
    damping: float
    label: str = eqx.field(static=True)

    def __call__(self, t, y, args):
        del args
        return jnp.stack([y[1], -self.stiffness * jnp.sin(y[0]) - self.damping * y[1]])


def test_module_arguments_and_closed_over_arrays():
    """Gradients reach the array leaves of a module passed as `args` and arrays closed over by
    `f`; the Python float leaf gets none."""
    forcing = jnp.array(0.3)

    def loss(model, forcing, adjoint, **kwargs):
        def f(t, y, model):
            return model(t, y, None) + jnp.stack([0.0 * forcing, forcing * jnp.cos(t)])

        sol = odeckpt.solve(f, Y0, (0.0, 2.0), model, adjoint=adjoint, **kwargs)
        return jnp.sum(sol.ys[-1] ** 2)

    model = Pendulum(jnp.array(1.3), 0.2, "pendulum")
    adjoint = BacksolveAdjoint(rtol=1e-10, atol=1e-10)
    grads = eqx.filter_jit(eqx.filter_grad(lambda mf: loss(*mf, adjoint, **TIGHT)))(
        (model, forcing)
    )
    g_model, g_forcing = grads
    assert g_model.damping is None and g_model.label == "pendulum"
    forward = jax.jit(lambda k, c: loss(Pendulum(k, 0.2, "pendulum"), c, "forward", **TIGHT))
    expected_k = central_difference(lambda k: forward(k, forcing), model.stiffness)
    expected_c = central_difference(lambda c: forward(model.stiffness, c), forcing)
    assert relative_error(g_model.stiffness, expected_k) < 1e-7
    assert relative_error(g_forcing, expected_c) < 1e-7


@pytest.mark.slow
def test_hundred_save_times():
    """A loss on 100 saved times: jumps in the adjoint at each, and d loss / d ts_i =
    <ct_i, f(ts_i, y(ts_i))> checked along a random direction of `ts`."""
    weights = jnp.asarray(np.random.default_rng(0).normal(size=(100, 2)))
    ts0 = jnp.linspace(0.1, 2.9, 100)

    def loss(y0, args, ts, adjoint, **kwargs):
        sol = odeckpt.solve(oscillator, y0, (0.0, 3.0), args, adjoint=adjoint, saveat=ts, **kwargs)
        return jnp.sum(weights * sol.ys) + jnp.sum(sol.ys[50:] ** 2)

    adjoint = BacksolveAdjoint(rtol=1e-10, atol=1e-10)
    grad = jax.jit(jax.grad(lambda *x: loss(*x, adjoint, **TIGHT), argnums=(0, 1, 2)))
    g_y0, g_args, g_ts = grad(Y0, ARGS, ts0)
    forward = jax.jit(lambda y0, args, ts: loss(y0, args, ts, "forward", **TIGHT))
    direction = jnp.asarray(np.random.default_rng(1).normal(size=100)) * 1e-3
    expected_y0 = central_difference(lambda y: forward(y, ARGS, ts0), Y0)
    expected_args = central_difference(lambda p: forward(Y0, tuple(p), ts0), jnp.stack(ARGS))
    expected_ts = central_difference(lambda e: forward(Y0, ARGS, ts0 + e * direction), 0.0)
    assert relative_error(g_y0, expected_y0) < 1e-7
    assert relative_error(jnp.stack(g_args), expected_args) < 1e-7
    assert relative_error(jnp.dot(g_ts, direction), expected_ts) < 1e-6


@pytest.mark.slow
def test_saved_steps():
    """A loss on `SaveAt(steps=True)`: the gradient with the step times held fixed, i.e. that of
    the same loss on `SaveAt(ts=<those times>)`."""
    saveat = odeckpt.SaveAt(steps=True)
    max_steps = 64

    def loss(y0, args, adjoint):
        sol = odeckpt.solve(
            oscillator,
            y0,
            (0.0, 3.0),
            args,
            adjoint=adjoint,
            saveat=saveat,
            max_steps=max_steps,
            rtol=1e-5,
            atol=1e-5,
        )
        ys = jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0)
        return jnp.sum(jnp.sin(ys)), sol.ts

    adjoint = BacksolveAdjoint(rtol=1e-10, atol=1e-10)
    (g_y0, g_args), step_ts = jax.jit(
        jax.grad(lambda *x: loss(*x, adjoint), argnums=(0, 1), has_aux=True)
    )(Y0, ARGS)
    step_ts = step_ts[jnp.isfinite(step_ts)]
    assert 5 < step_ts.shape[0] < max_steps

    @jax.jit
    def at_fixed_times(y0, args):
        sol = odeckpt.solve(oscillator, y0, (0.0, 3.0), args, saveat=step_ts, **TIGHT)
        return jnp.sum(jnp.sin(sol.ys))

    expected_y0 = central_difference(lambda y: at_fixed_times(y, ARGS), Y0)
    expected_args = central_difference(lambda p: at_fixed_times(Y0, tuple(p)), jnp.stack(ARGS))
    # The forward solve is at rtol=1e-5: the states saved there (which re-anchor the backward
    # solve) and hence the gradient are accurate to about that.
    assert relative_error(g_y0, expected_y0) < 1e-4
    assert relative_error(jnp.stack(g_args), expected_args) < 1e-4


def test_t1_gradient_is_cotangent_times_vector_field():
    weights = jnp.array([0.7, -1.9])

    def loss(t1):
        sol = odeckpt.solve(oscillator, Y0, (0.0, t1), ARGS, adjoint=BacksolveAdjoint())
        return jnp.dot(weights, sol.ys[-1]), sol.ys[-1]

    g_t1, y1 = jax.grad(loss, has_aux=True)(jnp.asarray(2.5))
    expected = jnp.dot(weights, oscillator(2.5, y1, ARGS))
    np.testing.assert_allclose(g_t1, expected, rtol=1e-13)


@pytest.mark.parametrize(
    "options",
    # With -m slow (backsolve's gradients per lane under vmap are checked by default in
    # test_faults.py, against the closed form).
    [
        pytest.param(dict(checkpoints=3), marks=pytest.mark.slow),
        pytest.param(dict(checkpoints=2, reconstruct="forward", window=4), marks=pytest.mark.slow),
    ],
    ids=["backward", "forward"],
)
def test_vmap_of_grad_equals_per_example_grads(options):
    """Gradients, and what `on_backward` reports: `jax.debug.callback` unrolls over a `vmap`,
    one call per batch element with that element's scalars, equal to the calls of the
    per-example gradients."""
    records = []
    adjoint = BacksolveAdjoint(**options, on_backward=records.append)

    def loss(y0, a):
        sol = odeckpt.solve(oscillator, y0, (0.0, 2.0), (a, ARGS[1]), adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2)

    y0s = jnp.array([[1.0, 0.5], [0.2, -0.3], [2.0, 1.0]])
    stiffnesses = jnp.array([1.3, 0.5, 4.0])
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1))))(y0s, stiffnesses)
    jax.effects_barrier()
    batched_records = list(records)
    records.clear()
    for i in range(3):
        single = grad(y0s[i], stiffnesses[i])
        np.testing.assert_allclose(batched[0][i], single[0], rtol=1e-8)
        np.testing.assert_allclose(batched[1][i], single[1], rtol=1e-8)
    jax.effects_barrier()
    assert len(batched_records) == 3 and len({r["num_backward_steps"] for r in records}) > 1
    # The counts are equal; the drift (a float) to rounding.
    counts = lambda r: tuple(v for k, v in r.items() if k != "max_drift")
    batched_records, records = sorted(batched_records, key=counts), sorted(records, key=counts)
    assert [counts(r) for r in batched_records] == [counts(r) for r in records]
    np.testing.assert_allclose([r["max_drift"] for r in batched_records],
                               [r["max_drift"] for r in records], rtol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_float32():
    def loss(y0, a, adjoint, dtype):
        sol = odeckpt.solve(
            oscillator,
            y0,
            (dtype(0.0), dtype(2.0)),
            (a, dtype(0.2)),
            adjoint=adjoint,
            rtol=1e-5,
            atol=1e-5,
        )
        return jnp.sum(sol.ys[-1] ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    g32 = grad(Y0.astype(jnp.float32), jnp.float32(1.3), BacksolveAdjoint(), jnp.float32)
    g64 = grad(Y0, jnp.float64(1.3), BacksolveAdjoint(rtol=1e-10, atol=1e-10), jnp.float64)
    assert g32[0].dtype == jnp.float32 and g32[1].dtype == jnp.float32
    assert relative_error(g32[0], g64[0]) < 1e-3
    assert relative_error(g32[1], g64[1]) < 1e-3


def lorenz(t, y, args):
    sigma, rho, beta = args
    return jnp.stack([sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]])


_LORENZ_ARGS = (jnp.array(10.0), jnp.array(28.0), jnp.array(8.0 / 3.0))


def _lorenz_loss(y0, args, adjoint, tol, throw=True):
    sol = odeckpt.solve(lorenz, y0, (0.0, 1.0), args, adjoint=adjoint, rtol=tol, atol=tol,
                        throw=throw)  # fmt: skip
    return jnp.sum(sol.ys[-1])


@pytest.mark.slow
def test_drift_on_a_chaotic_problem_fails_the_gradient_until_re_anchored():
    """Lorenz: integrated backwards, the dissipative directions expand (volume grows like
    exp(13.7 t)), so plain backsolve reconstructs `y0` thousands of tolerances away from the
    forward one (measured: 7.7e3 at rtol 1e-6) and its gradient is 2.3e-4 off: the backward
    solve fails (NaN, an error with `throw=True`) and says why. States re-anchored from the
    forward solve keep the drift small (measured: 2.6) and the gradient accurate."""
    y0 = jnp.array([1.0, 1.0, 1.0])
    # The forward-mode derivative of a very tight forward solve is the exact gradient.
    expected = jax.jacfwd(_lorenz_loss, argnums=(0, 1))(y0, _LORENZ_ARGS, "forward", 1e-12)
    expected = jnp.concatenate([expected[0], jnp.stack(expected[1])])
    records = []

    def gradient(throw=False, **options):
        adjoint = BacksolveAdjoint(**options, on_backward=records.append)
        fn = jax.jit(jax.grad(_lorenz_loss, argnums=(0, 1)), static_argnums=(2, 3, 4))
        g = fn(y0, _LORENZ_ARGS, adjoint, 1e-6, throw)
        jax.effects_barrier()
        return jnp.concatenate([g[0], jnp.stack(g[1])]), records[-1]

    g, record = gradient()
    assert np.all(np.isnan(g)) and not record["succeeded"] and record["max_drift"] > 1e3
    with pytest.raises(Exception, match="drifted from the forward solution by more than"):
        gradient(throw=True)
    # The limit is the user's: without it the drift's effect shows ...
    g, record = gradient(max_drift=math.inf)
    plain = relative_error(g, expected)
    assert record["succeeded"] and plain > 1e-4
    # ... and re-anchoring removes most of it (measured: 2.8e-6).
    g, record = gradient(throw=True, checkpoints=8)
    anchored = relative_error(g, expected)
    assert record["succeeded"] and record["max_drift"] < 10
    assert anchored < 1e-5 and anchored < plain / 20
    with pytest.raises(ValueError, match=r"max_drift=0.0\) must be positive. Fix: pass e.g."):
        BacksolveAdjoint(max_drift=0.0)


def test_dense_output_loss():
    """A loss on `sol.evaluate(t)`: the cotangent of each step's dense coefficients is pulled
    back to the step's start state and to `args`."""
    t_eval = jnp.linspace(0.05, 2.9, 7)

    def loss(y0, args, adjoint, **kwargs):
        sol = odeckpt.solve(
            oscillator,
            y0,
            (0.0, 3.0),
            args,
            adjoint=adjoint,
            saveat=odeckpt.SaveAt(dense=True),
            max_steps=256,
            **kwargs,
        )
        return jnp.sum(sol.evaluate(t_eval) ** 2)

    adjoint = BacksolveAdjoint(rtol=1e-11, atol=1e-11)
    g_y0, g_args = jax.jit(jax.grad(lambda *x: loss(*x, adjoint, **TIGHT), argnums=(0, 1)))(
        Y0, ARGS
    )
    forward = jax.jit(lambda y0, args: loss(y0, args, "forward", **TIGHT))
    expected_y0 = central_difference(lambda y: forward(y, ARGS), Y0)
    expected_args = central_difference(lambda p: forward(Y0, tuple(p)), jnp.stack(ARGS))
    assert relative_error(g_y0, expected_y0) < 1e-6
    assert relative_error(jnp.stack(g_args), expected_args) < 1e-6


def test_configuration_errors():
    with pytest.raises(ValueError, match="checkpoints"):
        BacksolveAdjoint(checkpoints=0)
    with pytest.raises(ValueError, match="rtol"):
        BacksolveAdjoint(rtol=-1.0)
    with pytest.raises(ValueError, match="error estimate"):
        odeckpt.solve(
            oscillator, Y0, (0.0, 1.0), ARGS, adjoint=BacksolveAdjoint(solver=odeckpt.RK4())
        )
    with pytest.raises(ValueError, match="both"):
        odeckpt.solve(
            oscillator,
            Y0,
            (0.0, 1.0),
            ARGS,
            solver="rk4",
            dt0=0.1,
            adjoint=BacksolveAdjoint(rtol=1e-6),
        )


@pytest.mark.slow
def test_constant_steps_and_forward_values():
    """After a constant-step RK4 solve the backward solve takes constant steps too; forward
    values are exactly those of `ForwardMode`."""
    kwargs = dict(solver="rk4", dt0=0.01, saveat=jnp.linspace(0.0, 2.0, 5))
    back = odeckpt.solve(oscillator, Y0, (0.0, 2.0), ARGS, adjoint=BacksolveAdjoint(), **kwargs)
    plain = odeckpt.solve(oscillator, Y0, (0.0, 2.0), ARGS, **kwargs)
    np.testing.assert_array_equal(back.ys, plain.ys)

    def loss(y0):
        sol = odeckpt.solve(oscillator, y0, (0.0, 2.0), ARGS, adjoint=BacksolveAdjoint(), **kwargs)
        return jnp.sum(sol.ys**2)

    forward = jax.jit(
        lambda y0: jnp.sum(odeckpt.solve(oscillator, y0, (0.0, 2.0), ARGS, **kwargs).ys ** 2)
    )
    np.testing.assert_allclose(jax.grad(loss)(Y0), central_difference(forward, Y0), rtol=1e-6)


def test_seminorm_leaves_the_parameter_integral_out_of_the_error():
    """The wrapped stepper's error estimate is zero on `g`, and its root mean square over all
    components equals the one over `(y, a)` alone."""
    from odeckpt._adjoints._backsolve._problem import Seminorm

    def augmented(s, z, args):
        y, a, g = z
        return -y, 2.0 * a, jnp.full_like(g, jnp.sum(a * y) * s)

    z = (jnp.array([1.0, 2.0]), jnp.array([0.5, -1.0]), jnp.ones(6))
    stepper = odeckpt.Tsit5()
    plain = stepper.step(augmented, 0.0, 0.3, z, None, augmented(0.0, z, None))
    semi = Seminorm(stepper).step(augmented, 0.0, 0.3, z, None, augmented(0.0, z, None))
    np.testing.assert_array_equal(semi.y1[0], plain.y1[0])
    np.testing.assert_array_equal(semi.y_error[2], 0.0)
    state_error = jnp.concatenate(plain.y_error[:2])
    all_error = jnp.concatenate(jax.tree.leaves(semi.y_error))
    np.testing.assert_allclose(jnp.mean(all_error**2), jnp.mean(state_error**2), rtol=1e-14)


@pytest.mark.slow
def test_seminorm_keeps_what_the_inner_step_reports():
    """A Newton failure (and the state to carry on rejection) of an implicit backward step
    survives the seminorm's rescaling of the error estimate."""
    from odeckpt._adjoints._backsolve._problem import Seminorm

    def augmented(s, z, args):
        y, a, g = z
        return -1e3 * y, a, jnp.sum(a) * jnp.ones_like(g)

    z = (jnp.array([1.0]), jnp.array([0.5]), jnp.ones(2))
    stepper = odeckpt.Kvaerno3(newton=odeckpt.Newton(max_iters=1, kappa=1e-12))
    inner = stepper.step(augmented, 0.0, 1.0, z, None, stepper.init(augmented, 0.0, z, None))
    semi = Seminorm(stepper).step(
        augmented, 0.0, 1.0, z, None, stepper.init(augmented, 0.0, z, None)
    )
    assert bool(inner.failed) and bool(semi.failed)
    assert jax.tree.structure(semi.state_on_reject) == jax.tree.structure(inner.state_on_reject)
    assert int(semi.num_fn_evals) == int(inner.num_fn_evals)


def test_jvp_is_rejected():
    def solve(y0):
        return odeckpt.solve(oscillator, y0, (0.0, 1.0), ARGS, adjoint=BacksolveAdjoint()).ys

    with pytest.raises(TypeError, match=r"adjoint='forward' \(ForwardMode\)"):
        jax.jvp(solve, (Y0,), (Y0,))


@pytest.mark.slow
def test_memory_is_flat_in_the_number_of_steps():
    """Compiled temporary memory of the gradient does not grow with the number of steps."""

    def temp_bytes(num_steps, checkpoints):
        def loss(y0):
            sol = odeckpt.solve(
                lambda t, y, args: -y + jnp.sin(t),
                y0,
                (0.0, 1.0),
                solver="rk4",
                dt0=1.0 / num_steps,
                max_steps=num_steps + 1,
                adjoint=BacksolveAdjoint(checkpoints=checkpoints),
            )
            return jnp.sum(sol.ys**2)

        compiled = jax.jit(jax.grad(loss)).lower(jnp.ones(1024)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    for checkpoints in (None, 4):
        assert temp_bytes(4000, checkpoints) == temp_bytes(500, checkpoints)


def test_forward_values_equal_forward_mode():
    saveat = odeckpt.SaveAt(ts=jnp.linspace(0.0, 3.0, 7), steps=True, dense=True, t1=True)
    kwargs = dict(solver="dopri5", saveat=saveat, max_steps=128)
    back = odeckpt.solve(
        oscillator, Y0, (0.0, 3.0), ARGS, adjoint=BacksolveAdjoint(checkpoints=3), **kwargs
    )
    plain = odeckpt.solve(oscillator, Y0, (0.0, 3.0), ARGS, adjoint="forward", **kwargs)
    # The stats differ only in what the gradient would keep: backsolve's 3 checkpoints.
    assert int(back.stats.num_checkpoints) == 3 and int(plain.stats.num_checkpoints) == 0
    back = eqx.tree_at(lambda s: s.stats.num_checkpoints, back, plain.stats.num_checkpoints)
    for actual, expected in zip(jax.tree.leaves(back), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.slow
def test_first_backward_step_ignores_the_parameter_integral():
    """Regression: the first backward step was chosen from the norm of the whole augmented
    state, where the parameter integral `g = 0` is measured against `atol` alone; with many
    parameters that step fell below float32 rounding of t and the backward solve stalled."""
    mlp = eqx.nn.MLP(4, 4, 64, 2, activation=jnp.tanh, key=jax.random.key(0))
    mlp = jax.tree.map(lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x, mlp)
    y0 = jnp.array([1.0, -0.5, 0.3, 0.8], jnp.float32)

    def loss(model, adjoint):
        sol = odeckpt.solve(
            lambda t, y, m: m(y), y0, (0.0, 1.0), model, adjoint=adjoint, rtol=1e-4, atol=1e-6
        )
        return jnp.sum(sol.ys[-1] ** 2)

    # The reference: the exact gradient of the discrete solve ("recursive" equals "direct",
    # test_adjoints.py, and compiles faster).
    grads = {
        adjoint: jax.tree.leaves(eqx.filter_grad(loss)(mlp, adjoint))
        for adjoint in ("recursive", "backsolve")
    }
    for ours, exact in zip(grads["backsolve"], grads["recursive"], strict=True):
        scale = float(jnp.max(jnp.abs(exact)))
        np.testing.assert_allclose(ours, exact, rtol=0, atol=2e-2 * scale)


@pytest.mark.parametrize(
    "t_span, window, checkpoints",
    [
        # The default run keeps the case that exercises the most (a backward span, stored
        # states and windows re-solved in turn); the others are the same check, `-m slow`.
        pytest.param((0.0, 3.0), 3, None, marks=pytest.mark.slow),
        ((3.0, 0.0), 4, 2),
        pytest.param((0.0, 3.0), 64, 2, marks=pytest.mark.slow),
    ],
    ids=["window-3", "backwards-window-4", "window-64"],
)
def test_forward_reconstruction_matches_finite_differences(t_span, window, checkpoints):
    """`reconstruct="forward"` reads `y(t)` from forward re-solves started at the stored states
    instead of integrating it backwards. A window shorter than the stretch between two stored
    states is re-solved for each further `window` steps (the re-solve reproduces its steps);
    save-time jumps, `t0`/`t1` gradients and a backward time span work as with `"backward"`."""
    ts = jnp.linspace(*t_span, 6)[1:-1]

    def loss(y0, args, t0, t1, adjoint, **kwargs):
        saveat = odeckpt.SaveAt(ts=ts, t1=True)
        sol = odeckpt.solve(oscillator, y0, (t0, t1), args, adjoint=adjoint, saveat=saveat,
                            **kwargs)  # fmt: skip
        return jnp.sum(sol.ys**2) + sol.ys[-1, 0]

    t0, t1 = map(jnp.asarray, t_span)
    expected = reference_gradients(loss, Y0, ARGS, t0, t1)
    adjoint = BacksolveAdjoint(
        rtol=1e-10, atol=1e-10, checkpoints=checkpoints, reconstruct="forward", window=window
    )
    actual = backsolve_gradients(loss, Y0, ARGS, t0, t1, adjoint, **TIGHT)
    # Measured: at most 8e-8 (the window's continuous extension and the finite differences).
    for a, e in zip(actual, expected, strict=True):
        assert relative_error(a, e) < 1e-6


def test_reconstruct_configuration():
    with pytest.raises(ValueError, match="reconstruct"):
        BacksolveAdjoint(reconstruct="interpolate")
    with pytest.raises(ValueError, match="window"):
        BacksolveAdjoint(window=0)


# Kvaerno5 by default: it is also the default run's backsolve with an implicit stepper.
@pytest.mark.parametrize("solver", slow_unless(["tsit5", "kvaerno5"], fast={"kvaerno5"}))
def test_without_the_seminorm(solver):
    """`seminorm=False` holds the parameter integral to the tolerances too, with `y`
    integrated backwards (Tsit5) or re-solved forwards (Kvaerno5): the closed form of
    `y' = -k y`."""

    def final(y0, k):
        adjoint = BacksolveAdjoint(seminorm=False)
        sol = odeckpt.solve(decay, y0, (0.0, 1.0), k, solver=solver, adjoint=adjoint,
                            rtol=1e-10, atol=1e-10)  # fmt: skip
        return sol.ys[-1]

    g_y0, g_k = jax.jit(jax.grad(final, argnums=(0, 1)))(1.5, 0.7)
    np.testing.assert_allclose([g_y0, g_k], [np.exp(-0.7), -1.5 * np.exp(-0.7)], rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# `on_backward`: what the backward solve did.


def decay(t, y, k):
    return -k * y


def recorded_gradient(loss, x, adjoint_options):
    """`jax.jit(jax.grad(loss))(x, adjoint)` with `on_backward` recording; returns the gradient
    and the dicts it was called with."""
    records = []
    adjoint = BacksolveAdjoint(**adjoint_options, on_backward=records.append)
    grad = jax.jit(jax.grad(loss), static_argnums=1)(x, adjoint)
    jax.effects_barrier()
    return grad, records


def test_on_backward_counts_constant_steps():
    """y' = -k y with RK4 steps of 0.05 on [0, 1] and saves on that grid: the backward solve
    retraces the forward grid, 20 steps, none rejected. The gradient of sum_i y(t_i) is the
    closed form sum_i -t_i exp(-k t_i) to RK4's accuracy."""
    ts = jnp.linspace(0.0, 1.0, 5)

    def loss(k, adjoint):
        sol = odeckpt.solve(decay, jnp.array(1.0), (0.0, 1.0), k, solver="rk4", dt0=0.05,
                            saveat=ts, adjoint=adjoint)  # fmt: skip
        return jnp.sum(sol.ys), sol.stats.num_steps

    records = []
    adjoint = BacksolveAdjoint(on_backward=records.append)
    g, forward_steps = jax.grad(loss, has_aux=True)(jnp.array(0.7), adjoint)
    jax.effects_barrier()
    assert int(forward_steps) == 20
    assert records == [
        {
            "num_backward_steps": 20,
            "num_accepted_backward_steps": 20,
            "num_rejected_backward_steps": 0,
            "num_window_solves": 0,
            "max_drift": 0.0,  # constant steps have no tolerances to measure it in
            "succeeded": True,
        }
    ]
    assert all(type(v) is int for k, v in records[0].items() if k.startswith("num_"))
    assert type(records[0]["succeeded"]) is bool
    # Measured: 2.5e-8 (RK4 at h = 0.05).
    assert relative_error(g, jnp.sum(-ts * jnp.exp(-0.7 * ts))) < 1e-7


@pytest.mark.parametrize("window", slow_unless([3, 5, 64], fast={3}))
def test_on_backward_counts_window_solves(window):
    """`reconstruct="forward"` over 20 constant steps re-solves `y` once per `window` steps of
    the backward solve: ceil(20 / window) times."""

    def loss(k, adjoint):
        sol = odeckpt.solve(decay, jnp.array(1.0), (0.0, 1.0), k, solver="rk4", dt0=0.05,
                            adjoint=adjoint)  # fmt: skip
        return sol.ys[-1]

    options = dict(reconstruct="forward", window=window)
    g, records = recorded_gradient(loss, jnp.array(0.7), options)
    resolves = math.ceil(20 / window)
    assert [(r["num_backward_steps"], r["num_window_solves"]) for r in records] == [(20, resolves)]
    np.testing.assert_allclose(g, -jnp.exp(-0.7), rtol=1e-7)


@pytest.mark.slow
def test_forward_reconstruction_with_a_save_at_t1():
    """Regression: with `reconstruct="forward"`, a save at `t1` is an event at the start of the
    backward solve, met before any window is filled; the first segment ran to `-inf` and the
    backward solve failed."""
    ts = jnp.linspace(0.0, 1.0, 5)

    def loss(k, adjoint):
        sol = odeckpt.solve(decay, jnp.array(1.0), (0.0, 1.0), k, saveat=ts, adjoint=adjoint,
                            **TIGHT)  # fmt: skip
        return jnp.sum(sol.ys)

    options = dict(reconstruct="forward", rtol=1e-10, atol=1e-10)
    g, records = recorded_gradient(loss, jnp.array(0.7), options)
    assert records[0]["succeeded"]
    assert relative_error(g, jnp.sum(-ts * jnp.exp(-0.7 * ts))) < 1e-8


@pytest.mark.slow
def test_on_backward_steps_grow_as_the_backward_tolerance_shrinks():
    """An adaptive backward solve takes more steps at a tighter tolerance: steps grow like
    tol^(-1/(q + 1)) with q = 4 the order of Tsit5's error estimate (measured: 12 steps at
    1e-6, 65 at 1e-10, slope 0.18). Passing `on_backward` leaves the gradient bitwise
    unchanged."""

    def loss(y0, adjoint):
        return final_loss(y0, ARGS, 0.0, 3.0, adjoint, **TIGHT)

    tols = [1e-6, 1e-10]
    steps = []
    for tol in tols:
        recorded, records = recorded_gradient(loss, Y0, dict(rtol=tol, atol=tol))
        (record,) = records
        assert record["succeeded"]
        assert record["num_backward_steps"] == (
            record["num_accepted_backward_steps"] + record["num_rejected_backward_steps"]
        )
        steps.append(record["num_accepted_backward_steps"])
    plain = jax.jit(jax.grad(loss), static_argnums=1)(Y0, BacksolveAdjoint(rtol=tol, atol=tol))
    np.testing.assert_array_equal(recorded, plain)
    assert 0 < steps[0] < steps[1]
    slope = np.log(steps[1] / steps[0]) / np.log(tols[0] / tols[1])
    assert 0.15 < slope < 0.25


def test_on_backward_reports_a_failed_backward_solve():
    """A backward tolerance the forward `max_steps` cannot meet: the one stretch stops after
    `max_steps` steps and `succeeded` is `False`; the gradient raises. (The report and the
    error are separate host callbacks; XLA on CPU runs the report first.)"""

    def loss(y0, adjoint):
        sol = odeckpt.solve(oscillator, y0, (0.0, 3.0), ARGS, adjoint=adjoint, rtol=1e-3,
                            atol=1e-3, max_steps=16)  # fmt: skip
        return jnp.sum(sol.ys[-1])

    records = []
    adjoint = BacksolveAdjoint(rtol=1e-12, atol=1e-12, on_backward=records.append)
    with pytest.raises(Exception, match=r"backward \(adjoint\) solve failed"):
        jax.block_until_ready(jax.jit(jax.grad(loss), static_argnums=1)(Y0, adjoint))
    jax.effects_barrier()
    assert [(r["num_backward_steps"], r["succeeded"]) for r in records] == [(16, False)]


@pytest.mark.slow
def test_on_backward_under_jacrev():
    """`jax.jacrev` maps the backward pass over the output rows: one call per row."""
    records = []
    adjoint = BacksolveAdjoint(on_backward=records.append)

    def final(y0):
        return odeckpt.solve(decay, y0, (0.0, 1.0), jnp.array(0.5), adjoint=adjoint).ys[-1]

    jac = jax.jit(jax.jacrev(final))(jnp.array([1.0, 2.0, 3.0]))
    jax.effects_barrier()
    np.testing.assert_allclose(jac, jnp.exp(-0.5) * jnp.eye(3), rtol=1e-6)
    assert len(records) == 3 and all(r["succeeded"] for r in records)


def test_on_backward_configuration():
    with pytest.raises(TypeError, match="not callable. Fix: pass a function"):
        BacksolveAdjoint(on_backward="print")

    class Unhashable:
        __hash__ = None

        def __call__(self, stats):
            pass

    with pytest.raises(TypeError, match="not hashable"):
        BacksolveAdjoint(on_backward=Unhashable())
