"""A tqdm progress bar that the loop runners update at most about a hundred times per solve."""

import dataclasses
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tqdm.auto
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback
from jaxtyping import Array

from .._types import BoolScalar, IntScalar, Scalar
from ._state import LoopState

_DECADES = 1e3
"""A span whose ends have one sign and differ by more than this factor is measured in
`log|t|`: in `t` itself, a span from 1e-5 to 1e11 would sit at 0% until its last decade."""

_INTERVAL = 0.1
"""Seconds between the reports the bar asks for (tqdm's own least interval between draws)."""

_NEVER = 101
"""A percent the loop never reaches: no report until the loop ends."""


@dataclasses.dataclass(frozen=True)
class Report:
    """What the loop tells the bar: the `percent` of the span covered (of the slowest lane
    still running under `vmap`; once every lane has ended, of the slowest lane), whether this is
    the solve's `first` report (before any step), and whether the solve is `done` (every lane
    reached the end of its span, failed or stopped)."""

    percent: int
    first: bool
    done: bool

    @classmethod
    def unpack(cls, packed) -> "Report":
        """The report `_Lane.packed` made."""
        percent, first, done = np.asarray(packed).tolist()
        return cls(percent, bool(first), bool(done))


class ProgressBar:
    """Host-side bar: opens at the first report of a solve and closes when the solve ends, at the
    percent it reached (below 100 for a solve that failed or stopped early). Each report
    returns the percent at which the loop is to report next: the next whole percent at first,
    then as many percent as the solve covers in `_INTERVAL` seconds at its rate so far, so that
    a quick solve calls the host a few times and a slow one about every percent. All instances
    compare equal so that a new bar does not force `jit` to recompile."""

    def __init__(self):
        self._bar = None
        self._opened = (0.0, 0)  # the time and percent of the first report
        self._target = _NEVER

    def __eq__(self, other) -> bool:
        return isinstance(other, ProgressBar)

    def __hash__(self) -> int:
        return hash(ProgressBar)

    def show(self, report: Report) -> int:
        """Open, move or close the bar as `report` says; **returns** the percent at which the
        loop reports next."""
        if report.first:
            self._close()
            self._bar = tqdm.auto.tqdm(
                total=100, initial=report.percent, unit="%", desc="odeckpt.solve"
            )
            self._opened = (time.perf_counter(), report.percent)
        elif self._bar is None:
            return _NEVER  # the solve this bar showed has ended
        elif report.percent < self._target and not report.done:
            return self._target  # a stretch cut short before the target (a host segment)
        else:
            # tqdm redraws at most every 0.1 s: a short solve's reports cost no terminal output.
            self._bar.update(report.percent - self._bar.n)
        if report.done:
            self._close()
            return _NEVER
        self._target = self._next(report.percent)
        return self._target

    def _next(self, percent: int) -> int:
        """The percent to report at next: `_INTERVAL` seconds ahead at the rate so far."""
        start, first = self._opened
        elapsed = time.perf_counter() - start
        if percent <= first or elapsed <= 0:
            return percent + 1
        ahead = math.ceil((percent - first) / elapsed * _INTERVAL)
        return min(percent + max(ahead, 1), 100)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressMeter(eqx.Module):
    """What a runner tells `bar`: the whole percent of the span covered (`milestone`), which it
    reports (`report`) before the first step, then each time the percent reaches the one the
    previous report returned (the bar's choice: at most every percent) and when the solve ends,
    so at most 102 host callbacks per solve whatever its number of steps. Under `vmap` both
    read the slowest lane still running (once every lane has ended, the slowest lane), an
    unbatched value, so that a runner can stop its inner loop where the percent is reached.

    The part covered at `t` is `(t - t_start) / (t_end - t_start)`, or, when `t_start` and
    `t_end` have one sign and differ by more than a factor 1000, the same in `log|t|`, so that
    a span over many decades moves by decades."""

    t_start: Scalar
    t_end: Scalar
    bar: ProgressBar = eqx.field(static=True)

    def fraction(self, t: Scalar) -> Scalar:
        """The part of the span covered at `t`: 1 for an empty span."""
        t0, t1 = jnp.abs(self.t_start), jnp.abs(self.t_end)
        decades = (self.t_start * self.t_end > 0) & (
            jnp.maximum(t0, t1) > _DECADES * jnp.minimum(t0, t1)
        )
        scale = lambda t: jnp.where(decades, jnp.log(jnp.abs(t)), t)
        width = scale(self.t_end) - scale(self.t_start)
        covered = scale(t) - scale(self.t_start)
        return jnp.where(width != 0, covered / jnp.where(width != 0, width, 1), 1)

    def milestone(self, state: LoopState, running: BoolScalar) -> IntScalar:
        """The whole percent covered at `state`, whose lane is still `running` (unbatched)."""
        return _percent(self._slowest(state, running).part)

    def report(self, state: LoopState, running: BoolScalar) -> IntScalar:
        """Tell the bar where the solve is at `state`, whose lane is still `running`;
        **returns** the milestone at which to report next (unbatched)."""
        show = lambda packed: np.int32(self.bar.show(Report.unpack(packed)))
        out = jax.ShapeDtypeStruct((), jnp.int32)
        return io_callback(show, out, self._slowest(state, running).packed())

    def _slowest(self, state: LoopState, running: BoolScalar) -> "_Lane":
        # Not differentiated: JAX cannot linearize a `custom_vmap` call that has tangents.
        lane = _Lane(self.fraction(state.t), running, state.num_steps == 0)
        return _slowest(jax.lax.stop_gradient(lane))


class _Lane(eqx.Module):
    """One lane as progress sees it: the `part` of the span covered, whether it is still
    `running`, and whether it is `fresh` (has taken no step yet)."""

    part: Scalar
    running: BoolScalar
    fresh: BoolScalar

    def packed(self) -> Array:
        """Its `Report`, as one int32 vector: a callback's cost grows with its arguments."""
        return jnp.stack([_percent(self.part), self.fresh, ~self.running]).astype(jnp.int32)


def _percent(part: Scalar) -> IntScalar:
    """Whole percent of `part`."""
    return jnp.floor(100 * jnp.clip(part, 0, 1)).astype(jnp.int32)


@custom_vmap
def _slowest(lane: _Lane) -> _Lane:
    """`lane`; under `vmap`, the slowest running lane (the slowest of all once none runs), fresh
    while every lane is: unbatched, so that a loop predicate or a `lax.cond` on it stays one."""
    return lane


@_slowest.def_vmap
def _slowest_rule(axis_size: int, in_batched, lane: _Lane):
    batched = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
    lane = jax.tree.map(batched, lane, in_batched[0])
    running = jnp.any(lane.running, axis=0)
    among_running = jnp.min(jnp.where(lane.running, lane.part, jnp.inf), axis=0)
    part = jnp.where(running, among_running, jnp.min(lane.part, axis=0))
    reduced = _Lane(part, running, jnp.all(lane.fresh, axis=0))
    # Called again, so that an enclosing `vmap` reduces its own lanes.
    return _slowest(reduced), jax.tree.map(lambda _: False, reduced)
