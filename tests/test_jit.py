"""`odeckpt.jit`: programs without host callbacks (which JAX's persistent compilation cache
stores), failures raised on the host after the call, and values that never recompile."""

import json
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from problems import lotka_volterra

import odeckpt

_Y0 = jnp.array([10.0, 5.0])
_ARGS = (1.1, 0.4, 0.4, 0.1)
_TS = jnp.linspace(0.0, 20.0, 11)


def _callbacks(lowered) -> list[str]:
    """The host callbacks of a lowered program (custom calls to a Python callback)."""
    return re.findall(r"custom_call @(\w*callback\w*)", lowered.as_text())


def _loss(args, adjoint="recursive", solver="tsit5", throw=True, **options):
    sol = odeckpt.solve(lotka_volterra, _Y0, (0.0, 20.0), args, saveat=_TS, adjoint=adjoint,
                        solver=solver, throw=throw, **options)  # fmt: skip
    return jnp.sum(sol.ys)


@pytest.mark.parametrize(
    "adjoint", ["recursive", "direct", "backsolve", "interpolating", "forward_sensitivity"]
)
def test_gradient_programs_hold_no_host_callback(adjoint):
    grad = jax.grad(_loss)
    if adjoint == "recursive":  # the probe sees the callbacks of a plain `jax.jit`
        assert _callbacks(jax.jit(_loss, static_argnums=1).lower(_ARGS, adjoint))
    assert not _callbacks(odeckpt.jit(grad, static_argnums=1).lower(_ARGS, adjoint))


def _events_loss(args):
    bounce = odeckpt.Event(
        lambda t, y, a: y[0] - 2.0, update=lambda t, y, a: y * 1.1, terminal=False
    )
    stop = odeckpt.Event(lambda t, y, a: y[1] - 30.0, terminal=True)
    saveat = odeckpt.SaveAt(t1=True, dense=True)
    sol = odeckpt.solve(lotka_volterra, _Y0, (0.0, 20.0), args, event=(bounce, stop),
                        saveat=saveat, jump_ts=jnp.array([3.0]))  # fmt: skip
    return jnp.sum(sol.ys) + jnp.sum(sol.evaluate(jnp.array([1.0, 2.0])))


def _ensemble_loss(args):
    scales = jnp.array([0.9, 1.0, 1.1])
    return jnp.sum(jax.vmap(lambda s: _loss(jax.tree.map(lambda a: a * s, args)))(scales))


def _constant_step_loss(args):
    sol = odeckpt.solve(lotka_volterra, _Y0, (0.0, 2.0), args, solver="rk4", dt0=0.01,
                        saveat=odeckpt.SaveAt(steps=True))  # fmt: skip
    return jnp.sum(jnp.where(jnp.isfinite(sol.ys), sol.ys, 0.0))


@pytest.mark.parametrize(
    "loss",
    [
        lambda args: _loss(args, solver="radau"),
        lambda args: _loss(args, solver="bdf"),
        lambda args: _loss(args, solver="rodas5", adjoint="direct"),
        lambda args: _loss(args, solver="kvaerno5", adjoint="backsolve"),
        _events_loss,
        _ensemble_loss,
        _constant_step_loss,
    ],
    ids=["radau", "bdf", "rodas5", "kvaerno5-backsolve", "events", "vmap", "constant-step"],
)
def test_every_kind_of_solve_compiles_without_host_callback(loss):
    assert not _callbacks(odeckpt.jit(jax.grad(loss)).lower(_ARGS))


def test_forward_mode_compiles_without_host_callback():
    jvp = lambda args, tangents: jax.jvp(
        lambda a: _loss(a, adjoint="forward"), (args,), (tangents,)
    )
    assert not _callbacks(odeckpt.jit(jvp).lower(_ARGS, _ARGS))


def test_plain_jit_without_throw_holds_no_host_callback():
    """`throw=False` under a plain `jax.jit`: traced inputs that fail their checks become
    `Status.invalid_inputs`, not callbacks."""
    assert not _callbacks(jax.jit(jax.grad(lambda a: _loss(a, throw=False))).lower(_ARGS))

    def solve(t1, dt0):
        return odeckpt.solve(lotka_volterra, _Y0, (0.0, t1), _ARGS, dt0=dt0, throw=False)

    assert jax.jit(solve)(20.0, 0.1).status == odeckpt.Status.successful
    grad = jax.jit(jax.grad(lambda t1, dt0: jnp.sum(solve(t1, dt0).ys)))
    for t1, dt0 in [(jnp.nan, 0.1), (20.0, -0.1), (20.0, jnp.inf)]:
        sol = jax.jit(solve)(t1, dt0)
        assert sol.status == odeckpt.Status.invalid_inputs and sol.stats.num_steps == 0
        assert np.isnan(grad(t1, dt0))


