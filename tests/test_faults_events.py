"""Fault injection with events: faults in the vector field, the parameters, the initial state
and the event function, per lane under `vmap`, compiled by `jax.jit` and by `odeckpt.jit`;
zero-length spans and save times at the ends with events; events on a complex state. The cases
and their rules are those of `test_faults.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless
from test_faults import ADJOINTS, JITS, _adjoint

import odeckpt

# ReversibleAdjoint refuses events at call time (tests/test_reversible.py): the others here.
ADJOINTS = tuple(adjoint for adjoint in ADJOINTS if adjoint != "reversible")


def _event_lane(adjoint: str, jit: str = "jax.jit"):
    """`(ok, t*, d t*/d(y0, k))` per lane for `y' = -k y` stopped where `y` falls to 0.5
    (`t* = log(2 y0) / k`), with faults in `f` after `t_fault`, in `k`, in `y0`, and in the
    event function after `t_event`."""

    def hit(y0, k, t_fault, t_event):
        field = lambda t, y, p: jnp.where(t > p[1], jnp.nan, -p[0] * y)
        event = odeckpt.Event(lambda t, y, p: jnp.where(t > p[2], jnp.nan, y[0] - 0.5))
        sol = odeckpt.solve(field, jnp.stack([y0]), (0.0, 2.0), (k, t_fault, t_event),
                            event=event, adjoint=_adjoint(adjoint), throw=False, rtol=1e-10,
                            atol=1e-10)  # fmt: skip
        return sol.ts[-1], sol

    def lane(y0, k, t_fault, t_event):
        derivative = jax.jacfwd if adjoint == "forward" else jax.grad
        d, sol = derivative(hit, argnums=(0, 1), has_aux=True)(y0, k, t_fault, t_event)
        return sol.status == odeckpt.Status.successful, sol.ts[-1], jnp.stack(d)

    return JITS[jit](jax.vmap(lane))


def _event_cases():
    yield from slow_unless([(adjoint, "jax.jit") for adjoint in ADJOINTS],
                           fast={("forward_sensitivity", "jax.jit")})  # fmt: skip
    for adjoint in ADJOINTS:
        yield pytest.param(adjoint, "odeckpt.jit", marks=[pytest.mark.slow])


@pytest.mark.parametrize("adjoint, jit", list(_event_cases()))
def test_events_fail_loudly_per_lane(adjoint, jit):
    nan = np.nan
    y0 = np.array([nan, 1.0, 1.0, 1.0, 1.0])
    k = np.array([1.0, nan, 1.0, 1.0, 1.3])
    t_fault = np.array([9.0, 9.0, 0.2, 9.0, 9.0])  # the event is at t = 0.69 (k = 1)
    t_event = np.array([9.0, 9.0, 9.0, 0.2, 9.0])
    ok, t, d = (np.asarray(x) for x in _event_lane(adjoint, jit)(y0, k, t_fault, t_event))
    np.testing.assert_array_equal(ok, [False, False, False, False, True])
    assert np.all(np.isnan(d[:4]))
    exact = np.log(2.0) / 1.3
    np.testing.assert_allclose(t[-1], exact, rtol=1e-9)
    np.testing.assert_allclose(d[-1], [1 / 1.3, -exact / 1.3], rtol=1e-7)
    status = odeckpt.solve(
        lambda t, y, a: -y, jnp.ones(1), (0.0, 1.0), throw=False,
        event=odeckpt.Event(lambda t, y, a: jnp.where(t > 0.2, jnp.nan, y[0] - 0.1)),
    ).status  # fmt: skip
    assert status == odeckpt.Status.nonfinite_event


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ADJOINTS)
def test_events_with_zero_length_spans_and_save_times_at_the_ends(adjoint):
    """A zero-length span returns y0 with no event; save times at t0 and t1 with a terminal
    event before t1: y0 at t0, `inf` at the unreached t1, and the event's point last."""
    event = odeckpt.Event(lambda t, y, a: y[0] - 0.5)

    def solve(t1):
        return odeckpt.solve(
            lambda t, y, a: -y, jnp.ones(1), (0.0, t1), event=event, adjoint=_adjoint(adjoint),
            saveat=odeckpt.SaveAt(ts=jnp.stack([0.0, t1]), t1=True), rtol=1e-10, atol=1e-10,
        )  # fmt: skip

    empty = solve(0.0)
    assert int(empty.event) == -1 and int(empty.stats.num_steps) == 0
    np.testing.assert_array_equal(empty.ys[:, 0], [1.0, 1.0, 1.0])
    sol = solve(2.0)
    np.testing.assert_allclose(sol.ys[:, 0], [1.0, np.inf, 0.5], rtol=1e-9)
    np.testing.assert_allclose(sol.ts[-1], np.log(2.0), rtol=1e-9)
    derivative = jax.jacfwd if adjoint == "forward" else jax.grad
    np.testing.assert_allclose(derivative(lambda t1: solve(t1).ts[-1])(2.0), 0.0, atol=1e-12)


@pytest.mark.slow
def test_events_on_a_complex_state():
    """`y' = i k y` from 1: `Re y = cos kt` falls through 0 at pi / 2k (ForwardSensitivity's
    sensitivities follow it in real coordinates)."""
    event = odeckpt.Event(lambda t, y, a: jnp.real(y[0]))

    def solve(k, adjoint="recursive"):
        field = lambda t, y, k: 1j * k * y
        return odeckpt.solve(field, jnp.ones(1, complex), (0.0, 3.0), args=k, event=event,
                             rtol=1e-10, atol=1e-10, adjoint=adjoint)  # fmt: skip

    sol = solve(1.0)
    np.testing.assert_allclose(sol.ts[-1], np.pi / 2, rtol=1e-9)
    np.testing.assert_allclose(sol.ys[-1], [1j], atol=1e-9)
    event_time = lambda k: solve(k, "forward_sensitivity").ts[-1]
    np.testing.assert_allclose(jax.grad(event_time)(1.0), -np.pi / 2, rtol=1e-8)
