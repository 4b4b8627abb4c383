"""Habits from diffrax, scipy and torchdiffeq fail at call time with the odeckpt spelling; the
ones that work (closed-over arrays under backsolve) give the right answer."""

import inspect
import re
import traceback

import equinox as eqx
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


# Objects of other libraries, recognised by their type's module (no import of diffrax needed).
def foreign(module, name, **fields):
    """An instance of a stand-in class called `name` whose module is `module`."""
    return type(name, (), {"__module__": module, **fields})()


def decay_field(t, y, args):
    return -y


_SUB_SAVE_AT = foreign("diffrax._saveat", "SubSaveAt", t0=False, t1=True, ts=np.ones(2), steps=0)
_PID = foreign("diffrax._step_size_controller.pid", "PIDController", rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "keywords, spelling",
    [
        ({"adjoint": foreign("diffrax._adjoint", "BacksolveAdjoint")}, "BacksolveAdjoint()"),
        ({"adjoint": foreign("diffrax._adjoint", "RecursiveCheckpointAdjoint")}, "'recursive'"),
        ({"adjoint": foreign("diffrax._adjoint", "DirectAdjoint")}, "odeckpt.DirectAdjoint()"),
        ({"adjoint": foreign("diffrax._adjoint", "ForwardMode")}, "odeckpt.ForwardMode()"),
        ({"adjoint": foreign("diffrax._adjoint", "ImplicitAdjoint")}, "no steady-state adjoint"),
        ({"solver": foreign("diffrax._solver.tsit5", "Tsit5")}, "solver=odeckpt.Tsit5()"),
        ({"solver": foreign("diffrax._solver.kvaerno5", "Kvaerno5")}, "odeckpt.Radau5()"),
        ({"solver": foreign("diffrax._solver.kencarp4", "KenCarp4")}, "odeckpt.Kvaerno4()"),
        ({"solver": foreign("diffrax._solver.midpoint", "Midpoint")}, "ConstantStep()"),
        ({"solver": foreign("diffrax._solver.milstein", "ItoMilstein")}, "ordinary differential"),
        ({"controller": foreign("diffrax", "ConstantStepSize")}, "odeckpt.ConstantStep()"),
        ({"controller": _PID}, "odeckpt.solve(..., rtol=1e-05, atol=1e-07)"),
        ({"progress": foreign("diffrax._progress_meter", "TqdmProgressMeter")}, "progress=True"),
        ({"event": foreign("diffrax._event", "Event")}, "odeckpt.Event(fn)"),
        (
            {"saveat": foreign("diffrax._saveat", "SaveAt", dense=True, subs=_SUB_SAVE_AT)},
            "saveat=odeckpt.SaveAt(ts=ts, t1=True, dense=True)",
        ),
        ({"solver": type("RK45", (), {"__module__": "scipy.integrate._ivp.rk"})}, "'dopri5'"),
        ({"f": foreign("diffrax", "ODETerm", vector_field=decay_field)}, "solve(decay_field, y0"),
        ({"f": foreign("diffrax", "MultiTerm")}, "f1(t, y, args) + f2(t, y, args)"),
        ({"f": foreign("torch.nn.modules.linear", "Linear")}, "equinox.nn.MLP"),
        ({"y0": foreign("torch", "Tensor")}, "jnp.asarray(y0.detach().cpu().numpy())"),
    ],
)
def test_objects_of_other_libraries_name_the_odeckpt_equivalent(keywords, spelling):
    keywords = {"f": decay, "y0": Y0, **keywords}
    with pytest.raises(TypeError, match="whose objects odeckpt does not take. Fix: ") as info:
        odeckpt.solve(keywords.pop("f"), keywords.pop("y0"), (0.0, 1.0), **keywords)
    assert spelling in str(info.value)


def test_real_diffrax_objects():
    diffrax = pytest.importorskip("diffrax")
    cases = [
        (dict(adjoint=diffrax.BacksolveAdjoint()), "adjoint=odeckpt.BacksolveAdjoint()"),
        (dict(saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 3))), "odeckpt.SaveAt(ts=ts)"),
        (dict(controller=diffrax.PIDController(rtol=1e-6, atol=1e-9)), "rtol=1e-06, atol=1e-09"),
    ]
    for keywords, spelling in cases:
        with pytest.raises(TypeError) as info:
            odeckpt.solve(decay_field, Y0, (0.0, 1.0), **keywords)
        assert spelling in str(info.value)
    with pytest.raises(TypeError, match=r"odeckpt.solve\(decay_field, y0, \(t0, t1\), args\)"):
        odeckpt.solve(diffrax.ODETerm(decay_field), Y0, (0.0, 1.0))


