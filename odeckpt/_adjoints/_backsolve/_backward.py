"""The backward solves of the continuous adjoints, from the final time back to `t0`, stopping at
every stop (`_stops`): with `y` integrated backwards beside the adjoint
(`IntegrateStateBackwards`), or read from forward re-solves (`ReadForwardStates`)."""

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._autodiff import cond, on_auto_axes, take
from ..._error_norm import per_leaf, scaled_distance
from ..._loop import AbstractAdaptiveController, IntegrationLoop, LoopState, Outputs, after, before
from ..._saveat import SaveAt
from ..._status import Status
from ..._types import BoolScalar, IntScalar, Scalar
from ...checkpointing import lockstep_while_loop
from .._base import while_loop
from ._problem import Problem
from ._setup import AbstractBackwardSolve, BackwardSetup
from ._stops import Stops, StoredStates
from ._window import Window, solve_window


class BackwardStats(eqx.Module):
    """What the backward solve did: whether every stretch of it succeeded (and the
    reconstructed state stayed within `max_drift` of the forward one), its steps summed over
    the stretches, how often `y` was re-solved forwards, and the largest drift of the
    reconstructed `y` from the forward states it met (see `Backward.drift`)."""

    succeeded: BoolScalar
    num_accepted: IntScalar
    num_rejected: IntScalar
    num_window_solves: IntScalar
    max_drift: Scalar

    @classmethod
    def none(cls, dtype) -> "BackwardStats":
        zero = jnp.zeros((), jnp.int32)
        return cls(jnp.array(True), zero, zero, zero, jnp.zeros((), dtype))

    def add(self, other: "BackwardStats") -> "BackwardStats":
        return BackwardStats(
            succeeded=self.succeeded & other.succeeded,
            num_accepted=self.num_accepted + other.num_accepted,
            num_rejected=self.num_rejected + other.num_rejected,
            num_window_solves=self.num_window_solves + other.num_window_solves,
            max_drift=jnp.maximum(self.max_drift, other.max_drift),
        )


