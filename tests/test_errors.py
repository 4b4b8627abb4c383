"""Bad input raises at call time with the fix in the message."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

decay = lambda t, y, args: -y
y0 = jnp.ones(3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(y0=jnp.array([1.0, jnp.nan])), ValueError, "NaN or inf"),
        (dict(y0=jnp.array([1, 2])), TypeError, "dtype=float"),
        (dict(y0=np.array([1, 2], dtype=np.int32)), TypeError, "floating or complex"),
        (dict(y0={"a": "text"}), TypeError, "pytree of arrays"),
        (dict(f=lambda t, y, a: {"y": y}), ValueError, "structure"),
        (dict(f=lambda t, y, a: y[:2]), ValueError, "shape"),
        (dict(f=lambda t, y, a: y.astype(jnp.float32)), ValueError, "dtype"),
        (dict(saveat=jnp.array([0.5, 0.2])), ValueError, "sorted"),
        (dict(saveat=jnp.array([0.5, 1.5])), ValueError, "within"),
        (dict(rtol=0.0), ValueError, "rtol=0.0 must be positive"),
        (dict(atol=-1e-8), ValueError, "atol"),
        (dict(dt0=-0.1), ValueError, "sign of t1 - t0"),
        (dict(dt0=0.0), ValueError, "non-zero dt0"),
        (dict(controller=odeckpt.ConstantStep()), ValueError, "dt0="),
        (dict(solver="rk45"), ValueError, "dopri5"),
        (dict(solver=object()), TypeError, "Tsit5"),
        (dict(adjoint="magic"), ValueError, "forward"),
        (dict(solver="rk4"), ValueError, "dt0="),
        (dict(solver="rk4", controller=odeckpt.PIDController()), ValueError, "ConstantStep"),
        (dict(max_steps=0), ValueError, "positive int"),
        (dict(t_span=(0.0,)), ValueError, "pair"),
        (dict(t_span=(jnp.zeros(2), 1.0)), ValueError, "scalars"),
        (dict(controller="pid"), TypeError, "PIDController"),
        (dict(t_span=(jnp.nan, 1.0)), ValueError, "t0 is NaN or inf"),
        (dict(t_span=(0.0, float("nan"))), ValueError, "t1 is NaN or inf"),
        (dict(t_span=(0.0, np.inf)), ValueError, "t1 is NaN or inf"),
        (dict(saveat=jnp.array([0.2, jnp.nan])), ValueError, "must be finite"),
        (dict(y0=jnp.ones(3, jnp.float16)), TypeError, "float16, too coarse"),
        (dict(y0=jnp.ones(3, jnp.bfloat16)), TypeError, "bfloat16, too coarse"),
        (dict(rtol="1e-6"), TypeError, "must be a number. Fix: pass e.g. rtol=1e-6"),
        (dict(atol="x"), TypeError, "must be a number"),
        (dict(dt0="0.1"), TypeError, "must be a real number. Fix: pass e.g. dt0="),
        (dict(rtol=np.array([1e-6, 1e-6])), ValueError, r"must have shape \(\) or \(3,\)"),
        (dict(dt0=float("nan")), ValueError, "dt0=nan is not finite"),
    ],
)
def test_bad_input(kwargs, error, match):
    call = dict(f=decay, y0=y0, t_span=(0.0, 1.0)) | kwargs
    f, state, t_span = call.pop("f"), call.pop("y0"), call.pop("t_span")
    with pytest.raises(error, match=match):
        odeckpt.solve(f, state, t_span, **call)


def test_numpy_integers_are_counts():
    sol = odeckpt.solve(
        decay, y0, (0.0, 1.0), max_steps=np.int64(100),
        adjoint=odeckpt.RecursiveCheckpointAdjoint(checkpoints=np.int32(4)),
    )  # fmt: skip
    assert sol.status == odeckpt.Status.successful
    assert int(sol.stats.num_checkpoints) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NumPy integer in a static field warns
        adjoint = odeckpt.BacksolveAdjoint(checkpoints=np.int64(4), window=np.int32(8))
    assert type(adjoint.checkpoints) is int and type(adjoint.window) is int
    sol = odeckpt.solve(decay, y0, (0.0, 1.0), adjoint=adjoint)
    assert int(sol.stats.num_checkpoints) == 4


def test_traced_nan_dt0_names_the_fix():
    solve = jax.jit(lambda dt: odeckpt.solve(decay, y0, (0.0, 1.0), dt0=dt).ys)
    with pytest.raises(Exception, match="dt0 must be finite") as error:
        solve(jnp.nan)
    assert "points away" not in str(error.value)


def test_traced_bad_input_raises_at_run_time():
    solve = jax.jit(lambda y0, ts: odeckpt.solve(decay, y0, (0.0, 1.0), saveat=ts).ys)
    with pytest.raises(Exception, match="NaN or inf"):
        solve(jnp.array([jnp.inf]), jnp.array([0.5]))
    with pytest.raises(Exception, match="sorted"):
        solve(jnp.array([1.0]), jnp.array([0.5, 0.2]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(factormin=2.0), "factormin"),
        (dict(safety=1.5), "safety"),
        (dict(rtol=-1.0), "rtol"),
        (dict(dtmin=1.0, dtmax=0.5), "dtmin <= dtmax"),
    ],
)
def test_bad_controller(kwargs, match):
    with pytest.raises(ValueError, match=match):
        odeckpt.PIDController(**kwargs)


def test_bad_saveat():
    with pytest.raises(ValueError, match="saves nothing"):
        odeckpt.SaveAt()
    with pytest.raises(ValueError, match="1-D"):
        odeckpt.SaveAt(ts=[[0.5]])


@pytest.mark.parametrize(
    "adjoint",
    slow_unless(["recursive", "forward_sensitivity", "backsolve"], fast={"recursive"}),
)
def test_reverse_over_a_derivative_names_the_supported_order(adjoint):
    """Reverse mode over a derivative of an adaptive solve raises naming `jax.hessian` (JAX's
    own error about while loops named no route; forward over reverse is tested against closed
    forms in test_implicit.py and test_sensitivity.py)."""
    final = lambda k: odeckpt.solve(decay_k, y0, (0.0, 1.0), k, adjoint=adjoint).ys[-1, 0]
    orders = [jax.grad(jax.grad(final))]
    if adjoint != "backsolve":  # which has no forward mode, and says so
        orders.append(jax.jacrev(jax.jacfwd(final)))
    for order in orders:
        with pytest.raises(TypeError, match=r"jax.hessian\(f\)"):
            order(0.7)


def decay_k(t, y, k):
    return -k * y