def test_a_failed_solve_raises_the_same_message_after_the_call():
    with pytest.raises(Exception) as plain:
        jax.jit(lambda args: _loss(args, max_steps=10))(_ARGS)
    with pytest.raises(eqx.EquinoxRuntimeError) as ours:
        odeckpt.jit(_loss)(_ARGS, max_steps=10)
    # The status's cause, and the line of the `solve` that failed (in `_loss`).
    message = str(ours.value)
    assert message.startswith(odeckpt.Status.outcome("max_steps_reached").cause)
    assert message.endswith(f"test_jit.py:{_loss.__code__.co_firstlineno + 1}, in `_loss`.)")
    assert message in str(plain.value)
    # A gradient too (under a plain `jax.jit` XLA drops the check with the unused forward
    # outputs, and only the NaN gradient tells), and where one lane of an ensemble fails.
    with pytest.raises(eqx.EquinoxRuntimeError, match="raise `max_steps=`"):
        odeckpt.jit(jax.grad(_loss))(_ARGS, max_steps=10)
    lanes = lambda args, n: jnp.sum(jax.vmap(lambda n: _loss(args, dt0=20.0 / n))(n))
    grad = odeckpt.jit(jax.grad(lanes))
    with pytest.raises(eqx.EquinoxRuntimeError, match="dt0 must be finite"):
        grad(_ARGS, jnp.array([100.0, -100.0]))
    assert np.all(np.isfinite(grad(_ARGS, jnp.array([100.0, 50.0]))))


def test_without_throw_the_status_reports_and_the_gradient_is_nan():
    def status_and_grad(args):
        sol = odeckpt.solve(lotka_volterra, _Y0, (0.0, 20.0), args, max_steps=10, throw=False)
        return sol.status, jax.grad(lambda a: _loss(a, throw=False, max_steps=10))(args)

    status, grad = odeckpt.jit(status_and_grad)(_ARGS)
    assert status == odeckpt.Status.max_steps_reached
    assert all(np.isnan(g) for g in grad)


def _lorenz(t, y, args):
    sigma, rho, beta = args
    return jnp.stack([sigma * (y[1] - y[0]), y[0] * (rho - y[2]) - y[1], y[0] * y[1] - beta * y[2]])


@pytest.mark.slow
def test_a_failed_backward_pass_raises_after_the_call():
    """A backsolve gradient whose backward reconstruction drifts (Lorenz, see
    test_backsolve.py) raises on the host, with the message of a plain `jax.jit`."""

    def loss(y0):
        sol = odeckpt.solve(_lorenz, y0, (0.0, 1.0), (10.0, 28.0, 8.0 / 3.0), rtol=1e-6,
                            atol=1e-6, adjoint="backsolve")  # fmt: skip
        return jnp.sum(sol.ys[-1])

    with pytest.raises(eqx.EquinoxRuntimeError, match="drifted from the forward solution"):
        odeckpt.jit(jax.grad(loss))(jnp.array([1.0, 1.0, 1.0]))


def test_the_compiled_program_is_keyed_by_its_failure_mechanism():
    """The same solve under `odeckpt.jit`, then a plain `jax.jit`, then outside `jit`: each
    gets its own program (the callback-free one cannot run outside `odeckpt.jit`)."""
    expected = odeckpt.jit(_loss)(_ARGS)
    assert jax.jit(_loss)(_ARGS) == expected
    assert _loss(_ARGS) == expected
    assert odeckpt.jit(_loss)(_ARGS) == expected


def test_arguments_like_jax_jit_and_filter_jit():
    @odeckpt.jit(static_argnames="solver")
    def final(y0, args, fn, steps, solver):
        sol = odeckpt.solve(fn, y0, (0.0, 1.0), args, solver=solver, max_steps=steps)
        return sol  # a Solution, with its status, returned whole

    sol = final(_Y0, _ARGS, lotka_volterra, 100, solver="dopri5")
    assert sol.status == odeckpt.Status.successful and sol.ys.shape == (1, 2)
    reference = odeckpt.solve(lotka_volterra, _Y0, (0.0, 1.0), _ARGS, solver="dopri5")
    np.testing.assert_allclose(sol.ys, reference.ys, rtol=1e-12)
    with pytest.raises(TypeError, match="donate_argnums"):
        odeckpt.jit(_loss, donate_argnums=0)


def test_inside_another_transformation_it_is_the_function_itself():
    grad = jax.grad(odeckpt.jit(_loss))(_ARGS)
    np.testing.assert_allclose(grad, jax.grad(_loss)(_ARGS), rtol=1e-12)
    with pytest.raises(Exception, match="raise `max_steps=`"):
        jax.jit(odeckpt.jit(lambda a: _loss(a, max_steps=10)))(_ARGS)


