"""`odeckpt.ensemble`: the fused kernel (in Pallas' interpret mode on CPU) takes the steps of
`jax.vmap(solve)` lane by lane, fails lane by lane, and differentiates the discrete solve.

The fused cases share one worker (`xdist_group`) and, where they can, one compiled kernel: the
same shapes and options in every test that runs the forward kernel.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt
from odeckpt._ensemble import fused_call

pytestmark = pytest.mark.xdist_group("ensemble")

TS = np.linspace(0.0, 1.0, 6)  # the span's two ends among them
MAX_STEPS = 1000
BASE = np.array([10.0, 28.0, 8 / 3, 1.0, np.inf])


def lorenz(t, y, args):
    """Lorenz's system, sped up by `args[3]` (a lane's speed sets its number of steps), NaN
    after the time `args[4]`."""
    sigma, rho, beta, speed, poison = args[0], args[1], args[2], args[3], args[4]
    dy = jnp.stack([sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]])
    return jnp.where(t > poison, jnp.nan, speed) * dy


def _params(n: int, dtype=np.float64) -> np.ndarray:
    spread = np.random.default_rng(0).uniform(-0.1, 0.1, (n, 5))
    spread[:, 3:] = 0
    return (BASE * (1 + spread)).astype(dtype)


def _y0(n: int, dtype=np.float64) -> np.ndarray:
    return np.tile(np.array([1.0, 0.0, 0.0], dtype), (n, 1))


def _mixed():
    """Eight trajectories: three ordinary ones, one whose `f` turns NaN at t = 0.5, one with a
    NaN parameter (`f(t0, y0)` is NaN), one with an infinite `y0`, one twenty times faster (runs
    out of steps), one twenty times slower (a few steps)."""
    params, y0 = _params(8), _y0(8)
    params[3, 4] = 0.5
    params[4, 0] = np.nan
    y0[5, 1] = np.inf
    params[6, 3] = 20.0
    params[7, 3] = 0.05
    return y0, params


def _solve(y0, params, backend, **keywords):
    keywords = dict(rtol=1e-8, atol=1e-8, saveat=TS, max_steps=MAX_STEPS, throw=False) | keywords
    return odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, backend=backend, **keywords)


def _same_steps(sol, ref, lanes=slice(None)):
    for name in ("num_steps", "num_accepted_steps", "num_rejected_steps", "num_fn_evals"):
        ours, theirs = getattr(sol.stats, name), getattr(ref.stats, name)
        np.testing.assert_array_equal(ours[lanes], theirs[lanes], name)


def test_lanes_fail_beside_lanes_that_succeed():
    y0, params = _mixed()
    sol, ref = _solve(y0, params, "fused"), _solve(y0, params, "vmap")
    S = odeckpt.Status
    expected = [S.successful] * 3 + [S.nonfinite, S.nonfinite_f0, S.nonfinite_y0]
    expected += [S.max_steps_reached, S.successful]
    for lane, status in enumerate(expected):
        assert sol.status[lane] == status, lane
    np.testing.assert_array_equal(sol.status == S.successful, ref.status == S.successful)
    # Lane 3 shrinks its steps against t = 0.5 until they underflow: whether a stage time is
    # past 0.5 is decided in its last bit, which XLA:CPU's fused multiply-adds round
    # differently in the two programs (with `XLA_FLAGS=--xla_cpu_max_isa=AVX` both take 171
    # steps); the others take the same steps.
    _same_steps(sol, ref, np.array([0, 1, 2, 4, 5, 6, 7]))
    assert abs(int(sol.stats.num_steps[3]) - int(ref.stats.num_steps[3])) <= 4
    steps = np.asarray(sol.stats.num_accepted_steps)
    assert steps[7] < 20 < 100 < steps[0] and steps[6] + sol.stats.num_rejected_steps[6] == 1000
    np.testing.assert_allclose(sol.ys, ref.ys, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(sol.ts, ref.ts)


def test_throw_names_the_failed_trajectories():
    y0, params = _mixed()
    with pytest.raises(
        eqx.EquinoxRuntimeError, match=r"4 of 8 trajectories failed \(trajectory 3, 4, 5, 6\)"
    ):
        _solve(y0, params, "fused", throw=True)
    sol = _solve(y0[:3], params[:3], "fused", throw=True)  # all succeed: no error
    assert bool(jnp.all(sol.status == odeckpt.Status.successful))


def test_under_jit_a_failure_raises_with_its_message():
    y0, params = _mixed()
    run = jax.jit(lambda p: _solve(y0, p, "fused", throw=True).ys)
    expected = r"Lane 3 of 8 failed \(the first of 4 failing lanes\): A step produced non-finite"
    with pytest.raises(Exception, match=expected + r".*the lane is the trajectory"):
        jax.block_until_ready(run(params))


STEPPERS = [
    ("tsit5", np.float64),
    ("dopri5", np.float64),
    ("dopri8", np.float64),
    ("bosh3", np.float64),
    ("rk4", np.float64),
    ("tsit5", np.float32),
    ("dopri5", np.float32),
]


@pytest.mark.parametrize(
    "solver, dtype", slow_unless(STEPPERS, [("tsit5", np.float64), ("bosh3", np.float32)])
)
def test_each_stepper_takes_the_steps_of_vmap_solve(solver, dtype):
    params, y0 = _params(8, dtype), _y0(8, dtype)
    keywords = dict(solver=solver)
    if solver == "rk4":
        keywords |= dict(dt0=0.01, controller=odeckpt.ConstantStep())
    if solver == "bosh3" or dtype == np.float32:
        keywords |= dict(rtol=1e-5, atol=1e-6)
    sol, ref = _solve(y0, params, "fused", **keywords), _solve(y0, params, "vmap", **keywords)
    assert bool(jnp.all(sol.status == odeckpt.Status.successful))
    assert sol.ys.dtype == dtype
    if dtype == np.float64:
        _same_steps(sol, ref)
        np.testing.assert_allclose(sol.ys, ref.ys, rtol=1e-12, atol=1e-12)
        return
    # Two programs round float32 differently in the last bit (XLA fuses and reduces them
    # differently); at rtol = 1e-5, a hundred ulps, an error norm at the boundary of
    # acceptance can then go either way: a few steps more or fewer, the same accuracy.
    steps = np.asarray(sol.stats.num_steps) - np.asarray(ref.stats.num_steps)
    assert np.all(np.abs(steps) <= 3), steps
    np.testing.assert_allclose(sol.ys, ref.ys, rtol=1e-4, atol=1e-4)


def _loss(backend, lanes=slice(None)):
    def loss(params, y0):
        sol = _solve(y0, params, backend)
        return jnp.sum(sol.ys[lanes, -1] ** 2)

    return loss


def test_gradient_equals_vmap_and_finite_differences_and_is_nan_where_a_lane_failed():
    y0, params = _mixed()
    grad = np.asarray(jax.grad(_loss("fused"))(params, y0))
    ref = np.asarray(jax.grad(_loss("vmap"))(params, y0))
    ok = [0, 1, 2, 7]
    assert np.all(np.isfinite(grad[ok])) and np.all(np.isnan(grad[[3, 4, 5, 6]]))
    np.testing.assert_allclose(grad[ok], ref[ok], rtol=1e-9)
    # Central differences of the fused forward solve (the kernel compiled above).
    loss = _loss("fused", np.array(ok))
    for lane, k in [(0, 0), (2, 1), (7, 2)]:
        h = 1e-6 * abs(params[lane, k])
        up, down = params.copy(), params.copy()
        up[lane, k] += h
        down[lane, k] -= h
        difference = (loss(jnp.asarray(up), y0) - loss(jnp.asarray(down), y0)) / (2 * h)
        scale = np.abs(grad[lane]).max()  # differences of adaptive solves: noise ~1e-7 of it
        np.testing.assert_allclose(grad[lane, k], difference, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.slow
def test_jacobians_in_y0_and_shared_args_forward_and_reverse():
    params, y0 = _params(4), _y0(4)
    shared, own = params[0, :2], params[:, 2:]

    def final(y0, shared, own):
        args = (shared, own)
        sol = odeckpt.ensemble(
            lambda t, y, a: lorenz(t, y, jnp.concatenate([a[0], a[1]])), y0, (0.0, 1.0), args,
            args_axes=(None, 0), rtol=1e-8, atol=1e-8, backend=backend,
        )  # fmt: skip
        return sol.ys[:, -1]

    backend = "fused"
    forward = jax.jacfwd(final, argnums=(0, 1, 2))(y0, shared, own)
    reverse = jax.jacrev(final, argnums=(0, 1, 2))(y0, shared, own)
    backend = "vmap"
    ref = jax.jacrev(final, argnums=(0, 1, 2))(y0, shared, own)
    for a, b, c in zip(forward, reverse, ref, strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(b, c, rtol=1e-8, atol=1e-10)


@pytest.mark.slow
def test_gradient_agrees_with_forward_sensitivity():
    params, y0 = _params(4), _y0(4)
    grad = jax.grad(_loss("fused"))(params, y0)

    def one(p, y):
        sol = odeckpt.solve(
            lorenz, y, (0.0, 1.0), p, rtol=1e-8, atol=1e-8, saveat=TS,
            adjoint=odeckpt.ForwardSensitivity(),
        )  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    ref = jax.vmap(jax.grad(one))(params, y0)
    np.testing.assert_allclose(grad, ref, rtol=1e-5)


def test_times_are_not_differentiated_by_the_kernel():
    params, y0 = _params(2), _y0(2)

    def final(t1):
        return odeckpt.ensemble(lorenz, y0, (0.0, t1), params, backend="fused").ys

    with pytest.raises(ValueError, match="not the times"):
        jax.jvp(final, (1.0,), (1.0,))


@pytest.mark.parametrize(
    "keywords, reason",
    [
        (dict(solver="kvaerno5"), "Newton"),
        (dict(event=odeckpt.Event(lambda t, y, args: y[0])), "root finder"),
        (dict(saveat=odeckpt.SaveAt(dense=True)), "max_steps rows"),
    ],
)
def test_what_the_kernel_cannot_run_is_refused_with_the_reason(keywords, reason):
    params, y0 = _params(2), _y0(2)
    with pytest.raises(ValueError, match=reason):
        odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, backend="fused", **keywords)
    # "auto" takes the vmap path instead (on any machine).
    sol = odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, backend="auto", **keywords)
    assert sol.status.shape == (2,)


def test_complex_states_are_refused_by_the_kernel():
    y0 = jnp.ones((2, 2), jnp.complex128)
    with pytest.raises(ValueError, match="complex128"):
        odeckpt.ensemble(lambda t, y, a: -1j * y, y0, (0.0, 1.0), backend="fused")


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: odeckpt.ensemble(lorenz, _y0(2), (0.0, 1.0), _params(3)), "2 trajectories"),
        (
            lambda: odeckpt.ensemble(lorenz, (_y0(2), _y0(3)), (0.0, 1.0), _params(2)),
            "leading axis",
        ),
        (lambda: odeckpt.ensemble(lorenz, _y0(2), (0.0, 1.0), _params(2), args_axes=1), "move"),
        (lambda: odeckpt.ensemble(lorenz, _y0(2), (0.0, 1.0), _params(2), backend="gpu"), "auto"),
        (
            lambda: odeckpt.ensemble(
                lorenz, _y0(2), (0.0, 1.0), _params(2), backend="fused", lanes_per_block=3
            ),
            "power of two",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_zero_length_span_and_auto_on_cpu():
    params, y0 = _params(4), _y0(4)
    sol = odeckpt.ensemble(lorenz, y0, (0.5, 0.5), params, backend="fused", saveat=[0.5, 0.5])
    np.testing.assert_array_equal(sol.ys, np.stack([y0, y0], axis=1))
    assert np.all(np.asarray(sol.stats.num_steps) == 0)
    auto = odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, rtol=1e-8, atol=1e-8)
    fused = odeckpt.ensemble(lorenz, y0, (0.0, 1.0), params, rtol=1e-8, atol=1e-8,
                             backend="fused")  # fmt: skip
    np.testing.assert_allclose(auto.ys, fused.ys, rtol=1e-12)


KEYWORDS = dict(
    solver=odeckpt.Tsit5(), rtol=1e-6, atol=1e-8, dt0=None, controller=None, saveat=TS,
    max_steps=MAX_STEPS, event=None,
)  # fmt: skip


def _lowered_for_gpu(function, *args):
    return jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_kernel_and_its_derivative_lower_for_triton(dtype):
    """Pallas' Triton backend lowers the kernel on a machine without a GPU: every operation in
    it has a Triton form (lane vectors of power-of-two sizes, no weak types)."""
    params, y0 = _params(256, dtype), _y0(256, dtype)
    axes = jax.tree.broadcast(0, params)

    def final(params):
        call = fused_call(
            lorenz, y0, (0.0, 1.0), params, axes, KEYWORDS,
            throw=False, backend="fused", lanes_per_block=128, platform="gpu",
        )  # fmt: skip
        return call().ys

    text = _lowered_for_gpu(final, params).as_text()
    assert "triton" in text.lower()
    if dtype == np.float32:
        gradient = jax.grad(lambda p: jnp.sum(final(p)[:, -1] ** 2))
        assert "triton" in _lowered_for_gpu(gradient, params).as_text().lower()


def _scaled_loss(c, backend, y0, params):
    """A loss of an ensemble whose vector field closes over `c`."""
    field = lambda t, y, args: c * lorenz(t, y, args)
    sol = odeckpt.ensemble(
        field, y0, (0.0, 1.0), params, rtol=1e-8, atol=1e-8, saveat=TS, backend=backend
    )
    return jnp.sum(sol.ys[:, -1] ** 2)


def test_derivatives_reach_the_values_the_vector_field_closes_over():
    params, y0 = _params(4), _y0(4)
    fused = jax.jit(jax.grad(_scaled_loss), static_argnums=1)(1.0, "fused", y0, params)
    ref = jax.grad(_scaled_loss)(1.0, "vmap", y0, params)
    assert float(ref) != 0
    np.testing.assert_allclose(fused, ref, rtol=1e-9)


@pytest.mark.slow
def test_a_module_vector_field_is_differentiated_in_its_arrays():
    params, y0 = _params(4), _y0(4)

    class Scaled(eqx.Module):
        c: jax.Array

        def __call__(self, t, y, args):
            return self.c * lorenz(t, y, args)

    def loss(field, backend):
        sol = odeckpt.ensemble(field, y0, (0.0, 1.0), params, backend=backend)
        return jnp.sum(sol.ys[:, -1] ** 2)

    field = Scaled(jnp.array(1.0))
    fused = eqx.filter_grad(lambda m: loss(m, "fused"))(field).c
    ref = eqx.filter_grad(lambda m: loss(m, "vmap"))(field).c
    np.testing.assert_allclose(fused, ref, rtol=1e-9)


def test_second_derivatives_are_refused_with_the_fix():
    params, y0 = _params(2), _y0(2)
    with pytest.raises(ValueError, match="second derivative.*backend='vmap'"):
        jax.hessian(_scaled_loss)(1.0, "fused", y0, params)
