"""Events: a sign change of `fn(t, y, args)` across a step, located on the step's continuous
extension, after which the solve stops (`terminal`) or jumps (`update`) and goes on.

The loop (`IntegrationLoop.step`) asks `EventSet.locate` where the first crossing in an
accepted step is. The crossing time is found to the resolution of `t` by a bracketing root
finder on the step's own interpolant, without derivatives; its derivatives, of every order,
are those of the implicit function theorem at the crossing, attached by a derivative rule
(`_root`), so every adjoint that differentiates the discrete solve differentiates the event
time.
"""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._autodiff import closure_convert, stack, take
from .._types import Args, BoolScalar, IntScalar, Scalar, Y
from ..checkpointing import lockstep_while_loop
from ._dense import polynomial

SUBDIVISIONS = 8
"""Each accepted step is sampled on this many equal pieces of its interpolant before
bracketing, so that two crossings in one step (a sign change and back, invisible at the step's
ends) are found, the earlier first, unless they fall in one piece."""

MAX_ROOT_ITERATIONS = 100
"""A bound on the root finder's iterations (bisection alone needs about 55 in float64)."""


class Event(eqx.Module):
    """An event: the solution crosses a zero of `fn(t, y, args)`.

    An event happens in a step when `fn` changes sign across it: from negative to zero or
    positive (rising), or from positive to zero or negative (falling). The step is first
    sampled on its continuous extension at a few points, so that two crossings within one step
    are both seen, the earlier first; the crossing time is then located on the extension to
    the resolution of `t` by a bracketing root finder (Illinois, with bisection whenever it
    stalls). The reported time and state are the last point before the sign changes (within
    that resolution).

    A value of exactly zero is not a crossing on its own: an event whose `fn` is zero at `t0`
    does not fire at `t0`; it fires at the first sign change after it.

    **Arguments:**

    - `fn`: `fn(t, y, args)` returning a real floating scalar (not a bool or an integer:
        return e.g. `y[0] - 1.0`, not `y[0] > 1.0`).
    - `direction`: `None` for both directions, `+1` for rising crossings only (from negative
        to positive as the solve proceeds, also when it integrates backwards in time, as in
        scipy's `solve_ivp`), `-1` for falling ones only.
    - `terminal`: end the solve at the event (`sol.ts[-1]`/`sol.ys[-1]` are then the event's
        time and state with the default `saveat`, and `sol.event` the event's index).
    - `update`: `update(t, y, args) -> y`, a jump of the state at the event, after which the
        solve goes on (needs `terminal=False`): the stepper and the step-size controller
        restart from the new state. It must return the state's structure, shapes and dtypes.
    - `max_jumps`: how many times an event with `update` may fire; one more ends the solve
        with `Status.max_jumps_reached` (a Zeno system, such as a ball bouncing ever faster).

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def fall(t, y, g):  # height and velocity
        return jnp.stack([y[1], -g])

    floor = odeckpt.Event(lambda t, y, g: y[0], direction=-1)
    sol = odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 10.0), args=9.81, event=floor)
    sol.ts[-1]  # sqrt(2 / 9.81)
    bounce = odeckpt.Event(
        lambda t, y, g: y[0], direction=-1, terminal=False,
        update=lambda t, y, g: jnp.stack([y[0], -0.8 * y[1]]),
    )
    sol = odeckpt.solve(fall, jnp.array([1.0, 0.0]), (0.0, 2.0), args=9.81, event=bounce)
    ```

    **References:** M. Shampine & S. Thompson, "Event location for ordinary differential
    equations", Comput. Math. Appl. 39 (2000); the Illinois method: M. Dowell & P. Jarratt,
    BIT 11 (1971); the derivatives of the event time and the jump: R. T. Q. Chen, B. Amos &
    M. Nickel, "Learning neural event functions for ordinary differential equations",
    ICLR 2021.
    """

    fn: Callable[[Scalar, Y, Args], Scalar]
    direction: int | None = eqx.field(default=None, static=True)
    terminal: bool = eqx.field(default=True, static=True)
    update: Callable[[Scalar, Y, Args], Y] | None = None
    max_jumps: int = eqx.field(default=256, static=True)

    def __check_init__(self):
        if not callable(self.fn):
            raise TypeError(
                f"Event(fn={self.fn!r}) is not callable. Fix: pass a function "
                "`fn(t, y, args)` returning a real scalar, e.g. `lambda t, y, args: y[0]`."
            )
        if self.direction not in (None, 1, -1):
            raise ValueError(
                f"Event(direction={self.direction!r}) must be None (both), +1 (rising) or -1 "
                "(falling)."
            )
        if self.update is not None and not callable(self.update):
            raise TypeError(
                f"Event(update={self.update!r}) is not callable. Fix: pass a function "
                "`update(t, y, args) -> y`."
            )
        if self.terminal and self.update is not None:
            raise ValueError(
                "Event(update=...) jumps and goes on, but the event is terminal (the default). "
                "Fix: pass `terminal=False` with `update=`."
            )
        if not self.terminal and self.update is None:
            raise ValueError(
                "Event(terminal=False) without `update=` would change nothing. Fix: pass "
                "`update=fn(t, y, args) -> y` for a jump, or `terminal=True` to stop there."
            )
        if isinstance(self.max_jumps, bool) or not isinstance(self.max_jumps, int):
            raise TypeError(f"Event(max_jumps={self.max_jumps!r}) must be an int.")
        if self.max_jumps < 1:
            raise ValueError(f"Event(max_jumps={self.max_jumps}) must be at least 1.")