class Backward(eqx.Module):
    """One backward solve: its setup, the forward loop it differentiates, the initial and final
    forward states, the split vector field and its differentiated arrays `diff`, and its
    stops."""

    setup: BackwardSetup
    loop: IntegrationLoop
    init: LoopState
    final: LoopState
    problem: Problem
    diff: eqx.Module | tuple
    stops: Stops

    def segment(self, field, args, s0, s1, z, dt):
        """Integrate the backward system `field` from `s0` to `s1` (`s` the backward time, `-tau`
        or `origin - tau`, increasing as `tau` decreases). Returns the end
        value, the step size to go on with, and the segment's `BackwardStats`."""
        piece = IntegrationLoop(
            f=field, args=args, stepper=self.setup.error_stepper,
            controller=self.setup.controller, t_end=s1, ts=None, saveat=SaveAt(t1=True),
            max_steps=self.loop.max_steps,
        )  # fmt: skip
        start, _ = piece.init_state(s0, z, dt)
        done, _, _ = while_loop(piece, start, Outputs())
        # An empty segment (a stop at the time reached) evaluates nothing: it cannot fail.
        ok = (s0 >= s1) | ((done.status == Status.successful) & (done.t >= s1))
        # A segment shorter than `dt` says little about the step size beyond it.
        one_step = (done.num_steps == 1) & (done.num_accepted == 1)
        longest = jnp.where(one_step, jnp.maximum(dt, done.dt), done.dt)
        dt = jnp.where(done.num_steps == 0, dt, longest)
        zero = jnp.zeros((), jnp.int32)
        drift = jnp.zeros((), self.init.t.dtype)
        return done.y, dt, BackwardStats(ok, done.num_accepted, done.num_rejected, zero, drift)

    def first_dt(self, field, s0, z, args):
        """The first backward step size for the backward system `field` (whose last part is
        the parameter integral `g`). With the seminorm `g` takes no part in error control, so
        it takes none in choosing the first step either (its derivative, measured against
        `atol` while `g = 0`, would make that step vanishingly small)."""
        controller, stepper = self.setup.controller, self.setup.error_stepper
        if not isinstance(controller, AbstractAdaptiveController):
            return self.init.dt
        if not self.setup.seminorm:
            return controller.init(field, s0, z, field(s0, z, args), args, stepper, None)[0]
        *rest, g = z
        rest = tuple(rest)
        state_part = lambda s, r, d: tuple(field(s, (*r, g), d)[:-1])
        f0 = state_part(s0, rest, args)
        return controller.init(state_part, s0, rest, f0, args, stepper, None)[0]

    def last_jump(self, tau):
        """The last of the forward solve's known discontinuities `jump_ts` at or below `tau`
        (`-inf` if none). The backward solve crosses one as the forward solve does: a stretch
        ends on its near side and the next starts on its far side, so no stage sees across it."""
        jump_ts = self.loop.jump_ts
        if jump_ts is None:
            return jnp.full_like(tau, -jnp.inf)
        # (Under `vmap` the jump times may be shared and `tau` a lane's own: `on_auto_axes`.)
        search = lambda ts, tau: jnp.searchsorted(ts, tau, side="right")
        index = on_auto_axes(search, jump_ts, tau) - 1
        return jnp.where(index >= 0, take(jump_ts, jnp.maximum(index, 0)), -jnp.inf)

    def apply(self, j, y, a, g):
        return self.stops.apply(j, self.loop.stepper, self.problem, self.diff, y, a, g)

    def jump_cotangents(self, j, y, a, ct):
        return self.stops.jump_cotangents(j, self.problem, self.diff, y, a, ct)

    def drift_at(self, j, y) -> BackwardStats:
        """`drift` of the reconstructed state `y` at stop `j` (0 if `j` holds no forward
        state)."""
        anchored, forward = self.stops.anchor(j, y)
        return self.drift(y, forward, anchored)

    def drift(self, y, forward, measured) -> BackwardStats:
        """How far the reconstructed state `y` lies from the forward state `forward` (where
        `measured`, else 0): the root mean square of `(y - forward) / (atol + rtol |forward|)`,
        each tolerance the looser of the forward and the backward solve's (the two solutions
        are as accurate as the looser one). The stats fail if it exceeds `setup.max_drift`;
        after constant backward steps there are no tolerances to measure it in, and it is 0."""
        backward, dtype = self.setup.controller, self.init.t.dtype
        if not isinstance(backward, AbstractAdaptiveController):
            drift = jnp.zeros((), dtype)
        else:
            rtol, atol = per_leaf(backward.rtol, y), per_leaf(backward.atol, y)
            if isinstance(self.loop.controller, AbstractAdaptiveController):
                looser = lambda b, f: jax.tree.map(jnp.maximum, b, per_leaf(f, y))
                rtol = looser(rtol, self.loop.controller.rtol)
                atol = looser(atol, self.loop.controller.atol)
            distance = scaled_distance(y, forward, rtol, atol, symmetric=False)
            drift = jnp.where(measured, distance, 0).astype(dtype)
        ok = ~(drift > self.setup.max_drift)  # NaN fails too
        zero = jnp.zeros((), jnp.int32)
        return BackwardStats(ok, zero, zero, zero, drift)


class _AugmentedCarry(NamedTuple):
    """The carry of `solve_backwards`: the next stop (its place in `Stops.order`), the backward
    time `s = -t` reached, the augmented state `(y, a, g)` there, the step size to go on with,
    the stats so far, and the cotangents of the jump times taken so far."""

    next_stop: jax.Array
    s: jax.Array
    z: tuple
    dt: jax.Array
    stats: BackwardStats
    ct_jumps: jax.Array | None


