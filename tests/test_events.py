"""Events: located crossings against closed forms and scipy, their derivatives for every
adjoint, jumps (a bouncing ball), known discontinuities, per-lane events under `vmap`, two
crossings in one step, what a solve without events costs, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
from selection import slow_unless

import odeckpt

G = 9.81
REVERSE = ("direct", "recursive", "backsolve", "interpolating", "forward_sensitivity")


def fall(t, y, args):
    """Free fall: height and velocity, with `args = (h0, g)` (only `g` enters)."""
    return jnp.stack([y[1], -args[1] * jnp.ones_like(y[1])])


FLOOR = odeckpt.Event(lambda t, y, args: y[0], direction=-1)


def _floor_hit(h, g, adjoint):
    sol = odeckpt.solve(fall, jnp.stack([h, 0.0 * h]), (0.0, 10.0), args=(h, g), event=FLOOR,
                        adjoint=adjoint)  # fmt: skip
    return sol.ts[-1], sol.ys[-1, 1]


def test_free_fall_stops_at_the_floor():
    sol = odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 10.0), args=(1.0, G), event=FLOOR)
    assert sol.status == odeckpt.Status.successful
    assert int(sol.event) == 0
    assert sol.ts.shape == (1,)
    np.testing.assert_allclose(sol.ts[-1], np.sqrt(2 / G), rtol=1e-13)
    np.testing.assert_allclose(sol.ys[-1], [0.0, -np.sqrt(2 * G)], atol=1e-13)
    # The reported point is the last one before the sign changes.
    assert sol.ys[-1, 0] >= 0


# ForwardMode by default (the implicit-function term that direct and recursive differentiate
# too); ForwardSensitivity's event derivatives are checked by default in test_faults.py (per
# lane, against the closed form) and against the discrete derivative in
# test_forward_sensitivity_refuses_a_derivative_when_its_solve_meets_other_events.
@pytest.mark.parametrize("adjoint", slow_unless([*REVERSE, "forward"], fast={"forward"}))
def test_free_fall_derivatives_in_closed_form(adjoint):
    # t* = sqrt(2h/g) and v* = -sqrt(2gh); Tsit5 and its interpolant are exact on quadratics.
    h, g = 1.3, G
    exact = {
        "t": (1 / np.sqrt(2 * h * g), -0.5 * np.sqrt(2 * h) * g**-1.5),
        "v": (-np.sqrt(g / (2 * h)), -np.sqrt(h / (2 * g))),
    }
    for which, index in (("t", 0), ("v", 1)):
        fn = lambda h, g, i=index: _floor_hit(h, g, adjoint)[i]
        if adjoint == "forward":
            got = jax.jacfwd(fn, argnums=(0, 1))(h, g)
        else:
            got = jax.grad(fn, argnums=(0, 1))(h, g)
        np.testing.assert_allclose(got, exact[which], rtol=1e-9, err_msg=which)


def lotka_volterra(t, y, args):
    a, b, c, d = args
    prey, predator = y[0], y[1]
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


def test_lotka_volterra_threshold_matches_scipy():
    args, y0, threshold = (1.1, 0.4, 0.4, 0.1), np.array([10.0, 5.0]), 2.0
    reference = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(lotka_volterra(t, y, args)), (0.0, 30.0), y0,
        method="DOP853", rtol=1e-13, atol=1e-13,
        events=lambda t, y: y[0] - threshold,
    )  # fmt: skip
    falling = odeckpt.Event(lambda t, y, args: y[0] - threshold, direction=-1)
    sol = odeckpt.solve(lotka_volterra, jnp.asarray(y0), (0.0, 30.0), args, event=falling,
                        rtol=1e-12, atol=1e-12, max_steps=8192)  # fmt: skip
    # scipy reports every crossing; the first (falling) one ends our solve.
    first = reference.t_events[0][0]
    assert int(sol.event) == 0
    np.testing.assert_allclose(sol.ts[-1], first, rtol=1e-10)
    np.testing.assert_allclose(sol.ys[-1], reference.y_events[0][0], rtol=1e-9)


def _bounce(e: float) -> odeckpt.Event:
    return odeckpt.Event(
        lambda t, y, e: y[0], direction=-1, terminal=False,
        update=lambda t, y, e: jnp.stack([y[0], -e * y[1]]),
    )  # fmt: skip


def _bounces(e, adjoint="recursive"):
    ball = lambda t, y, e: jnp.stack([y[1], -G * jnp.ones_like(y[1])])
    saveat = odeckpt.SaveAt(steps=True)
    return odeckpt.solve(ball, jnp.array([1.0, 0.0]), (0.0, 2.0), args=e, event=_bounce(e),
                         adjoint=adjoint, saveat=saveat, max_steps=64)  # fmt: skip


def _third_bounce(e: float) -> tuple[float, float]:
    """The time of the third bounce of a ball dropped from 1 m, and its derivative in `e`."""
    v1 = np.sqrt(2 * G)
    t = np.sqrt(2 / G) + 2 * e * v1 / G + 2 * e**2 * v1 / G
    return t, 2 * v1 / G + 4 * e * v1 / G


# With -m slow: the jumps are differentiated by default in
# test_height_after_bounces_and_its_derivative.
@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ["direct", "recursive", "forward"])
def test_bouncing_ball_third_bounce_and_its_derivative(adjoint):
    e = 0.8
    sol = _bounces(e, adjoint)
    assert sol.status == odeckpt.Status.successful
    assert int(sol.event) == -1
    # The step ends at each bounce hold the state before the jump: height 0, falling.
    bounces = np.flatnonzero(np.isfinite(sol.ts) & (np.abs(np.asarray(sol.ys[:, 0])) < 1e-12))
    k = int(bounces[2])
    t3, dt3 = _third_bounce(e)
    np.testing.assert_allclose(sol.ts[k], t3, rtol=1e-12)
    time = lambda e: _bounces(e, adjoint).ts[k]
    derivative = jax.jacfwd(time)(e) if adjoint == "forward" else jax.grad(time)(e)
    np.testing.assert_allclose(derivative, dt3, rtol=1e-9)


def _height_after_bounces(e, t):
    """The height at time `t` of a ball dropped from 1 m, bouncing with restitution `e`."""
    v = np.sqrt(2 * G)
    bounce = np.sqrt(2 / G)
    while bounce + 2 * e * v / G < t:
        v, bounce = e * v, bounce + 2 * e * v / G
    return e * v * (t - bounce) - G / 2 * (t - bounce) ** 2


# With -m slow: ForwardSensitivity's jump condition is checked by default against the discrete
# derivative in test_forward_sensitivity_refuses_a_derivative_when_its_solve_meets_other_events.
@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ["recursive", "forward_sensitivity"])
def test_height_after_bounces_and_its_derivative(adjoint):
    # The jump condition carries the sensitivities across each bounce (three before t = 2).
    e, ts = 0.8, np.array([0.5, 1.3, 2.0])

    def heights(e):
        ball = lambda t, y, e: jnp.stack([y[1], -G * jnp.ones_like(y[1])])
        return odeckpt.solve(ball, jnp.array([1.0, 0.0]), (0.0, 2.0), args=e,
                             event=_bounce(e), adjoint=adjoint, max_steps=64,
                             saveat=odeckpt.SaveAt(ts=jnp.asarray(ts))).ys[:, 0]  # fmt: skip

    exact = np.array([_height_after_bounces(e, t) for t in ts])
    np.testing.assert_allclose(heights(e), exact, rtol=1e-12)
    # The closed form is smooth in e between bounce counts: its derivative by central
    # differences, to about 1e-10.
    step = 1e-6
    slope = [
        (_height_after_bounces(e + step, t) - _height_after_bounces(e - step, t)) / (2 * step)
        for t in ts
    ]
    np.testing.assert_allclose(jax.jacfwd(heights)(e), slope, rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(jax.jacrev(heights)(e), slope, rtol=1e-8, atol=1e-9)


@pytest.mark.slow
def test_forward_sensitivity_follows_an_event_that_depends_on_parameters():
    # Lotka-Volterra stopped where the prey falls to a threshold passed in `args`: the event
    # time and state move with the rates and with the threshold itself.
    def hit(params, adjoint):
        event = odeckpt.Event(lambda t, y, p: y[0] - p[4], direction=-1)
        sol = odeckpt.solve(lambda t, y, p: lotka_volterra(t, y, p[:4]),
                            jnp.array([10.0, 5.0]), (0.0, 30.0), params, event=event,
                            rtol=1e-10, atol=1e-10, max_steps=4096,
                            adjoint=adjoint)  # fmt: skip
        return jnp.concatenate([sol.ts[-1:], sol.ys[-1]])

    params = jnp.array([1.1, 0.4, 0.4, 0.1, 2.0])
    got_fwd = jax.jacfwd(hit)(params, "forward_sensitivity")
    got_rev = jax.jacrev(hit)(params, "forward_sensitivity")
    expected = jax.jacrev(hit)(params, "recursive")
    np.testing.assert_allclose(got_fwd, expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got_rev, expected, rtol=1e-6, atol=1e-8)
    # The state at the event is the threshold, whatever the rates.
    np.testing.assert_allclose(got_fwd[1], [0, 0, 0, 0, 1], atol=1e-10)


# Short dips of an event function below zero around t = 3.3, of depth `eps`: whether a solve
# sees one depends on its steps, and the sensitivity solve takes other steps than the state's.
# Each returns `(field, event)`; `args = (p, eps)`, the state starts at 1.
_DIPS = {
    # the dip doubles the state: the solves may jump different numbers of times;
    "jump count": (
        lambda t, y, a: -a[0] * y,
        odeckpt.Event(
            lambda t, y, a: (t - 3.3) ** 2 - a[1], terminal=False, update=lambda t, y, a: 2.0 * y
        ),
    ),  # fmt: skip
    # the solve stops at the dip or, missing it, at t = 7: the same event, other crossings;
    "terminal crossing": (
        lambda t, y, a: -a[0] * y,
        odeckpt.Event(lambda t, y, a: ((t - 3.3) ** 2 - a[1]) * (7.0 - t), direction=-1),
    ),
    # one jump (then none: y[1] = 1 lifts fn) at the dip or at t = 7: the same count, other
    # times.
    "jump time": (
        lambda t, y, a: jnp.stack([-a[0] * y[0], 0.0 * y[1]]),
        odeckpt.Event(
            lambda t, y, a: ((t - 3.3) ** 2 - a[1]) * (7.0 - t) + 1e4 * y[1],
            direction=-1,
            terminal=False,
            update=lambda t, y, a: jnp.stack([y[0] + 1.0, 1.0 + 0.0 * y[1]]),
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("kind", slow_unless(list(_DIPS), fast={"jump time"}))
def test_forward_sensitivity_refuses_a_derivative_when_its_solve_meets_other_events(kind):
    # Where the two solves meet different events, the derivative would belong to the other
    # trajectory (4x to 20x off here): it must be NaN (or raise), never finite.
    field, event = _DIPS[kind]
    y0 = jnp.array([1.0, 0.0]) if kind == "jump time" else jnp.array([1.0])

    def final(p, eps, adjoint, throw=False):
        sol = odeckpt.solve(field, y0, (0.0, 10.0), args=jnp.stack([p, eps]), event=event,
                            adjoint=adjoint, rtol=1e-10, atol=1e-10, throw=throw)  # fmt: skip
        return sol.ts[-1] + sol.ys[-1, 0]

    eps = jnp.geomspace(1e-4, 3e-7, 8)
    per_lane = lambda adjoint: jax.jit(
        jax.vmap(jax.grad(lambda p, e: final(p, e, adjoint)), in_axes=(None, 0))
    )(1.0, eps)
    sensitivity, discrete = np.asarray(per_lane("forward_sensitivity")), per_lane("recursive")
    trusted = np.isfinite(sensitivity)
    np.testing.assert_allclose(sensitivity[trusted], discrete[trusted], rtol=1e-6)
    # The disagreement is caught, and the derivative trusted elsewhere.
    assert trusted.any() and not trusted.all(), sensitivity
    with pytest.raises(Exception, match="met other events"):
        missed = float(eps[np.argmin(trusted)])
        jax.grad(final)(1.0, missed, "forward_sensitivity", True).block_until_ready()


def test_backsolve_refuses_jumps_at_call_time():
    with pytest.raises(ValueError, match="terminal events only.*'recursive'"):
        _bounces(0.8, "backsolve")


def test_zeno_ball_ends_with_max_jumps_reached():
    ball = lambda t, y, e: jnp.stack([y[1], -G * jnp.ones_like(y[1])])
    event = odeckpt.Event(
        lambda t, y, e: y[0], direction=-1, terminal=False, max_jumps=5,
        update=lambda t, y, e: jnp.stack([y[0], -e * y[1]]),
    )  # fmt: skip
    sol = odeckpt.solve(ball, jnp.array([1.0, 0.0]), (0.0, 10.0), args=0.5, event=event,
                        throw=False)  # fmt: skip
    assert sol.status == odeckpt.Status.max_jumps_reached
    with pytest.raises(Exception, match="max_jumps"):
        odeckpt.solve(ball, jnp.array([1.0, 0.0]), (0.0, 10.0), args=0.5, event=event)


@pytest.mark.parametrize("solver", slow_unless(["tsit5", "kvaerno5"], fast={"tsit5"}))
def test_zeno_ball_never_falls_through_the_floor(solver):
    # e = 0.5 from h = 1: infinitely many bounces before t = sqrt(2 / G) * 3 = 1.3546. Past
    # the resolution of t the bounces cannot be followed: the solve must say so (the default
    # max_jumps is exhausted), never go on below the floor as if it had succeeded.
    ball = lambda t, y, e: jnp.stack([y[1], -G * jnp.ones_like(y[1])])
    event = odeckpt.Event(
        lambda t, y, e: y[0], direction=-1, terminal=False,
        update=lambda t, y, e: jnp.stack([y[0], -e * y[1]]),
    )  # fmt: skip
    sol = odeckpt.solve(ball, jnp.array([1.0, 0.0]), (0.0, 1.5), args=0.5, event=event,
                        solver=solver, rtol=1e-8, atol=1e-8, throw=False, max_steps=2048,
                        saveat=odeckpt.SaveAt(steps=True))  # fmt: skip
    assert sol.status == odeckpt.Status.max_jumps_reached
    heights = np.asarray(sol.ys[:, 0])[np.isfinite(np.asarray(sol.ts))]
    assert heights.min() > -1e-12  # at most rounding below the floor, never a fall through it
    zeno = np.sqrt(2 / G) * 3
    assert float(sol.ts[int(sol.stats.num_accepted_steps) - 1]) == pytest.approx(zeno, rel=1e-9)


def test_jump_ts_are_landed_on_exactly():
    # Piecewise forcing: +1 before t = 0.5, -2 after. Exact: y(1) = 0.5 - 1 = -0.5.
    forcing = lambda t, y, args: jnp.where(t < 0.5, 1.0, -2.0) * jnp.ones_like(y)
    saveat = odeckpt.SaveAt(steps=True)
    sol = odeckpt.solve(forcing, jnp.array([0.0]), (0.0, 1.0), jump_ts=jnp.array([0.5, 2.0]),
                        saveat=saveat, max_steps=64)  # fmt: skip
    ts = np.asarray(sol.ts)[np.isfinite(sol.ts)]
    assert np.nextafter(0.5, 0) in ts  # the step before the jump ends at the last time before
    np.testing.assert_allclose(sol.ys[np.isfinite(sol.ts)][-1], [-0.5], atol=1e-14)
    assert int(sol.stats.num_rejected_steps) == 0
    without = odeckpt.solve(forcing, jnp.array([0.0]), (0.0, 1.0), saveat=saveat, max_steps=64)
    assert int(without.stats.num_rejected_steps) > 0


def test_jump_ts_with_constant_steps_keep_the_offline_schedule():
    forcing = lambda t, y, args: jnp.where(t < 0.25, 1.0, -2.0) * jnp.ones_like(y)

    def final(y0):
        sol = odeckpt.solve(forcing, y0, (0.0, 1.0), solver="rk4", dt0=0.1,
                            jump_ts=jnp.array([0.25]), adjoint="recursive")  # fmt: skip
        return sol.ys[-1, 0], sol.stats

    (value, stats), grad = jax.value_and_grad(final, has_aux=True)(jnp.array([0.0]))
    np.testing.assert_allclose(value, 0.25 - 1.5, atol=1e-13)
    np.testing.assert_allclose(grad, [1.0])
    assert int(stats.num_steps) == 11  # 0.1, 0.2, 0.25-, 0.35, ..., 0.95, 1.0


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ["recursive", "forward_sensitivity"])
def test_each_lane_finds_its_own_event_under_vmap(adjoint):
    def hit(h):
        sol = odeckpt.solve(fall, jnp.stack([h, 0.0]), (0.0, 1.0), args=(h, G), event=FLOOR,
                            max_steps=64, adjoint=adjoint)  # fmt: skip
        return sol.ts[-1], sol.event

    hs = jnp.array([0.5, 1.0, 2.0, 10.0])  # the last one does not reach the floor by t = 1
    ts, events = jax.vmap(hit)(hs)
    expected = np.minimum(np.sqrt(2 * np.asarray(hs) / G), 1.0)
    np.testing.assert_allclose(ts, expected, rtol=1e-13)
    np.testing.assert_array_equal(events, [0, 0, 0, -1])
    grads = jax.vmap(jax.grad(lambda h: hit(h)[0]))(hs)
    np.testing.assert_allclose(grads, [*(1 / np.sqrt(2 * np.asarray(hs[:3]) * G)), 0.0])


@pytest.mark.parametrize("direction, expected", [(None, 0.3), (-1, 0.3), (1, 0.45)])
def test_two_crossings_in_one_step(direction, expected):
    # y = t; fn = (y - 0.3)(y - 0.45) is positive at both ends of the one step [0, 1].
    event = odeckpt.Event(lambda t, y, args: (y[0] - 0.3) * (y[0] - 0.45), direction=direction)
    sol = odeckpt.solve(lambda t, y, args: jnp.ones_like(y), jnp.array([0.0]), (0.0, 1.0),
                        event=event, controller=odeckpt.ConstantStep(), dt0=1.0)  # fmt: skip
    assert int(sol.stats.num_steps) == 1
    np.testing.assert_allclose(sol.ts[-1], expected, rtol=1e-14)


def test_two_events_the_earlier_fires():
    events = (
        odeckpt.Event(lambda t, y, args: y[0] - 0.7),
        odeckpt.Event(lambda t, y, args: y[0] - 0.4),
    )
    sol = odeckpt.solve(lambda t, y, args: jnp.ones_like(y), jnp.array([0.0]), (0.0, 1.0),
                        event=events, controller=odeckpt.ConstantStep(), dt0=1.0)  # fmt: skip
    assert int(sol.event) == 1
    np.testing.assert_allclose(sol.ts[-1], 0.4, rtol=1e-14)


def test_backwards_in_time_direction_is_along_the_solve():
    # y = t from t = 1 down to 0: y - 0.5 goes from positive to negative as the solve proceeds
    # (a falling crossing, as scipy's solve_ivp counts it), though it rises with t.
    flow = lambda t, y, args: jnp.ones_like(y)
    rising = odeckpt.Event(lambda t, y, args: y[0] - 0.5, direction=1)
    falling = odeckpt.Event(lambda t, y, args: y[0] - 0.5, direction=-1)
    sol = odeckpt.solve(flow, jnp.array([1.0]), (1.0, 0.0), event=rising)
    assert int(sol.event) == -1
    sol = odeckpt.solve(flow, jnp.array([1.0]), (1.0, 0.0), event=falling)
    np.testing.assert_allclose(sol.ts[-1], 0.5, rtol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("adjoint", ["recursive", "forward_sensitivity"])
def test_event_time_derivative_backwards_in_time(adjoint):
    # y = exp(-k (t - 2)) from t = 2 down to 0 reaches 3 at t* = 2 - log(3) / k.
    def hit(k):
        event = odeckpt.Event(lambda t, y, k: y[0] - 3.0)
        sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (2.0, 0.0), args=k,
                            event=event, adjoint=adjoint, rtol=1e-10, atol=1e-10)  # fmt: skip
        return sol.ts[-1]

    k = 0.7
    np.testing.assert_allclose(hit(k), 2 - np.log(3) / k, rtol=1e-10)
    np.testing.assert_allclose(jax.grad(hit)(k), np.log(3) / k**2, rtol=1e-8)


def test_zero_at_t0_does_not_fire():
    # fn = y starts at 0 and rises: no event at t0; it fires when fn falls through 0 later.
    event = odeckpt.Event(lambda t, y, args: y[0])
    osc = lambda t, y, args: jnp.stack([y[1], -y[0]])
    sol = odeckpt.solve(osc, jnp.array([0.0, 1.0]), (0.0, 10.0), event=event, rtol=1e-10)
    np.testing.assert_allclose(sol.ts[-1], np.pi, rtol=1e-8)


def test_save_times_after_a_terminal_event_are_not_reached():
    ts = jnp.linspace(0.0, 1.0, 11)
    sol = odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G), event=FLOOR,
                        saveat=odeckpt.SaveAt(ts=ts, t1=True))  # fmt: skip
    t_star = np.sqrt(2 / G)
    reached = np.asarray(ts) <= t_star
    np.testing.assert_allclose(sol.ys[:11][reached, 0], 1 - G * np.asarray(ts)[reached] ** 2 / 2)
    assert np.all(np.isinf(np.asarray(sol.ys[:11])[~reached]))
    np.testing.assert_allclose(sol.ts[-1], t_star, rtol=1e-13)


def test_dense_output_ends_at_the_event():
    sol = odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G), event=FLOOR,
                        saveat=odeckpt.SaveAt(dense=True, t1=True))  # fmt: skip
    t = jnp.linspace(0.0, sol.ts[-1], 7)
    np.testing.assert_allclose(sol.evaluate(t)[:, 0], 1 - G * t**2 / 2, atol=1e-13)
    with pytest.raises(ValueError, match="outside the solved span"):
        sol.evaluate(0.5)


def _while_loops(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("while[")


def test_no_event_costs_nothing():
    y0 = jnp.array([1.0, 0.0])
    never = odeckpt.Event(lambda t, y, args: y[0] + 100.0)
    solve = lambda y0, event: odeckpt.solve(fall, y0, (0.0, 0.4), args=(1.0, G), event=event)
    plain, with_event = solve(y0, None), solve(y0, never)
    # An event that never fires leaves every step as it was.
    assert int(plain.stats.num_steps) == int(with_event.stats.num_steps)
    np.testing.assert_array_equal(plain.ys, with_event.ys)
    # Without events the program holds no trace of them: only the root finders' loops differ
    # (one per event), and the compiled program of a solve without events is the smaller.
    loops = [_while_loops(lambda y, e=e: solve(y, e).ys, y0) for e in (None, never, (never,) * 2)]
    assert loops[1] - loops[0] == 1 and loops[2] - loops[0] == 2
    size = lambda e: len(jax.jit(lambda y: solve(y, e).ys).lower(y0).as_text())
    assert size(None) < size(never)
    assert plain.event is None


def test_checkpointed_schedule_is_unchanged_by_events():
    never = odeckpt.Event(lambda t, y, args: y[0] + 100.0)
    adjoint = odeckpt.RecursiveCheckpointAdjoint(checkpoints=3)
    solve = lambda event: odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 0.4), args=(1.0, G),
                                        event=event, adjoint=adjoint)  # fmt: skip
    a, b = solve(None).stats, solve(never).stats
    assert int(a.num_checkpoints) == int(b.num_checkpoints)
    assert int(a.num_recomputed_steps) == int(b.num_recomputed_steps)


@pytest.mark.parametrize(
    "fn, error, match",
    [
        (lambda t, y, args: y, ValueError, "must be a scalar"),
        (lambda t, y, args: y[0] > 0, TypeError, "real floating"),
        (lambda t, y, args: jnp.asarray(1, jnp.int32), TypeError, "real floating"),
        (lambda t, y, args: y[0] + 0j, TypeError, "real floating"),
        (lambda t, y, args: (y[0], y[1]), TypeError, "not one scalar"),
    ],
)
def test_bad_event_functions_name_the_fix(fn, error, match):
    with pytest.raises(error, match=match + ".*Fix"):
        odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G),
                      event=odeckpt.Event(fn))  # fmt: skip


@pytest.mark.parametrize(
    "update",
    [
        lambda t, y, args: y[0],
        lambda t, y, args: (y, y),
        lambda t, y, args: y.astype(jnp.float32),
    ],
)
def test_updates_that_change_the_state_name_the_fix(update):
    event = odeckpt.Event(lambda t, y, args: y[0], terminal=False, update=update)
    with pytest.raises(ValueError, match="update.*Fix"):
        odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G), event=event)


def test_event_configuration_errors():
    with pytest.raises(ValueError, match="terminal=False"):
        odeckpt.Event(lambda t, y, a: y[0], update=lambda t, y, a: y)
    with pytest.raises(ValueError, match="would change nothing"):
        odeckpt.Event(lambda t, y, a: y[0], terminal=False)
    with pytest.raises(ValueError, match="direction"):
        odeckpt.Event(lambda t, y, a: y[0], direction=2)
    with pytest.raises(TypeError, match="not an event"):
        odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G), event=len)
    with pytest.raises(ValueError, match="jump_ts"):
        odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 1.0), args=(1.0, G),
                      jump_ts=jnp.zeros((2, 2)))  # fmt: skip


@pytest.mark.parametrize("adjoint", ["backsolve", "forward_sensitivity"])
def test_event_functions_closing_over_arrays_are_refused(adjoint):
    level = jnp.asarray(0.2)
    event = odeckpt.Event(lambda t, y, args: y[0] - level)
    loss = lambda h: odeckpt.solve(fall, jnp.stack([h, 0.0]), (0.0, 1.0), args=(h, G),
                                   event=event, adjoint=adjoint).ts[-1]  # fmt: skip
    with pytest.raises(ValueError, match="closes over arrays.*args"):
        jax.grad(loss)(1.0)
