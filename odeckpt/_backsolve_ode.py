"""The backward (adjoint) ODE of `BacksolveAdjoint`: the augmented system, the events where the
backward solve stops (jumps in the adjoint, re-anchored states), and the two ways of solving
it: with the state integrated backwards, or read from forward re-solves."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from ._adjoint import ForwardMode
from ._controllers import ConstantStep
from ._integrate import Loop
from ._saveat import SaveAt
from ._status import Status
from ._steppers._base import AbstractStepper, Step
from ._trajectory import empty_trajectory, resolve
from ._types import Args, BoolScalar, IntScalar, Scalar, Y


class Checkpoints(eqx.Module):
    """`k` stored step-end states (times `inf` where none was stored), with the step size
    proposed there (to start a re-solve from them)."""

    t: jax.Array
    y: Y
    dt: jax.Array


class BackwardStats(eqx.Module):
    """What the backward solve did: whether every stretch of it succeeded, its steps summed
    over the stretches, and how often `y` was re-solved forwards (`reconstruct="forward"`)."""

    succeeded: BoolScalar
    num_accepted: IntScalar
    num_rejected: IntScalar
    num_resolves: IntScalar

    @classmethod
    def none(cls) -> "BackwardStats":
        zero = jnp.zeros((), jnp.int32)
        return cls(jnp.array(True), zero, zero, zero)

    def add(self, other: "BackwardStats") -> "BackwardStats":
        return BackwardStats(
            succeeded=self.succeeded & other.succeeded,
            num_accepted=self.num_accepted + other.num_accepted,
            num_rejected=self.num_rejected + other.num_rejected,
            num_resolves=self.num_resolves + other.num_resolves,
        )


class Seminorm(AbstractStepper):
    """`inner` with the error estimate of the parameter integral (the last part of the
    backward state) set to zero, and that of the rest (the state and adjoint, or the adjoint
    alone) rescaled so that the controller's root mean square over all components equals the
    one over the rest alone (Kidger, Chen & Lyons 2021)."""

    inner: AbstractStepper

    name = property(lambda self: self.inner.name)
    order = property(lambda self: self.inner.order)
    error_order = property(lambda self: self.inner.error_order)
    fn_evals_per_step = property(lambda self: self.inner.fn_evals_per_step)
    dense_degree = property(lambda self: self.inner.dense_degree)
    tolerance_exponent = property(lambda self: self.inner.tolerance_exponent)

    def init(self, f, t0, y0, args):
        return self.inner.init(f, t0, y0, args)

    def derivative(self, state):
        return self.inner.derivative(state)

    def step(self, f, t0, t1, y0, args, state) -> Step:
        step = self.inner.step(f, t0, t1, y0, args, state)
        if step.y_error is None:
            return step
        *error_state, error_g = step.y_error
        size_state = _size(error_state)
        size_g = _size(error_g)
        if size_g == 0:
            return step
        scale = ((size_state + size_g) / size_state) ** 0.5
        error_state = jax.tree.map(lambda e: e * scale, error_state)
        y_error = (*error_state, jax.tree.map(jnp.zeros_like, error_g))
        # The rest of the step (a failed Newton iteration, the state to keep on rejection, the
        # work done, the stepper's own proposal of the next step size) stands as it is.
        return dataclasses.replace(step, y_error=y_error)


def _size(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))


def zeros_for_none(ct, like):
    """The cotangent `ct` (with `None` for symbolic zeros) as arrays shaped like `like`."""
    if ct is None:
        return jax.tree.map(jnp.zeros_like, like)
    return jax.tree.map(
        lambda c, y: jnp.zeros_like(y) if c is None else c, ct, like, is_leaf=lambda x: x is None
    )


def has_ct(ct) -> bool:
    return any(leaf is not None for leaf in jax.tree.leaves(ct, is_leaf=lambda x: x is None))


def pair(ct: Y, v: Y) -> Scalar:
    """`<ct, v>`: the cotangent pairing (real part, as for JAX's complex cotangents)."""
    terms = jax.tree.leaves(jax.tree.map(lambda c, x: jnp.sum(jnp.real(c * x)), ct, v))
    return sum(terms[1:], terms[0])


def _rows(tree, row):
    return jax.tree.map(lambda x: x[row], tree)


def _select(mask, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask, a, b), new, old)