def solve_backwards(backward: Backward, z, ct_jumps=None) -> tuple:
    """Integrate the augmented system `z = (y, a, g)` from the final time back to `t0`,
    stopping at every stop (in decreasing time) to re-anchor `y` and add the jumps, and adding
    the jump times' cotangents to `ct_jumps` (`None` without jump times). Returns
    `(a, g, ct_jumps)` at `t0` and the `BackwardStats`."""
    problem, diff, stops = backward.problem, backward.diff, backward.stops

    def body(carry: _AugmentedCarry) -> _AugmentedCarry:
        j = take(stops.order, carry.next_stop)
        s_stop = jnp.maximum(-take(stops.times, j), carry.s)
        jump = backward.last_jump(-carry.s)
        s_jump = -after(jnp, jump)
        s_end = jnp.minimum(s_stop, jnp.maximum(s_jump, carry.s))
        z, dt, segment = backward.segment(
            problem.augmented, diff, carry.s, s_end, carry.z, carry.dt
        )
        reached = s_end >= s_stop
        j = jnp.where(reached, j, -1)
        drift = backward.drift_at(j, z[0])
        z = backward.apply(j, *z)
        ct = backward.jump_cotangents(j, z[0], z[1], carry.ct_jumps)
        s = jnp.where(s_end >= s_jump, -before(jnp, jump), s_end)
        stats = carry.stats.add(segment).add(drift)
        return _AugmentedCarry(carry.next_stop + reached, s, z, dt, stats, ct)

    s0 = -backward.final.t
    dt = backward.first_dt(problem.augmented, s0, z, diff)
    stats = BackwardStats.none(backward.init.t.dtype)
    carry = _AugmentedCarry(jnp.zeros((), jnp.int32), s0, z, dt, stats, ct_jumps)
    done = lockstep_while_loop(lambda c: c.next_stop < stops.count, body, carry)
    return (*done.z[1:], done.ct_jumps), done.stats


def solve_again_from_start(backward: Backward) -> tuple[StoredStates, BackwardStats]:
    """The forward solution re-solved from `t0` to the final time with the windows' controller,
    storing states as `setup.restart` says (for the windows to start from), and the stats of
    that one re-solve (failed if it does not reach the final time)."""
    setup, init, final = backward.setup, backward.init, backward.final
    assert setup.restart is not None  # called only with a restart
    window_loop = setup.window_loop(backward.loop, backward.problem, backward.diff, final.t)
    loop = dataclasses.replace(window_loop, saveat=SaveAt(t1=True))
    start, _ = loop.init_state(init.t, init.y, None)
    done, _, watch = while_loop(loop, start, Outputs(), setup.restart.watch(start, final.t))
    ok = (done.status == Status.successful) & (done.t >= final.t)
    zero, one = jnp.zeros((), jnp.int32), jnp.ones((), jnp.int32)
    return watch.stored, BackwardStats(ok, zero, zero, one, jnp.zeros((), final.t.dtype))


class _AdjointCarry(NamedTuple):
    """The carry of `solve_with_forward_states`: the next stop (its place in `Stops.order`),
    the time `tau` reached, `(a, g)` there, the step size to go on with, the window of forward
    states held, the stats so far, and the cotangents of the jump times taken so far."""

    next_stop: jax.Array
    tau: jax.Array
    a_g: tuple
    dt: jax.Array
    window: Window
    stats: BackwardStats
    ct_jumps: jax.Array | None


