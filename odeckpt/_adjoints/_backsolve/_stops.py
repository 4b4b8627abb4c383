"""Where the backward solve of the continuous adjoints stops, in decreasing time: at saved outputs
(their cotangents jump into the adjoint `a`), at stored forward states (which re-anchor `y`), at
dense-output step starts (their cotangents pulled back to `a` and the parameter integral `g`),
before the known discontinuities of `f` (where the cotangents of their times are taken), and
at `t0`."""

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._autodiff import stack
from ..._checks import all_finite
from ..._loop import IntegrationLoop, LoopState, Outputs, after, before
from ..._steppers import AbstractStepper
from ..._types import Y
from .._derivatives import pair
from ._problem import Problem


class StoredStates(eqx.Module):
    """`k` stored step-end states (times `inf` where none was stored), with the step size
    proposed there (to start a forward re-solve from them)."""

    t: jax.Array
    y: Y
    dt: jax.Array


class PointStops(eqx.Module):
    """Stops of one kind at given times: which rows are real, the jumps in `a` (cotangents of
    saved states; `None` for none) and the states that re-anchor `y` (`None` for none)."""

    times: jax.Array
    valid: jax.Array
    jump_a: Y | None
    anchor: Y | None


class DenseStops(eqx.Module):
    """Stops at each dense-output step's start `t_i`: the cotangent of the step's coefficients
    pulled back to the state there (a jump in `a`) and to the parameters (added to `g`)."""

    times: jax.Array
    valid: jax.Array
    ends: jax.Array
    coeffs: Y
    ct_coeffs: Y

    def start_state(self, row):
        return jax.tree.map(lambda c: c[row, 0], self.coeffs)

    def pullback(self, stepper: AbstractStepper, problem: Problem, diff, row):
        stepper = problem.stepper_for_f(stepper)

        def coeffs(y, d):
            t0, t1 = self.times[row], self.ends[row]
            f = lambda t, y, d: problem.f(t, y, d)
            return stepper.step(f, t0, t1, y, d, stepper.init(f, t0, y, d)).dense

        _, vjp = jax.vjp(coeffs, self.start_state(row), diff)
        return vjp(_row(self.ct_coeffs, row))


def output_stops(
    loop: IntegrationLoop, final: LoopState, outputs: Outputs, stored, ct: Outputs
) -> list[PointStops]:
    """The stops at the saved outputs (where their cotangents are not all zero) and at the
    `stored` states."""
    stops = []
    if loop.ts is not None:
        valid = jax.vmap(all_finite)(outputs.ts) & _nonzero(ct.ts)
        stops.append(PointStops(loop.ts, valid, ct.ts, outputs.ts))
    if outputs.steps is not None:
        assert ct.steps is not None  # cotangents are shaped like the outputs
        steps = outputs.steps
        valid = (jnp.arange(loop.max_steps) < final.num_accepted) & _nonzero(ct.steps.values)
        stops.append(PointStops(steps.t, valid, ct.steps.values, steps.values))
    if stored is not None:
        stops.append(PointStops(stored.t, jnp.isfinite(stored.t), None, stored.y))
    return stops


def dense_stops(
    loop: IntegrationLoop, init: LoopState, final: LoopState, outputs: Outputs, ct: Outputs
) -> DenseStops | None:
    """The stops at the dense output's step starts (where its cotangents are not all zero)."""
    if outputs.dense is None:
        return None
    assert ct.dense is not None  # cotangents are shaped like the outputs
    t_ends, coeffs = outputs.dense.t, outputs.dense.values
    starts = jnp.concatenate([init.t[None], t_ends[:-1]])
    valid = (jnp.arange(loop.max_steps) < final.num_accepted) & _nonzero(ct.dense.values)
    return DenseStops(starts, valid, t_ends, coeffs, ct.dense.values)


class JumpStops(eqx.Module):
    """Stops at the last time before each known discontinuity `tau` of `f` (`jump_ts`) that
    the forward solve landed on, where the step before it ended: there the cotangent of
    `tau` is `a(tau) . (f(tau-, y) - f(tau+, y))`, since moving `tau` moves the state after it
    by the change of the vector field there (`f` at the last time before `tau` and the first
    after it, where the forward steps around it end and start)."""

    jump_ts: jax.Array
    valid: jax.Array

    @property
    def times(self) -> jax.Array:
        return before(jnp, self.jump_ts)

    def cotangents(self, problem: Problem, diff, here, row, y: Y, a: Y, ct: jax.Array):
        """`ct` (the cotangents of `jump_ts`) plus, if `here`, the one of the jump time of
        `row`: `a . (f- - f+)` with the state `y` and adjoint `a` there."""
        tau = self.jump_ts[row]
        change = jax.tree.map(
            jnp.subtract, problem.f(before(jnp, tau), y, diff), problem.f(after(jnp, tau), y, diff)
        )
        value = jnp.where(here, pair(a, change), 0)
        return ct.at[row].add(value.astype(ct.dtype))