class EventState(eqx.Module):
    """What the loop carries for its events: how often each has jumped, the index of the
    terminal event that ended the solve (`-1` while none has), and the event whose jump the
    current point follows (`jumped`, `-1` if none) with its `fn` at the crossing before the
    jump (`jumped_value`)."""

    num_jumps: Array
    event: IntScalar
    jumped: IntScalar
    jumped_value: Scalar

    @classmethod
    def make(cls, count: int, dtype) -> "EventState":
        minus_one = jnp.asarray(-1, jnp.int32)
        return cls(jnp.zeros((count,), jnp.int32), minus_one, minus_one, jnp.zeros((), dtype))


class Crossing(eqx.Module):
    """The first crossing in a step: whether there is one, which event (`index`), where in
    the step (`theta`, normalised time) and the time `t` and state `y` there, and that event's
    `fn` there (`value`); `nonfinite`: some event's `fn` was NaN or inf in the step."""

    found: BoolScalar
    nonfinite: BoolScalar
    index: IntScalar
    theta: Scalar
    t: Scalar
    y: Y
    value: Scalar


class Outcome(eqx.Module):
    """What an accepted step's crossing does: the event state after it, whether the state
    jumps, whether that jump was one too many (`max_jumps`), whether an event's `fn` was NaN
    or inf."""

    state: EventState
    jumping: BoolScalar
    too_many: BoolScalar
    nonfinite: BoolScalar