def solve_with_forward_states(
    backward: Backward, stored: StoredStates | None, a_g, ct_jumps=None
) -> tuple:
    """The backward solve of `(a, g)` alone, with `y(t)` from forward re-solves: each iteration
    takes the window ending at the current time (re-solved from the latest stored state before
    it, if the window held does not reach below that time), integrates down to the next stop
    or the window's start, and adds the stop's jumps and jump times' cotangents (to
    `ct_jumps`, `None` without jump times). With `setup.restart` the windows start from the
    states of a re-solve from `t0` instead of `stored`. Returns `(a, g, ct_jumps)` at `t0` and
    the `BackwardStats`."""
    setup, loop, init, final = backward.setup, backward.loop, backward.init, backward.final
    problem, diff, stops = backward.problem, backward.diff, backward.stops
    stats = BackwardStats.none(final.t.dtype)
    if setup.restart is not None:
        stored, stats = solve_again_from_start(backward)
    anchors = StoredStates(t=init.t[None], y=jax.tree.map(lambda y: y[None], init.y),
                           dt=init.dt[None])  # fmt: skip
    if stored is not None:
        anchors = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), anchors, stored)
    zero = jnp.zeros((), jnp.int32)

    def refill(tau):
        # The latest stored state before `tau` (the rows need not be in time order).
        row = jnp.argmax(jnp.where(anchors.t < tau, anchors.t, -jnp.inf))
        start = jax.tree.map(lambda x: x[row], anchors)
        window_loop = setup.window_loop(loop, problem, diff, tau)
        return solve_window(window_loop, start.t, start.y, start.dt, setup.window)

    def keep(window):
        return lambda tau: (window, jnp.array(True))

    def body(carry: _AdjointCarry) -> _AdjointCarry:
        tau, window = carry.tau, carry.window
        j = take(stops.order, carry.next_stop)
        tau_stop = jnp.minimum(take(stops.times, j), tau)
        jump = backward.last_jump(tau)
        tau_low = jnp.maximum(tau_stop, after(jnp, jump))
        needed = (window.start >= tau) & (tau > tau_low)
        window, ok_window = cond(needed, refill, keep(window), tau)
        ok_window = ok_window & ((window.start < tau) | ~needed)
        # Not past `tau`: a stop at `tau` itself (a save at `t1`) leaves the window unfilled
        # (its start `inf`), and the segment is empty.
        tau_end = jnp.minimum(jnp.maximum(tau_low, window.start), tau)
        # Each stretch runs in the time `tau - t` from its start (its origin), which resolves
        # the fast transients a jump in `a` starts there however far `tau` lies from 0.
        a_g, dt, segment = backward.segment(problem.adjoint, (diff, window, tau, tau_end),
                                            jnp.zeros_like(tau), tau - tau_end, carry.a_g,
                                            carry.dt)  # fmt: skip
        reached = tau_end <= tau_stop
        _, a, g = backward.apply(jnp.where(reached, j, -1), None, *a_g)
        ct = carry.ct_jumps
        if ct is not None:
            y = window.evaluate(tau_end)
            ct = backward.jump_cotangents(jnp.where(reached, j, -1), y, a, ct)
        no_drift = jnp.zeros((), final.t.dtype)
        window_stats = BackwardStats(ok_window, zero, zero, needed.astype(jnp.int32), no_drift)
        # The re-solved state against the forward one: where a new window ends, at the final
        # state or at the stored state the previous window started from; and at the saved
        # outputs the window covers.
        at_anchor = anchors.t == tau
        forward_y = jax.tree.map(lambda y: y[jnp.argmax(at_anchor)], anchors.y)
        forward_y = jax.tree.map(lambda a, b: jnp.where(tau == final.t, a, b), final.y, forward_y)
        measured = needed & ((tau == final.t) | jnp.any(at_anchor))
        at_end = backward.drift(window.evaluate(tau), forward_y, measured)
        covered = reached & (window.start <= tau_end)
        at_stop = backward.drift_at(jnp.where(covered, j, -1), window.evaluate(tau_end))
        next_stop = carry.next_stop + reached
        stats = carry.stats.add(segment).add(window_stats).add(at_end).add(at_stop)
        tau_end = jnp.where(tau_end <= after(jnp, jump), before(jnp, jump), tau_end)
        return _AdjointCarry(next_stop, tau_end, (a, g), dt, window, stats, ct)

    tau1 = final.t
    window = Window.empty(setup.window_loop(loop, problem, diff, tau1), tau1, final.y,
                          setup.window)  # fmt: skip
    # The first step size, from the adjoint at t1 with y(t1) held fixed.
    dt = backward.first_dt(problem.adjoint_at(final.y, tau1), jnp.zeros_like(tau1), a_g, diff)
    carry = _AdjointCarry(zero, tau1, a_g, dt, window, stats, ct_jumps)
    going = lambda c: (c.next_stop < stops.count) & c.stats.succeeded
    done = lockstep_while_loop(going, body, carry)
    return (*done.a_g, done.ct_jumps), done.stats


class IntegrateStateBackwards(AbstractBackwardSolve):
    """The augmented system `(y, a, g)` integrated backwards, `y` re-anchored at the states
    the forward solve stored (`solve_backwards`)."""

    reads_forward_states = False

    def __call__(self, backward, stored, a, g, ct_jumps):
        return solve_backwards(backward, (backward.final.y, a, g), ct_jumps)


class ReadForwardStates(AbstractBackwardSolve):
    """`(a, g)` integrated backwards, `y(t)` read from forward re-solves of windows that start
    at stored states (`solve_with_forward_states`)."""

    reads_forward_states = True

    def __call__(self, backward, stored, a, g, ct_jumps):
        return solve_with_forward_states(backward, stored, (a, g), ct_jumps)