def _masked(mask, tree):
    return jax.tree.map(lambda x: jnp.where(mask, x, jnp.zeros_like(x)), tree)


class Problem(eqx.Module):
    """The vector field split into the differentiated arrays `diff` (of `(f, args)`) and the
    rest, and the augmented backward system in the time `s = -tau` (so its loop runs
    forwards): `dy/ds = -f`, `da/ds = a^T df/dy`, `dg/ds = a^T df/ddiff`."""

    nondiff: Args

    def f(self, tau, y, diff):
        f, args = eqx.combine(diff, self.nondiff)
        return f(tau, y, args)

    def augmented(self, s, z, diff):
        y, a, _ = z
        dy, vjp = jax.vjp(lambda y, d: self.f(-s, y, d), y, diff)
        a_y, a_g = vjp(a)
        return jax.tree.map(jnp.negative, dy), a_y, a_g

    def adjoint(self, s, z, args):
        """The backward system of `(a, g)` alone, with `y(t)` read from a forward window:
        `args = (diff, window)`."""
        a, _ = z
        diff, window = args
        y = window.evaluate(-s)
        _, vjp = jax.vjp(lambda y, d: self.f(-s, y, d), y, diff)
        return vjp(a)


class _Group(eqx.Module):
    """Events of one kind (rows of a saved-output group, or checkpoints): their times, which
    rows are real, the jumps in `a` (cotangents of the saved states) and the stored states that
    re-anchor `y`."""

    times: jax.Array
    valid: jax.Array
    jump_a: Y | None
    anchor: Y | None


def event_groups(loop, final, outputs, store, ct_outputs) -> list[_Group]:
    groups = []
    outputs, ct_outputs = list(outputs), list(ct_outputs)
    num_rows = jnp.arange(loop.max_steps)
    if loop.ts is not None:
        ys, ct_ys = outputs.pop(0), ct_outputs.pop(0)
        if has_ct(ct_ys):
            finite = jax.vmap(lambda y: all_finite(y))(ys)
            groups.append(_Group(loop.ts, finite, zeros_for_none(ct_ys, ys), ys))
    if loop.saveat.steps:
        (step_ts, step_ys), (_, ct_step_ys) = outputs.pop(0), ct_outputs.pop(0)
        if has_ct(ct_step_ys):
            valid = num_rows < final.num_accepted
            groups.append(_Group(step_ts, valid, zeros_for_none(ct_step_ys, step_ys), step_ys))
    if store is not None:
        groups.append(_Group(store.t, jnp.isfinite(store.t), None, store.y))
    return groups


def all_finite(y) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(y)]))


class _Dense(eqx.Module):
    """Dense-output events at each step's start `t_i`: the cotangent of the step's coefficients
    pulled back to the state there (a jump in `a`) and to the parameters (added to `g`)."""

    times: jax.Array
    valid: jax.Array
    ends: jax.Array
    coeffs: Y
    ct_coeffs: Y

    def start_state(self, row):
        return jax.tree.map(lambda c: c[row, 0], self.coeffs)

    def pullback(self, stepper, problem: Problem, diff, row):
        def coeffs(y, d):
            t0, t1 = self.times[row], self.ends[row]
            f = lambda t, y, d: problem.f(t, y, d)
            return stepper.step(f, t0, t1, y, d, stepper.init(f, t0, y, d)).dense

        _, vjp = jax.vjp(coeffs, self.start_state(row), diff)
        return vjp(_rows(self.ct_coeffs, row))


def dense_group(loop, state, final, outputs, ct_outputs) -> _Dense | None:
    if not loop.saveat.dense:
        return None
    (t_ends, coeffs), (_, ct_coeffs) = outputs[-1], ct_outputs[-1]
    if not has_ct(ct_coeffs):
        return None
    starts = jnp.concatenate([state.t[None], t_ends[:-1]])
    valid = jnp.arange(loop.max_steps) < final.num_accepted
    return _Dense(starts, valid, t_ends, coeffs, zeros_for_none(ct_coeffs, coeffs))