class EventSet(eqx.Module):
    """The events of a solve, as the loop sees them: in internal time `tau = direction * t`
    (`time_direction` is `direction`)."""

    events: tuple[Event, ...]
    time_direction: Scalar | float

    def __len__(self) -> int:
        return len(self.events)

    def _value(self, event: Event, tau: Scalar, y: Y, args: Args) -> Scalar:
        return event.fn(self.time_direction * tau, y, args)

    def values(self, tau: Scalar, y: Y, args: Args) -> Array:
        """Every event's `fn` at `(tau, y)`, as a vector."""
        return jnp.stack([self._value(e, tau, y, args) for e in self.events])

    def update(self, index: IntScalar, tau: Scalar, y: Y, args: Args) -> Y:
        """The state after the jump of event `index` (unchanged for a terminal event)."""
        t = self.time_direction * tau
        jumps = [y if e.update is None else e.update(t, y, args) for e in self.events]
        if len(jumps) == 1:
            return jumps[0]
        return jax.tree.map(lambda *leaves: take(stack(leaves), index), *jumps)

    def closure_converted(self, adjoint: str, t0: Scalar, y0: Y, args: Args) -> "EventSet":
        """These events with their functions (`fn`, `update`) closure-converted, so that they
        may cross a custom derivative rule's boundary; raises (naming the fix) if one closes
        over inexact arrays, whose derivatives `adjoint` (its name) reaches only through
        `args`."""
        events = []
        for event in self.events:
            fn = closure_convert(event.fn, t0, y0, args)
            update = event.update
            if update is not None:
                update = closure_convert(update, t0, y0, args)
            if any(eqx.is_inexact_array(x) for x in jax.tree.leaves((fn, update))):
                raise ValueError(
                    f"{adjoint}: an Event's fn or update closes over arrays, whose derivatives "
                    f"{adjoint} reaches only through `args`. Fix: pass them through `args` "
                    "(`fn(t, y, args)`), or use adjoint='recursive'."
                )
            events.append(dataclasses.replace(event, fn=fn, update=update))
        return EventSet(tuple(events), self.time_direction)

    @property
    def terminal(self) -> Array:
        return jnp.array([e.terminal for e in self.events])

    @property
    def max_jumps(self) -> Array:
        return jnp.array([e.max_jumps for e in self.events], jnp.int32)

    def outcome(self, state: EventState, crossing: Crossing, accept: BoolScalar) -> Outcome:
        """What `crossing` in a step (accepted if `accept`) does, from the event `state`."""
        index = crossing.index
        fired = accept & crossing.found
        terminal = take(self.terminal, index)
        jumping = fired & ~terminal
        too_many = jumping & (take(state.num_jumps, index) >= take(self.max_jumps, index))
        nonfinite = accept & crossing.nonfinite
        jumping = jumping & ~too_many & ~nonfinite
        after = EventState(
            num_jumps=state.num_jumps.at[index].add(jumping.astype(jnp.int32)),
            event=jnp.where(fired & terminal, index, state.event),
            # A rejected step leaves the point, and so what it follows, as it was.
            jumped=jnp.where(accept, jnp.where(jumping, index, -1), state.jumped),
            jumped_value=jnp.where(accept, crossing.value, state.jumped_value).astype(
                state.jumped_value.dtype
            ),
        )
        return Outcome(after, jumping, too_many, nonfinite)

    def locate(
        self, t0: Scalar, t1: Scalar, y0: Y, y1: Y, dense: Y, args: Args, state: EventState,
        found: BoolScalar | None = None,
    ) -> Crossing:  # fmt: skip
        """The first crossing in the step from `(t0, y0)` to `(t1, y1)` with continuous
        extension `dense`, the events being in `state` at its start. With `found` given (a
        recomputation following its recorded decision), whether there is one is not decided
        again."""
        h = t1 - t0
        inner = jnp.arange(1, SUBDIVISIONS, dtype=t0.dtype) / SUBDIVISIONS
        rows = jax.tree.map(lambda c: polynomial(c, inner), dense)
        middle = jax.vmap(lambda th, y: self.values(t0 + th * h, y, args))(inner, rows)
        samples = jnp.concatenate(
            [self.values(t0, y0, args)[None], middle, self.values(t1, y1, args)[None]]
        )
        thetas = jnp.concatenate([jnp.zeros((1,), t0.dtype), inner, jnp.ones((1,), t0.dtype)])
        # The smallest bracket the root finder resolves: the rounding of t, in units of h.
        scale = jnp.maximum(jnp.abs(t0), jnp.abs(t1))
        tol = 4 * jnp.finfo(t0.dtype).eps * jnp.maximum(1, scale / jnp.where(h > 0, h, 1))
        roots, values, founds = [], [], []
        for i, event in enumerate(self.events):
            g = lambda th, e=event: self._value(e, t0 + th * h, _at(dense, th), args)
            start = _start_value(g, samples[0, i], tol, event.direction, state, i)
            samples = samples.at[0, i].set(start)
            crosses = self._crosses(event, samples[:-1, i], samples[1:, i])
            piece = jnp.argmax(crosses)
            any_cross = jnp.any(crosses)
            lo = jnp.where(any_cross, take(thetas, piece), 1)
            hi = jnp.where(any_cross, take(thetas, piece + 1), 1)
            theta = _illinois(g, lo, hi, samples[piece, i], samples[piece + 1, i], tol)
            root, value = _implicit_root(g, theta, any_cross)
            roots.append(root)
            values.append(value)
            founds.append(any_cross)
        roots, founds = stack(roots), stack(founds)
        index = jnp.argmin(jnp.where(founds, jax.lax.stop_gradient(roots), jnp.inf))
        theta = jnp.where(jnp.any(founds), take(roots, index), 1)
        any_found = jnp.any(founds) if found is None else found
        nonfinite = ~jnp.all(jnp.isfinite(samples))
        value = jax.lax.stop_gradient(take(stack(values), index))
        return Crossing(any_found, nonfinite, index.astype(jnp.int32), theta, t0 + theta * h,
                        _at(dense, theta), value)  # fmt: skip

    def _crosses(self, event: Event, before: Array, after: Array) -> Array:
        """Whether `fn` changes sign (in `event`'s direction, along the solve) between
        consecutive samples."""
        rising = (before < 0) & (after >= 0)
        falling = (before > 0) & (after <= 0)
        if event.direction is None:
            return rising | falling
        return rising if event.direction > 0 else falling


