"""Tolerances, `dt0` and PID settings as traced values (one compile for many values) and per
leaf; bad ones rejected with the fix, at call time or, when traced, as a run-time status."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt


def decay(t, y, args):
    return -y


def exact_error(rtol, atol=1e-10):
    sol = odeckpt.solve(decay, jnp.array([1.0, 2.0]), (0.0, 2.0), rtol=rtol, atol=atol)
    return jnp.max(jnp.abs(sol.ys[-1] - jnp.array([1.0, 2.0]) * jnp.exp(-2.0))), sol


def test_traced_rtol_compiles_once_and_controls_the_error():
    solve = jax.jit(lambda rtol: exact_error(rtol)[0])
    errors = [float(solve(rtol)) for rtol in (1e-3, 1e-5, 1e-7, 1e-9)]
    assert solve._cache_size() == 1
    # Tsit5's error falls with the tolerance, by at least a factor 10 per 100x tighter rtol.
    assert all(b < a / 10 for a, b in zip(errors, errors[1:], strict=False))
    # The same numbers as with the tolerance known at trace time.
    assert errors[1] == pytest.approx(float(exact_error(1e-5)[0]), rel=1e-12)


@pytest.mark.parametrize("solver", ["radau", pytest.param("bdf", marks=pytest.mark.slow)])
def test_traced_rtol_with_the_steppers_that_propose_their_steps(solver):
    """Radau5 and BDF take the solve's tolerances for their own step-size proposal too: traced,
    one compile serves every value, the error falls with it, and a bad one is a status."""
    solve = jax.jit(
        lambda rtol: odeckpt.solve(
            decay,
            jnp.array([1.0, 2.0]),
            (0.0, 2.0),
            rtol=rtol,
            atol=1e-2 * rtol,
            solver=solver,
            throw=False,
        )  # fmt: skip
    )
    exact = np.array([1.0, 2.0]) * np.exp(-2.0)
    errors = [float(np.max(np.abs(solve(rtol).ys[-1] - exact))) for rtol in (1e-4, 1e-6, 1e-8)]
    assert solve._cache_size() == 1
    assert all(b < a / 10 for a, b in zip(errors, errors[1:], strict=False)), errors
    assert solve(-1.0).status == odeckpt.Status.invalid_settings


def test_tolerances_dt0_and_pid_gains_traced_together():
    def final(rtol, atol, dt0, pcoeff, icoeff):
        controller = odeckpt.PIDController(pcoeff=pcoeff, icoeff=icoeff, factormax=5.0)
        sol = odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), rtol=rtol, atol=atol, dt0=dt0,
                            controller=controller)  # fmt: skip
        return sol.ys[-1, 0], sol.stats["num_steps"]

    solve = jax.jit(final)
    pi = solve(1e-6, 1e-9, 0.01, 0.4, 0.3)
    i = solve(1e-8, 1e-10, 0.001, 0.0, 1.0)
    assert solve._cache_size() == 1
    for y, _ in (pi, i):
        assert float(y) == pytest.approx(np.exp(-1.0), rel=1e-5)
    # Known gains give the same steps as traced ones.
    controller = odeckpt.PIDController(pcoeff=0.4, icoeff=0.3, factormax=5.0)
    known = odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), rtol=1e-6, atol=1e-9, dt0=0.01,
                          controller=controller)  # fmt: skip
    assert int(known.stats.num_steps) == int(pi[1])


def test_array_tolerances_compile_once_outside_jit():
    # Arrays (not Python floats) are inputs of the compiled solve, not constants.
    y0 = jnp.array([1.0, 2.0])
    solves = [odeckpt.solve(decay, y0, (0.0, 1.0), rtol=jnp.asarray(r)) for r in (1e-4, 1e-6)]
    assert int(solves[1].stats.num_steps) > int(solves[0].stats.num_steps)
    before = odeckpt._solve._solve._cached._cache_size()  # the filter_jit's compiled cache
    odeckpt.solve(decay, y0, (0.0, 1.0), rtol=jnp.asarray(1e-7))
    assert odeckpt._solve._solve._cached._cache_size() == before


# With -m slow: traced tolerances under `vmap` run by default in
# test_vmap_over_tolerances_with_one_invalid_lane.
@pytest.mark.slow
def test_vmap_over_rtol():
    errors, sols = jax.vmap(exact_error)(jnp.array([1e-4, 1e-8]))
    assert errors[1] < errors[0] / 100
    assert np.all(np.asarray(sols.status == odeckpt.Status.successful))


def two_rates(t, y, args):
    return jnp.array([-1.0, -10.0]) * y


def test_atol_per_component_is_scale_invariant():
    # Scaling a component by s and its atol by s leaves the scaled errors, hence the steps, the
    # same (the mixed error norm is invariant); one atol for both components would not.
    scale = 2.0**-20
    atol = jnp.array([1e-6, 1e-6 * scale])
    small = odeckpt.solve(two_rates, jnp.array([1.0, scale]), (0.0, 1.0), rtol=1e-3, atol=atol)
    unit = odeckpt.solve(two_rates, jnp.array([1.0, 1.0]), (0.0, 1.0), rtol=1e-3, atol=1e-6)
    assert int(small.stats.num_steps) == int(unit.stats.num_steps)
    np.testing.assert_allclose(small.ys[-1, 1] / scale, unit.ys[-1, 1], rtol=1e-12)
    # With one atol, the small fast component no longer steers the steps: fewer of them, and
    # a relative error on it far above the tolerance's.
    uniform = odeckpt.solve(two_rates, jnp.array([1.0, scale]), (0.0, 1.0), rtol=1e-3, atol=1e-6)
    relative_error = lambda s: abs(float(s.ys[-1, 1]) / (scale * np.exp(-10.0)) - 1)
    assert int(uniform.stats.num_steps) < int(small.stats.num_steps)
    assert relative_error(uniform) > 10 * relative_error(small)


def test_tolerance_pytree_per_leaf():
    y0 = {"big": jnp.ones(3), "small": jnp.full(2, 1e-6)}
    f = lambda t, y, args: jax.tree.map(lambda x: -x, y)
    atol = {"big": 1e-3, "small": jnp.array([1e-12, 1e-12])}
    sol = odeckpt.solve(f, y0, (0.0, 1.0), rtol=1e-3, atol=atol)
    np.testing.assert_allclose(sol.ys["small"][-1], 1e-6 * np.exp(-1.0), rtol=1e-3)
    traced = jax.jit(lambda a: odeckpt.solve(f, y0, (0.0, 1.0), rtol=1e-3, atol=a).ys)(atol)
    np.testing.assert_allclose(traced["small"], sol.ys["small"], rtol=1e-12)


@pytest.mark.slow
def test_per_leaf_tolerances_with_implicit_stepper_and_backsolve():
    # Newton and the backward solve use one tolerance (the tightest): the gradient still matches.
    y0 = jnp.array([1.0, 0.5])
    atol = jnp.array([1e-8, 1e-10])

    def loss(k, adjoint, solver):
        sol = odeckpt.solve(lambda t, y, k: -k * y, y0, (0.0, 1.0), args=k, rtol=1e-8,
                            atol=atol, adjoint=adjoint, solver=solver)  # fmt: skip
        return jnp.sum(sol.ys[-1])

    exact = -np.sum(np.asarray(y0) * np.exp(-2.0))  # d/dk sum(y0 exp(-k)) at k = 2
    for adjoint, solver in (("backsolve", "tsit5"), ("recursive", "kvaerno5")):
        assert float(jax.grad(loss)(2.0, adjoint, solver)) == pytest.approx(exact, rel=1e-5)


@pytest.mark.parametrize(
    "bad, message",
    [
        (float("nan"), "invalid"),
        pytest.param(0.0, "invalid", marks=pytest.mark.slow),
        pytest.param(-1e-6, "invalid", marks=pytest.mark.slow),
    ],
)
def test_invalid_traced_tolerance_is_a_status(bad, message):
    run = jax.jit(lambda r: odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), rtol=r, throw=False))
    sol = run(bad)
    assert sol.status == odeckpt.Status.invalid_settings
    assert int(sol.stats.num_steps) == 0 and message in sol.status.message
    # With throw=True it raises; its gradient is NaN under throw=False.
    with pytest.raises(Exception, match="traced value is invalid"):
        # On a GPU the error arrives with the result, when it is waited for.
        ys = jax.jit(lambda r: odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), rtol=r).ys)(bad)
        jax.block_until_ready(ys)
    final = lambda y, r: odeckpt.solve(decay, y, (0.0, 1.0), rtol=r, throw=False).ys[-1, 0]
    grad = jax.jit(jax.grad(final))(jnp.array([1.0]), bad)
    assert np.isnan(grad).all()


def test_invalid_traced_pid_setting_is_a_status():
    def run(safety):
        controller = odeckpt.PIDController(safety=safety)
        return odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), controller=controller,
                             throw=False).status  # fmt: skip

    assert jax.jit(run)(0.9) == odeckpt.Status.successful
    assert jax.jit(run)(1.5) == odeckpt.Status.invalid_settings


def test_vmap_over_tolerances_with_one_invalid_lane():
    run = lambda r: odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), rtol=r, throw=False)
    sols = jax.vmap(run)(jnp.array([1e-6, jnp.nan]))
    assert np.asarray(sols.status == odeckpt.Status.invalid_settings).tolist() == [False, True]
    assert float(sols.ys[0, -1, 0]) == pytest.approx(np.exp(-1.0), rel=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"rtol": "1e-6"}, TypeError, "must be a number"),
        ({"atol": True}, TypeError, "must be a number"),
        ({"rtol": 0.0}, ValueError, "positive and finite"),
        ({"atol": float("inf")}, ValueError, "positive and finite"),
        ({"rtol": jnp.array([1e-6, 1e-6, 1e-6])}, ValueError, "shape"),
        ({"atol": [1e-6, 1e-8]}, ValueError, "pytree structure"),
        ({"atol": jnp.array([1e-6, -1.0])}, ValueError, "positive and finite"),
        ({"rtol": 1e-6 + 1j}, TypeError, "real number"),
        ({"dt0": "0.1"}, TypeError, "real number"),
    ],
)
def test_bad_tolerances_raise_with_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        odeckpt.solve(decay, jnp.array([1.0, 2.0]), (0.0, 1.0), **kwargs)
    assert "Fix" in str(info.value)


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"rtol": "1e-6"}, "must be a number"),
        ({"pcoeff": float("nan")}, "must be finite"),
        ({"safety": 1.5}, r"\(0, 1\]"),
        ({"factormin": 2.0}, "factormin"),
        ({"dtmin": -1.0}, "positive"),
        ({"pcoeff": "0.3"}, r"PIDController\(pcoeff='0.3'\) must be a number"),
        ({"pcoeff": jnp.full(2, 0.3)}, r"shape \(2,\); it must be one number"),
        ({"safety": jnp.full(2, 0.9)}, r"PIDController\(safety=...\) has shape"),
        ({"dtmax": np.ones((1, 1))}, "must be one number"),
    ],
)
def test_bad_pid_settings_raise_at_construction(settings, match):
    with pytest.raises((TypeError, ValueError), match=match) as info:
        odeckpt.PIDController(**settings)
    assert "Fix: pass e.g. PIDController(" in str(info.value)


def test_traced_pid_gains_of_the_wrong_shape_raise_with_the_fix():
    def run(pcoeff):
        controller = odeckpt.PIDController(pcoeff=pcoeff, icoeff=0.3)
        return odeckpt.solve(decay, jnp.array([1.0]), (0.0, 1.0), controller=controller).ys

    with pytest.raises(ValueError, match=r"Fix: pass e.g. PIDController\(pcoeff=0.4\)"):
        jax.jit(run)(jnp.full(2, 0.4))


def test_rtol_below_the_dtype_resolution_warns():
    y0 = jnp.array([1.0, 2.0], jnp.float32)
    with pytest.warns(UserWarning, match="below the resolution of float32.*jax_enable_x64"):
        odeckpt.solve(decay, y0, (0.0, 1.0), rtol=1e-9, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        odeckpt.solve(decay, y0, (0.0, 1.0), rtol=1e-5, atol=1e-6)
        odeckpt.solve(decay, y0.astype(jnp.float64), (0.0, 1.0), rtol=1e-12)


def test_a_tolerance_that_underflows_in_the_state_precision_is_refused():
    y0 = jnp.ones(1, jnp.float32)
    with pytest.raises(ValueError, match="atol=1e-300 underflows to 0 in float32"):
        odeckpt.solve(lambda t, y, args: -y, y0, (0.0, 1.0), atol=1e-300)