def _initial_dt(controller, stepper, field, s0, z, args, seminorm: bool):
    """The first backward step size for the backward system `field` (whose last part is the
    parameter integral `g`). With the seminorm `g` takes no part in error control, so it takes
    none in choosing the first step either (its derivative, measured against `atol` while
    `g = 0`, would make that step vanishingly small)."""
    if not seminorm:
        f0 = stepper.init(field, s0, z, args)
        return controller.init(field, s0, z, f0, args, stepper, None)[0]
    *rest, g = z
    rest = tuple(rest)
    state_part = lambda s, r, d: tuple(field(s, (*r, g), d)[:-1])
    f0 = state_part(s0, rest, args)
    return controller.init(state_part, s0, rest, f0, args, stepper, None)[0]


def _segment(stepper, controller, field, args, s0, s1, z, dt, max_steps):
    """Integrate the backward system `field` from `s0` to `s1` (`s = -tau`). Returns the end
    value, the step size to go on with, and the segment's `BackwardStats`."""
    piece = Loop(
        f=field,
        args=args,
        stepper=stepper,
        controller=controller,
        t_end=s1,
        ts=None,
        saveat=SaveAt(t1=True),
        max_steps=max_steps,
        progress=None,
    )
    start, _ = piece.init_state(s0, z, dt)
    done, _ = ForwardMode().run(piece, start, ())
    # An empty segment (an event at the time reached) evaluates nothing: it cannot fail.
    ok = (s0 >= s1) | ((done.status == Status.successful) & (done.t >= s1))
    # A segment shorter than `dt` says little about the step size beyond it.
    one_step = (done.num_steps == 1) & (done.num_accepted == 1)
    dt = jnp.where(done.num_steps == 0, dt, jnp.where(one_step, jnp.maximum(dt, done.dt), done.dt))
    zero = jnp.zeros((), jnp.int32)
    return done.y, dt, BackwardStats(ok, done.num_accepted, done.num_rejected, zero)


class _Events(eqx.Module):
    """Every event of the backward solve in decreasing time: `times[order[i]]` is the `i`-th;
    `groups` are the kinds of events, and `offsets` where each starts in `times`."""

    groups: tuple
    offsets: tuple[int, ...] = eqx.field(static=True)
    times: jax.Array
    order: jax.Array
    count: jax.Array

    @classmethod
    def make(cls, groups: list) -> "_Events":
        offsets = [0]
        for group in groups:
            offsets.append(offsets[-1] + group.times.shape[0])
        times = jnp.concatenate([jnp.where(g.valid, g.times, -jnp.inf) for g in groups])
        # Decreasing time; the end (at t0) comes last, so a stable sort keeps it after ties.
        order = jnp.argsort(-times, stable=True)
        return cls(tuple(groups), tuple(offsets[:-1]), times, order, jnp.sum(times > -jnp.inf))

    def apply(self, j, stepper, problem, diff, y, a, g):
        """Add the jumps of event `j` to `a` and `g`, and re-anchor `y` (if not `None`)."""
        for group, offset in zip(self.groups, self.offsets, strict=True):
            size = group.times.shape[0]
            here = (j >= offset) & (j < offset + size)
            row = jnp.clip(j - offset, 0, size - 1)
            if isinstance(group, _Dense):
                jump_a, jump_g = group.pullback(stepper, problem, diff, row)
                a = jax.tree.map(jnp.add, a, _masked(here, jump_a))
                g = jax.tree.map(jnp.add, g, _masked(here, jump_g))
                anchor = group.start_state(row)
            else:
                if group.jump_a is not None:
                    a = jax.tree.map(jnp.add, a, _masked(here, _rows(group.jump_a, row)))
                anchor = None if group.anchor is None else _rows(group.anchor, row)
            if anchor is not None and y is not None:
                y = _select(here, anchor, y)
        return y, a, g


def _backward_setup(adjoint, loop, state, groups, dense):
    stepper = adjoint._backward_stepper(loop)
    stepper = Seminorm(stepper) if adjoint.seminorm else stepper
    controller = adjoint._backward_controller(loop.controller)
    end = _Group(state.t[None], jnp.ones((1,), bool), None, None)
    events = _Events.make([*groups, *([dense] if dense is not None else []), end])
    return stepper, controller, events


def _first_dt(adjoint, controller, stepper, state, field, s0, z, args):
    if isinstance(controller, ConstantStep):
        return state.dt
    return _initial_dt(controller, stepper, field, s0, z, args, adjoint.seminorm)