def _start_value(
    g: Callable[[Scalar], Scalar], g0: Scalar, tol: Scalar, direction: int | None,
    state: EventState, index: int,
) -> Scalar:  # fmt: skip
    """The value of event `index`'s `fn` that counts at the start of a step: `g0 = g(0)`,
    unless it is zero to the resolution of the root finder.

    Rounding leaves the state at a located crossing on either side of the zero, and a step
    that starts on the wrong side misses a crossing within its first piece: a ball bouncing
    ever lower would fall through the floor. So:
    - right after this event's own jump, where the jump left `fn` where it was (within
        `|g'(0)| * tol` of its value at the crossing), an event with a direction starts on
        the side its crossings come from: if `fn` is past the zero again by the next sample,
        the event fires again (a Zeno cascade ends with `Status.max_jumps_reached`);
    - otherwise, within `|g'(0)| * tol` of zero (an event's zero at `t0`), the sign is the one
        `g` takes just after the start, `g'(0)`'s."""
    g0, tol = jax.lax.stop_gradient((g0, tol))
    zero = jnp.zeros_like(tol)
    slope = jax.lax.stop_gradient(jax.jvp(g, (zero,), (jnp.ones_like(zero),))[1])
    resolution = jnp.abs(slope) * tol
    value = jnp.where(jnp.abs(g0) <= resolution, slope * tol, g0)
    if direction is not None:
        unmoved = jnp.abs(g0) <= jnp.abs(state.jumped_value) + resolution
        before = -direction * jnp.maximum(resolution, jnp.finfo(g0.dtype).tiny)
        value = jnp.where((state.jumped == index) & unmoved, before, value)
    return value.astype(g0.dtype)


def _at(dense: Y, theta: Scalar) -> Y:
    return jax.tree.map(lambda c: polynomial(c, theta), dense)


def restrict(dense: Y, theta: Scalar) -> Y:
    """The continuous extension `dense` (in a step's normalised time) of the part of the step
    up to `theta`, in that part's own normalised time: coefficient `j` times `theta**j`."""

    def leaf(c):
        powers = theta ** jnp.arange(c.shape[0], dtype=theta.dtype)
        return c * powers.astype(c.dtype).reshape((-1,) + (1,) * (c.ndim - 1))

    return jax.tree.map(leaf, dense)


class _Bracket(NamedTuple):
    """The carry of `_illinois`: the bracket `[lo, hi]` and `g` at its ends, which end the last
    step kept (`1`: `lo`, `-1`: `hi`, `0`: none yet), the width recorded every second
    iteration (to bisect when two steps have not halved it), and the iterations taken."""

    lo: Scalar
    hi: Scalar
    g_lo: Scalar
    g_hi: Scalar
    kept: IntScalar
    width_before: Scalar
    num_iterations: IntScalar