@pytest.mark.parametrize(
    "name, spelling",
    [
        ("result", "sol.status"),
        ("y", "sol.ys.T"),
        ("t", "sol.ts"),
        ("success", "sol.status == odeckpt.Status.successful"),
        ("message", "sol.status.message"),
        ("nfev", "sol.stats['nfev']"),
        ("sol", "sol.evaluate(t)"),
    ],
)
def test_attribute_names_of_other_libraries(name, spelling):
    sol = odeckpt.solve(decay, Y0, (0.0, 1.0))
    with pytest.raises(AttributeError, match=r"'Solution' object has no attribute .*Fix: ") as info:
        getattr(sol, name)
    assert spelling in str(info.value)
    assert not hasattr(sol, name) and hasattr(sol, "ys")


def test_unknown_attribute_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match=r"no attribute 'yss'$"):
        odeckpt.solve(decay, Y0, (0.0, 1.0)).yss  # noqa: B018


def _stopped(solver, **keywords):
    """The message of a solve of `decay` over [0, 10] that runs out of steps, and where the
    same solve stops with `throw=False` (its last point, at most 3 steps)."""
    keywords = dict(solver=solver, max_steps=3, **keywords)
    sol = odeckpt.solve(decay, Y0, (0.0, 10.0), throw=False, **keywords)
    assert sol.status == odeckpt.Status.max_steps_reached
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        odeckpt.solve(decay, Y0, (0.0, 10.0), **keywords)
    where = f"stopped at t={float(sol.ts[-1]):.6g} of [0, 10] after 3 steps"
    return str(info.value), where


def test_max_steps_with_an_explicit_stepper_says_where_and_suggests_an_implicit_one():
    message, where = _stopped(odeckpt.Tsit5())
    assert where in message and 0 < float(message.split("t=")[1].split()[0]) < 10
    assert "Tsit5 is explicit" in message and "solver=odeckpt.Radau5()" in message
    assert "max_steps=12" in message  # four times as many


def test_max_steps_with_an_implicit_stepper_does_not_suggest_one():
    message, where = _stopped(odeckpt.Radau5())
    assert where in message and "Radau5 is implicit already" in message
    assert "max_steps=12" in message and "blow up" in message
    assert "use an implicit" not in message and "solver=" not in message


def test_max_steps_with_constant_steps_names_dt0():
    message, where = _stopped(odeckpt.Euler(), dt0=0.1)
    assert where in message and "larger `dt0`" in message and "implicit" not in message


def _failing_solve(t1):
    return odeckpt.solve(decay, Y0, (0.0, t1), max_steps=2)


def test_the_traceback_ends_at_the_failing_call():
    # Two failing solves from two lines share one compiled solve: the second error's traceback
    # ends at its own call and mentions the first nowhere (a traceback recorded when the solve
    # was traced would be the first's).
    with pytest.raises(eqx.EquinoxRuntimeError):
        _failing_solve(1.0)
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        odeckpt.solve(decay, Y0, (0.0, 2.0), max_steps=2)
    ours = [frame for frame in traceback.extract_tb(info.tb) if frame.filename == __file__]
    assert ours[-1].line == "odeckpt.solve(decay, Y0, (0.0, 2.0), max_steps=2)"
    # Nor does its text name another line of this file (as a stack recorded at trace time would).
    text = "".join(traceback.format_exception(info.value))
    mentioned = set(re.findall(rf'File "{re.escape(__file__)}", line (\d+), in (\w+)', text))
    assert mentioned == {(str(ours[-1].lineno), "test_the_traceback_ends_at_the_failing_call")}


def test_under_jit_the_message_names_the_failing_call():
    # Inside a traced program the error is raised at run time; its message names the line of
    # the `solve` that failed, for the second of two programs too.
    first = jax.jit(lambda y0: odeckpt.solve(decay, y0, (0.0, 1.0), max_steps=100).ys)
    second = jax.jit(lambda y0: odeckpt.solve(decay, y0, (0.0, 1.0), max_steps=2).ys)
    first(Y0)
    with pytest.raises(Exception) as info:
        second(Y0)
    line = inspect.getsourcelines(test_under_jit_the_message_names_the_failing_call)[1] + 4
    assert f"called at {__file__}:{line}, in `<lambda>`" in str(info.value)
    assert "cannot say where the solve stopped" in str(info.value)


def test_differentiated_in_the_span_the_failure_still_raises_its_own_error():
    # Under `jax.grad` in t1 outside `jit` the status is known where the times are traced.
    with pytest.raises(eqx.EquinoxRuntimeError, match="maximum number of steps"):
        jax.grad(lambda t1: _failing_solve(t1).ys.sum())(1.0)


@pytest.mark.parametrize("keyword", ["throw", "progress"])
@pytest.mark.parametrize("value", [None, "no", 0])
def test_flags_must_be_true_or_false(keyword, value):
    with pytest.raises(TypeError, match=rf"{keyword}=True or {keyword}=False"):
        odeckpt.solve(decay, Y0, (0.0, 1.0), **{keyword: value})


def test_a_status_has_no_truth_value():
    sol = odeckpt.solve(decay, Y0, (0.0, 1.0), max_steps=2, throw=False)
    with pytest.raises(TypeError, match="odeckpt.Status.successful"):
        bool(sol.status)