def solve_backwards(adjoint, loop, state, final, problem, diff, groups, dense, z):
    """Integrate the augmented system from the final time back to `t0`, stopping at every event
    (in decreasing time) to re-anchor `y` and add the jumps. Returns `(a, g)` at `t0` and the
    `BackwardStats`."""
    stepper, controller, events = _backward_setup(adjoint, loop, state, groups, dense)

    def body(carry):
        i, s, z, dt, stats = carry
        j = events.order[i]
        s_event = jnp.maximum(-events.times[j], s)
        z, dt, segment = _segment(
            stepper, controller, problem.augmented, diff, s, s_event, z, dt, loop.max_steps
        )
        z = events.apply(j, loop.stepper, problem, diff, *z)
        return i + 1, s_event, z, dt, stats.add(segment)

    s0 = -final.t
    dt = _first_dt(adjoint, controller, stepper, state, problem.augmented, s0, z, diff)
    carry = (jnp.zeros((), jnp.int32), s0, z, dt, BackwardStats.none())
    _, _, z, _, stats = jax.lax.while_loop(lambda c: c[0] < events.count, body, carry)
    return z[1:], stats


def solve_with_forward_states(
    adjoint, loop, state, final, store, problem, diff, groups, dense, a_g
):
    """The backward solve of `(a, g)` alone, with `y(t)` from forward re-solves (see
    `BacksolveAdjoint`, `reconstruct="forward"`): each iteration takes the window ending at the
    current time (re-solved from the latest stored state before it, if the window held does not
    reach below that time), integrates down to the next event or the window's start, and adds
    the event's jumps. Returns `(a, g)` at `t0` and the `BackwardStats`."""
    stepper, controller, events = _backward_setup(adjoint, loop, state, groups, dense)
    anchors = Checkpoints(
        t=state.t[None], y=jax.tree.map(lambda y: y[None], state.y), dt=state.dt[None]
    )
    if store is not None:
        anchors = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), anchors, store)
    zero = jnp.zeros((), jnp.int32)

    def refill(tau):
        row = jnp.sum(anchors.t < tau) - 1
        resolved = adjoint._resolve_loop(loop, problem, diff, tau)
        start = _rows(anchors, row)
        return resolve(resolved, start.t, start.y, start.dt, adjoint.window)

    def keep(window):
        return lambda tau: (window, jnp.array(True))

    def body(carry):
        i, tau, a_g, dt, window, stats = carry
        j = events.order[i]
        tau_event = jnp.minimum(events.times[j], tau)
        needed = (window.start >= tau) & (tau > tau_event)
        window, ok_window = jax.lax.cond(needed, refill, keep(window), tau)
        ok_window = ok_window & ((window.start < tau) | ~needed)
        # Not past `tau`: an event at `tau` itself (a save at `t1`) leaves the window unfilled
        # (its start `inf`), and the segment is empty.
        tau_stop = jnp.minimum(jnp.maximum(tau_event, window.start), tau)
        args = (diff, window)
        a_g, dt, segment = _segment(
            stepper, controller, problem.adjoint, args, -tau, -tau_stop, a_g, dt, loop.max_steps
        )
        reached = tau_stop <= tau_event
        _, a, g = events.apply(jnp.where(reached, j, -1), loop.stepper, problem, diff, None, *a_g)
        resolved = BackwardStats(ok_window, zero, zero, needed.astype(jnp.int32))
        return i + reached, tau_stop, (a, g), dt, window, stats.add(segment).add(resolved)

    tau1 = final.t
    window = empty_trajectory(
        adjoint._resolve_loop(loop, problem, diff, tau1), tau1, final.y, adjoint.window
    )
    # The first step size, from the adjoint at t1 with y(t1) held fixed.
    dt = _first_dt(
        adjoint, controller, stepper, state, _at_final(problem, final.y), -tau1, a_g, diff
    )
    carry = (zero, tau1, a_g, dt, window, BackwardStats.none())
    cond = lambda c: (c[0] < events.count) & c[5].succeeded
    _, _, a_g, _, _, stats = jax.lax.while_loop(cond, body, carry)
    return a_g, stats


def _at_final(problem, y1):
    """The backward system of `(a, g)` with `y` frozen at `y1` (for the first step size)."""

    def field(s, z, diff):
        a, _ = z
        _, vjp = jax.vjp(lambda y, d: problem.f(-s, y, d), y1, diff)
        return vjp(a)

    return field