def test_static_arguments_and_outputs_as_jax_jit_and_filter_jit():
    kind = odeckpt.jit(lambda x, n: x * (2 if type(n) is bool else 3))
    assert kind(1.0, 1) == 3 and kind(1.0, True) == 2  # a static 1 and True differ

    def branches(t, y, args):
        (rate,) = args
        return -y if rate > 0 else y

    final = odeckpt.jit(lambda y0, rate: odeckpt.solve(branches, y0, (0.0, 1.0), (rate,)).ys,
                        static_argnames="rate")  # fmt: skip
    np.testing.assert_allclose(final(jnp.ones(1), 1.0), final(jnp.ones(1), rate=1.0))
    out = odeckpt.jit(lambda x: (x, 1.5, "text", None, jnp.sin))(2.0)
    assert out[1:] == (1.5, "text", None, jnp.sin) and out[0] == 2.0
    with pytest.raises(TypeError, match="positional argument at \\[1\\].*list is not hashable"):
        odeckpt.jit(lambda x, items: x, static_argnums=1)(1.0, [1, 2])
    with pytest.raises(ValueError, match="names argument 3"):
        odeckpt.jit(lambda x: x, static_argnums=3)(1.0)


class _Compilations:
    """Counts XLA compilations while active."""

    def __init__(self):
        self.count = 0

    def _listen(self, name, seconds, **kwargs):
        del seconds, kwargs
        self.count += name == "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_new_tolerances_and_parameters_compile_nothing():
    """Five Python-float `rtol`s and five values of a rate constant in `args=(...)` written as
    Python floats: after the first call, neither a plain call nor an `odeckpt.jit` gradient
    compiles again."""

    def solve(rtol, a):
        sol = odeckpt.solve(lotka_volterra, _Y0, (0.0, 20.0), (a, 0.4, 0.4, 0.1), rtol=rtol)
        return sol.ys[-1]

    grad = odeckpt.jit(jax.grad(lambda rtol, a: jnp.sum(solve(rtol, a)), argnums=1))
    first = solve(1e-3, 1.1), grad(1e-3, 1.1)
    with _Compilations() as compiled:
        values = [(solve(r, 1.1), grad(r, 1.1)) for r in (1e-4, 1e-5, 1e-6, 1e-7)]
        values += [(solve(1e-3, a), grad(1e-3, a)) for a in (1.0, 1.2, 1.3, 1.4)]
    assert compiled.count == 0
    # and the values reached the solve
    errors = [float(jnp.max(jnp.abs(y - values[3][0]))) for y, _ in values[:3]]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0
    assert len({float(g) for _, g in [first, *values[4:]]}) == 5


def test_a_vector_field_that_branches_on_a_python_number_still_works():
    """A Python float in `args` that `f` needs as a Python number (in an `if`) stays one."""

    def f(t, y, args):
        (rate,) = args
        return -y if rate > 0 else y

    sol = odeckpt.solve(f, jnp.array([1.0]), (0.0, 1.0), (1.0,))
    np.testing.assert_allclose(sol.ys[-1], np.exp(-1.0), rtol=1e-5)


_CACHED = textwrap.dedent(
    """
    import json, sys, jax, jax.numpy as jnp
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    import odeckpt
    from problems import lotka_volterra
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
    def loss(args):
        sol = odeckpt.solve(lotka_volterra, jnp.array([10.0, 5.0]), (0.0, 20.0), args,
                            saveat=jnp.linspace(0.0, 20.0, 11))
        return jnp.sum(sol.ys)
    jit = odeckpt.jit if sys.argv[2] == "odeckpt" else jax.jit
    grad = jit(jax.grad(loss))((1.1, 0.4, 0.4, 0.1))
    print(json.dumps({"hits": len(hits), "grad": [float(g) for g in grad]}))
    """
)


def _cached_run(cache, kind: str) -> dict:
    tests = str(__import__("pathlib").Path(__file__).parent)
    env = {**__import__("os").environ}
    env["PYTHONPATH"] = tests + ":" + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _CACHED, str(cache), kind], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_persistent_cache_stores_the_gradient_and_a_new_process_loads_it(tmp_path):
    plain = _cached_run(tmp_path, "jax")
    assert not list(tmp_path.iterdir())  # a host callback: JAX refuses to store it
    first = _cached_run(tmp_path, "odeckpt")
    assert first["hits"] == 0 and len(list(tmp_path.iterdir())) == 1
    second = _cached_run(tmp_path, "odeckpt")
    assert second["hits"] == 1 and second["grad"] == first["grad"]
    np.testing.assert_allclose(first["grad"], plain["grad"], rtol=1e-12)