def jump_stops(loop: IntegrationLoop, init: LoopState, final: LoopState) -> JumpStops | None:
    """The stops before the jump times the forward solve landed on (those inside the span it
    covered, each value once: equal jump times are one discontinuity, and its cotangent goes to
    the first, as the forward solve lands on it once)."""
    if loop.jump_ts is None:
        return None
    jump_ts = loop.jump_ts
    first = jnp.concatenate([jnp.ones((1,), bool), jump_ts[1:] != jump_ts[:-1]])
    return JumpStops(jump_ts, first & (jump_ts > init.t) & (jump_ts < final.t))


def _nonzero(ct: Y) -> jax.Array:
    """Whether any cotangent in `ct` is non-zero: an output nobody differentiates makes no
    stops."""
    return jnp.any(stack([jnp.any(leaf != 0) for leaf in jax.tree.leaves(ct)]))


class Stops(eqx.Module):
    """Every stop of the backward solve in decreasing time: `times[order[i]]` is the `i`-th;
    `kinds` are the kinds of stops, and `offsets` where each starts in `times`."""

    kinds: tuple
    offsets: tuple[int, ...] = eqx.field(static=True)
    times: jax.Array
    order: jax.Array
    count: jax.Array

    @classmethod
    def make(cls, kinds: list, t0, y0: Y) -> "Stops":
        """The stops of `kinds`, and the end of the backward solve at `t0`, where the state is
        `y0`."""
        start = jax.tree.map(lambda y: y[None], y0)
        kinds = [*kinds, PointStops(t0[None], jnp.ones((1,), bool), None, start)]
        offsets = [0]
        for kind in kinds:
            offsets.append(offsets[-1] + kind.times.shape[0])
        times = jnp.concatenate([jnp.where(k.valid, k.times, -jnp.inf) for k in kinds])
        # Decreasing time; the end (at t0) comes last, so a stable sort keeps it after ties.
        order = jnp.argsort(-times, stable=True)
        return cls(tuple(kinds), tuple(offsets[:-1]), times, order, jnp.sum(times > -jnp.inf))

    def apply(self, j, stepper: AbstractStepper, problem: Problem, diff, y, a, g):
        """Add the jumps of stop `j` to `a` and `g`, and re-anchor `y` (if not `None`)."""
        for kind, here, row in self._kinds_at(j):
            if isinstance(kind, JumpStops):
                continue
            if isinstance(kind, DenseStops):
                jump_a, jump_g = kind.pullback(stepper, problem, diff, row)
                a = jax.tree.map(jnp.add, a, _masked(here, jump_a))
                g = jax.tree.map(jnp.add, g, _masked(here, jump_g))
            elif kind.jump_a is not None:
                a = jax.tree.map(jnp.add, a, _masked(here, _row(kind.jump_a, row)))
        anchored, anchor = self.anchor(j, y)
        if y is not None:
            y = _select(anchored, anchor, y)
        return y, a, g

    def anchor(self, j, like: Y | None):
        """`(anchored, y)`: whether stop `j` holds a state of the forward solve (a saved
        output, a stored state, a dense-output step's start, or `y0` at the end), and that
        state (`like` where it holds none; `None` if `like` is `None`)."""
        anchored = jnp.array(False)
        for kind, here, row in self._kinds_at(j):
            if isinstance(kind, DenseStops):
                value = kind.start_state(row)
            elif isinstance(kind, PointStops) and kind.anchor is not None:
                value = _row(kind.anchor, row)
            else:
                continue
            anchored = anchored | here
            if like is not None:
                like = _select(here, value, like)
        return anchored, like

    def jump_cotangents(self, j, problem: Problem, diff, y: Y, a: Y, ct):
        """`ct`, the cotangents of the jump times, plus the one taken at stop `j` (if it is
        the stop before a jump time), with the state `y` and adjoint `a` there (`ct` is
        `None` without jump times)."""
        for kind, here, row in self._kinds_at(j):
            if isinstance(kind, JumpStops):
                ct = kind.cotangents(problem, diff, here, row, y, a, ct)
        return ct

    def _kinds_at(self, j):
        """Each kind of stop, with whether stop `j` is of that kind and its row there."""
        for kind, offset in zip(self.kinds, self.offsets, strict=True):
            size = kind.times.shape[0]
            here = (j >= offset) & (j < offset + size)
            yield kind, here, jnp.clip(j - offset, 0, size - 1)


def _row(tree, row):
    return jax.tree.map(lambda x: x[row], tree)


def _select(mask, new, old):
    return jax.tree.map(lambda a, b: jnp.where(mask, a, b), new, old)


def _masked(mask, tree):
    return jax.tree.map(lambda x: jnp.where(mask, x, jnp.zeros_like(x)), tree)
