"""Events in a solve with forward sensitivities: the crossings are located on the state, and at
each one the sensitivities follow the event time.

At a crossing `g(tau*, y(tau*), p) = 0` the event time moves with the parameters by the
implicit function theorem, `dtau*/dp = -(g_y s + g_p) / (g_y f + g_tau)` (`s` the sensitivity
at the fixed time `tau*`), and the state there by `s + f dtau*/dp`. A jump `y+ = u(tau*, y-, p)`
then gives `s+ = u_y (s- + f- dtau*) + u_p + (u_tau - f+) dtau*`: the sensitivity jump
condition (Rozenvasser 1967; Galán, Feehery & Barton, "Parametric sensitivity functions for
hybrid discrete/continuous systems", Appl. Numer. Math. 31 (1999)).

A known discontinuity of `f` in time (one of `jump_ts`) is such a crossing whose time is an
input: there the update is the identity and `dtau*` the jump time's own tangent, so
`s+ = s- + (f- - f+) dtau*`.
"""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._autodiff import on_auto_axes
from ..._loop import Event, EventSet, after, before
from ..._types import Scalar, VectorField, Y
from .._derivatives import crossing_tangent
from ._stepper import Augmented, SensitivityArgs, differentiable_part


class CrossingTangents(eqx.Module):
    """Along each direction (leading axis): the tangent of the event time `tau`, and of the
    state at the event (`s + f dtau`)."""

    tau: jax.Array
    y: Y


def crossing_tangents(
    g: Callable, f: VectorField, tau: Scalar, y: Y, args: SensitivityArgs, s: Y, rate: Y = None
) -> CrossingTangents:
    """The tangents at a crossing of `g(tau, y, args) = 0` (internal time) of the solution of
    `y' = f(tau, y, args)`, whose sensitivities at the fixed time `tau` are `s`, along
    `args.directions`; `rate` is the solution's slope there (`None`: `f`, that of an ODE)."""
    diff, static = differentiable_part(f, args.args)

    def event(tau, y, diff):
        return g(tau, y, eqx.combine(diff, static)[1])

    rate = f(tau, y, args.args) if rate is None else rate
    along = lambda s, d: crossing_tangent(event, tau, y, diff, rate, s, d)
    dtau, at_event = jax.vmap(along)(s, args.directions)
    return CrossingTangents(dtau, at_event)


def sensitivity_events(events: EventSet, f: VectorField) -> EventSet:
    """`events` for the loop of `Augmented` states: located on the state, each `update` also
    jumping the sensitivities (with `f`, the vector field in internal time)."""
    direction = events.time_direction

    def wrapped(event: Event) -> Event:
        fn = lambda t, y, args: event.fn(t, y.y, args.args)
        event_update = event.update
        if event_update is None:
            return dataclasses.replace(event, fn=fn)

        def update(t, y: Augmented, args: SensitivityArgs) -> Augmented:
            tau = direction * t
            g = lambda tau, y, a: event.fn(direction * tau, y, a)
            before = crossing_tangents(g, f, tau, y.y, args, y.s)
            diff, static = differentiable_part(f, args.args)

            def jump(tau, y, diff):
                return event_update(direction * tau, y, eqx.combine(diff, static)[1])

            y_after = jump(tau, y.y, diff)
            rate_after = f(tau, y_after, args.args)

            def along(dtau, s, d):
                moved = jax.jvp(jump, (tau, y.y, diff), (dtau, s, d))[1]
                return jax.tree.map(lambda m, r: m - r * dtau.astype(r.dtype), moved, rate_after)

            s_after = jax.vmap(along)(before.tau, before.y, args.directions)
            return Augmented(y_after, s_after)

        return dataclasses.replace(event, fn=fn, update=update)

    return EventSet(tuple(map(wrapped, events.events)), direction)


def sensitivity_jumps(f: VectorField, jump_ts: jax.Array) -> Callable:
    """The `IntegrationLoop.jump_update` of the loop of `Augmented` states at the known
    discontinuities `jump_ts` of `f` (sorted internal times, with `f` in internal time): the
    state is unchanged, and the sensitivities jump by `(f- - f+) dtau` along each direction,
    `dtau` the jump time's tangent (`SensitivityArgs.jump_directions`), `f-` and `f+` the
    vector field at the last time before it and the first after it, where the steps around
    it end and start."""

    def update(tau, y: Augmented, args: SensitivityArgs) -> Augmented:
        # Equal jump times are one discontinuity, landed on once: it moves with the first.
        assert args.jump_directions is not None  # given with the jump times
        # (Under `vmap` the jump times may be shared and `tau` a lane's own: `on_auto_axes`.)
        dtau = on_auto_axes(
            lambda d, ts, tau: d[:, jnp.searchsorted(ts, tau, side="left")],
            args.jump_directions, jump_ts, tau,
        )  # fmt: skip
        change = jax.tree.map(
            jnp.subtract, f(before(jnp, tau), y.y, args.args), f(after(jnp, tau), y.y, args.args)
        )

        def moved(s, c):
            return s + dtau.reshape((-1,) + (1,) * c.ndim).astype(s.dtype) * c[None]

        return Augmented(y.y, jax.tree.map(moved, y.s, change))

    return update