def _illinois(g, lo: Scalar, hi: Scalar, g_lo: Scalar, g_hi: Scalar, tol: Scalar) -> Scalar:
    """The last point before `g` changes sign in `[lo, hi]` (where `g_lo` has the old sign,
    non-zero, and `g_hi` the new one or zero), to within `tol`: the Illinois variant of regula
    falsi, bisecting when two steps have not halved the bracket. Not differentiated."""
    lo, hi, g_lo, g_hi, tol = jax.lax.stop_gradient((lo, hi, g_lo, g_hi, tol))
    old = jnp.sign(g_lo)

    def cond(c: _Bracket) -> BoolScalar:
        return (c.hi - c.lo > tol) & (c.num_iterations < MAX_ROOT_ITERATIONS)

    def body(c: _Bracket) -> _Bracket:
        width = c.hi - c.lo
        falsi = c.hi - c.g_hi * width / jnp.where(c.g_hi != c.g_lo, c.g_hi - c.g_lo, 1)
        bisect = width > 0.5 * c.width_before
        m = jnp.where(bisect, c.lo + 0.5 * width, falsi)
        # At least half a tolerance inside, so that the bracket closes on the root.
        m = jnp.clip(m, c.lo + 0.5 * tol, c.hi - 0.5 * tol)
        gm = jax.lax.stop_gradient(g(m))
        past = gm * old <= 0
        # Illinois: an end kept twice in a row has its value halved.
        g_lo = jnp.where(past, jnp.where(c.kept == 1, 0.5 * c.g_lo, c.g_lo), gm)
        g_hi = jnp.where(past, gm, jnp.where(c.kept == -1, 0.5 * c.g_hi, c.g_hi))
        lo, hi = jnp.where(past, c.lo, m), jnp.where(past, m, c.hi)
        width_before = jnp.where(c.num_iterations % 2 == 1, width, c.width_before)
        kept = jnp.where(past, 1, -1).astype(jnp.int32)
        return _Bracket(lo, hi, g_lo, g_hi, kept, width_before, c.num_iterations + 1)

    zero = jnp.zeros((), jnp.int32)
    init = _Bracket(lo, hi, g_lo, g_hi, kept=zero, width_before=2 * (hi - lo), num_iterations=zero)
    return lockstep_while_loop(cond, body, init).lo


def _implicit_root(
    g: Callable[[Scalar], Scalar], theta: Scalar, found: BoolScalar
) -> tuple[Scalar, Scalar]:
    """`theta` (a root of `g`, found without derivatives), with the derivatives of the implicit
    function theorem, of every order; `0` where nothing was `found`. Also returns `g(theta)`."""
    theta = jax.lax.stop_gradient(theta)
    # Closure-converted, the arrays `g` closes over (the step, `args`, an event's own) are
    # inputs of `_root`, so that its derivative rule sees their tangents.
    curve = closure_convert(g, theta)
    return _root(curve, theta, found), g(theta)


@eqx.filter_custom_jvp
def _root(g: Callable[[Scalar], Scalar], theta: Scalar, found: BoolScalar) -> Scalar:
    """`theta`, a root of `g` where `found`, with the derivatives of the implicit function
    theorem: `d theta = -(dg at fixed theta) / g'(theta)`."""
    del g, found
    return theta


@_root.def_jvp
def _root_jvp(primals, tangents):
    g, theta, found = primals
    d_g, _, _ = tangents
    # `theta` arrives without derivatives (the root finder is not differentiated); taken
    # through `_root` again, it carries those of an enclosing differentiation, so that the
    # tangent below, a function of `theta`, has the right derivatives too (second derivatives).
    theta = _root(g, theta, found)
    _, moved = eqx.filter_jvp(lambda g: g(theta), (g,), (d_g,))
    # None: nothing the event's value depends on moves (e.g. `fn = t - t_event`, fixed times).
    moved = jnp.zeros_like(theta) if moved is None else moved
    slope = jax.jvp(g, (theta,), (jnp.ones_like(theta),))[1]
    slope = jnp.where(found, slope, 1)
    return theta, jnp.where(found, -moved / slope, 0).astype(theta.dtype)
