"""Second derivatives through events, against closed forms: the Hessians of a terminal event's
time and state, and of the state after jumps (`update=`), for the adjoints that differentiate
the discrete solve (forward over reverse and forward over forward) and for ForwardSensitivity.

The event time is located without derivatives and given those of the implicit function
theorem by a derivative rule. Unless that rule's tangent is itself differentiated at the
differentiable root, second derivatives come out finite and wrong (`d2 t*/dk2` of a decay to
a threshold was a third of the exact one), a wrong answer reported as success.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt

G = 9.81
MODES = [
    ("recursive", "forward over reverse"),
    ("direct", "forward over reverse"),
    ("recursive", "forward over forward"),
    ("forward", "forward over forward"),
    ("forward_sensitivity", "forward over reverse"),
    ("forward_sensitivity", "forward over forward"),
]


def _second(fn, mode):
    return jax.jacfwd(jax.jacfwd(fn)) if mode == "forward over forward" else jax.hessian(fn)


def _floor_hit(p, adjoint):
    """The time and velocity where a ball dropped from `h` under gravity `g` reaches the
    height `c`, `p = (h, g, c)`: the start, the vector field and the event's `fn` each depend
    on one parameter."""
    fall = lambda t, y, p: jnp.stack([y[1], -p[1] * jnp.ones_like(y[1])])
    floor = odeckpt.Event(lambda t, y, p: y[0] - p[2], direction=-1)
    sol = odeckpt.solve(fall, jnp.stack([p[0], 0.0 * p[0]]), (0.0, 10.0), args=p,
                        event=floor, adjoint=adjoint)  # fmt: skip
    return jnp.stack([sol.ts[-1], sol.ys[-1, 1]])


def _floor_hit_exact(p):
    h, g, c = p
    return jnp.stack([jnp.sqrt(2 * (h - c) / g), -jnp.sqrt(2 * g * (h - c))])


@pytest.mark.parametrize(
    "adjoint, mode", slow_unless(MODES, fast={("forward", "forward over forward")})
)
def test_terminal_event_time_and_state_hessians(adjoint, mode):
    # Tsit5 and its extension are exact on the fall's quadratic, so the located event is too,
    # and so are its derivatives of every order: to rounding. (With a first-order tangent the
    # Hessian of t* was 0, and that of v* lacked its terms in h and c.)
    p = jnp.array([1.3, G, 0.2])
    exact = jax.hessian(_floor_hit_exact)(p)
    got = _second(lambda p: _floor_hit(p, adjoint), mode)(p)
    np.testing.assert_allclose(got, exact, rtol=1e-8, atol=1e-10)


def _threshold_time(p, adjoint):
    """When `y' = -k y` from `1` decays to `c`, `p = (k, c)`: `t* = -ln(c) / k`."""
    threshold = odeckpt.Event(lambda t, y, p: y[0] - p[1])
    sol = odeckpt.solve(lambda t, y, p: -p[0] * y, jnp.array([1.0]), (0.0, 10.0), args=p,
                        event=threshold, adjoint=adjoint, rtol=1e-10, atol=1e-10)  # fmt: skip
    return sol.ts[-1]


@pytest.mark.slow
@pytest.mark.parametrize("adjoint, mode", MODES)
def test_event_time_hessian_on_a_curved_solution(adjoint, mode):
    # The solution is not a polynomial: the extension's curvature and the event's slope both
    # enter the second derivatives (the rule's first-order tangent gave 0.142 for 0.411).
    p = jnp.array([1.5, 0.5])
    exact = jax.hessian(lambda p: -jnp.log(p[1]) / p[0])(p)
    got = _second(lambda p: _threshold_time(p, adjoint), mode)(p)
    np.testing.assert_allclose(got, exact, rtol=1e-6)


def _ball(p, adjoint):
    """The height and velocity at `t = 2` of a ball dropped from `h`, bouncing with
    restitution `e`, `p = (e, h)` (three bounces before)."""
    bounce = odeckpt.Event(
        lambda t, y, p: y[0], direction=-1, terminal=False,
        update=lambda t, y, p: jnp.stack([y[0], -p[0] * y[1]]),
    )  # fmt: skip
    fall = lambda t, y, p: jnp.stack([y[1], -G * jnp.ones_like(y[1])])
    sol = odeckpt.solve(fall, jnp.stack([p[1], 0.0 * p[1]]), (0.0, 2.0), args=p,
                        event=bounce, adjoint=adjoint, max_steps=64)  # fmt: skip
    return sol.ys[-1]


def _ball_exact(p, t=2.0, bounces=3):
    e, h = p
    v = jnp.sqrt(2 * G * h)
    last = jnp.sqrt(2 * h / G)
    for _ in range(bounces - 1):
        v = e * v
        last = last + 2 * v / G
    v = e * v
    return jnp.stack([v * (t - last) - G / 2 * (t - last) ** 2, v - G * (t - last)])


@pytest.mark.parametrize(
    "adjoint, mode", slow_unless(MODES, fast={("forward", "forward over forward")})
)
def test_state_after_jumps_hessian(adjoint, mode):
    # Each bounce's time moves with (e, h) and its jump depends on e: the second derivatives of
    # the jump condition, exact to rounding (Tsit5 is exact between the bounces). (With a
    # first-order tangent: d2/de2 of the height -81.9 for -88.4, d2/dh2 of the velocity -42.2
    # for -4.86.)
    p = jnp.array([0.8, 1.0])
    np.testing.assert_allclose(_ball(p, adjoint), _ball_exact(p), rtol=1e-10)
    exact = jax.hessian(_ball_exact)(p)
    got = _second(lambda p: _ball(p, adjoint), mode)(p)
    np.testing.assert_allclose(got, exact, rtol=1e-8, atol=1e-9)
