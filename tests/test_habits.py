"""Habits from diffrax, scipy and torchdiffeq fail at call time with the odeckpt spelling; the
ones that work (closed-over arrays under backsolve) give the right answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt

Y0 = jnp.array([1.0, 2.0])


def decay(t, y, args):
    return -y


@pytest.mark.parametrize(
    "f, fix",
    [
        (lambda t, y: -y, "lambda t, y, args: f(t, y)"),
        (lambda y, t: -y, "lambda t, y, args: f(y, t)"),
        (lambda y: -y, "lambda t, y, args: f(y)"),
    ],
)
def test_vector_field_signatures(f, fix):
    with pytest.raises(TypeError, match=r"called as f\(t, y, args\)") as info:
        odeckpt.solve(f, Y0, (0.0, 1.0))
    assert fix in str(info.value)


def test_vector_field_with_defaults_or_varargs_is_accepted():
    odeckpt.solve(lambda t, y, args=None: -y, Y0, (0.0, 1.0))
    odeckpt.solve(lambda t, y, *rest: -y, Y0, (0.0, 1.0))


@pytest.mark.parametrize("y0", [[1.0, 2.0], [1, 2], [[1.0, 0.0], [0.0, 1.0]]])
def test_list_y0(y0):
    with pytest.raises(TypeError, match=r"Python list of numbers.*jnp.array"):
        odeckpt.solve(decay, y0, (0.0, 1.0))


def test_list_of_arrays_is_a_pytree_state():
    f = lambda t, y, args: [-x for x in y]
    sol = odeckpt.solve(f, [jnp.array(1.0), jnp.array([2.0, 3.0])], (0.0, 1.0))
    np.testing.assert_allclose(sol.ys[1][-1], np.array([2.0, 3.0]) * np.exp(-1.0), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, spelling",
    [
        ({"stepsize_controller": None}, "controller=odeckpt.PIDController"),
        ({"t0": 0.0, "t1": 1.0}, "t_span=(t0, t1)"),
        ({"method": "RK45"}, "solver="),
        ({"t_eval": jnp.linspace(0.0, 1.0, 3)}, "saveat=ts"),
        ({"first_step": 0.1}, "dt0="),
        ({"dense_output": True}, "SaveAt(dense=True)"),
        ({"progress_meter": None}, "progress=True"),
        ({"options": {"step_size": 0.1}}, "dt0="),
    ],
)
def test_foreign_keywords(kwargs, spelling):
    t_span = None if "t0" in kwargs else (0.0, 1.0)
    with pytest.raises(TypeError, match="Fix: in odeckpt use") as info:
        odeckpt.solve(decay, Y0, t_span, **kwargs)
    assert spelling in str(info.value)


def test_unknown_keyword():
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['rtoll'\]"):
        odeckpt.solve(decay, Y0, (0.0, 1.0), rtoll=1e-6)


def test_dt0_positional():
    with pytest.raises(TypeError, match=r"pass the rest by keyword.*dt0=0.1"):
        odeckpt.solve(decay, Y0, (0.0, 1.0), None, 0.1)


def test_missing_time_span():
    with pytest.raises(TypeError, match=r"solve\(f, y0, \(t0, t1\), args\)"):
        odeckpt.solve(decay, Y0)


@pytest.mark.parametrize(
    "name, odeckpt_name",
    [("RK45", "dopri5"), ("DOP853", "dopri8"), ("LSODA", "bdf")],
)
def test_foreign_solver_names(name, odeckpt_name):
    with pytest.raises(ValueError, match=f"solver='{odeckpt_name}"):
        odeckpt.solve(decay, Y0, (0.0, 1.0), solver=name)


@pytest.mark.parametrize("name", ["Radau", "BDF"])
def test_scipy_stiff_names_are_odeckpt_names(name):
    sol = odeckpt.solve(decay, Y0, (0.0, 1.0), solver=name)
    assert type(sol).__name__ == "Solution" and bool(sol.status == odeckpt.Status.successful)


def robertson(t, y, args):
    y1, y2, y3 = y
    return jnp.stack([
        -0.04 * y1 + 1e4 * y2 * y3,
        0.04 * y1 - 1e4 * y2 * y3 - 3e7 * y2**2,
        3e7 * y2**2,
    ])  # fmt: skip


@pytest.mark.parametrize("dtype, note", [(jnp.float32, True), (jnp.float64, False)])
def test_float32_running_out_of_steps_suggests_x64(dtype, note):
    # A stiff problem with an explicit stepper runs out of steps; in float32 the message says
    # that rounding may be why, and how to switch to float64.
    y0 = jnp.array([1.0, 0.0, 0.0], dtype)
    with pytest.raises(Exception, match="maximum number of steps") as info:
        odeckpt.solve(robertson, y0, (0.0, 10.0), max_steps=64).ys.block_until_ready()
    assert ("jax_enable_x64" in str(info.value)) == note
    sol = odeckpt.solve(robertson, y0, (0.0, 10.0), max_steps=64, throw=False)
    assert sol.status == odeckpt.Status.max_steps_reached


# With -m slow: closed-over arrays under backsolve are differentiated by default in
# test_backsolve.py::test_module_arguments_and_closed_over_arrays.
@pytest.mark.slow
def test_backsolve_differentiates_closed_over_arrays():
    # diffrax habit: parameters closed over by `f` instead of passed in `args`.
    weights = jnp.array([[1.0, 0.5], [0.2, 1.0]])

    def loss(w, adjoint):
        f = lambda t, y, args: -(w @ y)
        sol = odeckpt.solve(f, Y0, (0.0, 1.0), adjoint=adjoint, rtol=1e-10, atol=1e-10)
        return jnp.sum(sol.ys[-1])

    # Exact: y(1) = expm(-W) y0, so d/dW sum(y(1)) = d/dW 1^T expm(-W) y0.
    exact = jax.grad(lambda w: jnp.sum(jax.scipy.linalg.expm(-w) @ Y0))(weights)
    for adjoint in ("backsolve", "recursive"):
        np.testing.assert_allclose(jax.grad(loss)(weights, adjoint), exact, rtol=1e-7)
