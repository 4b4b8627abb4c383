"""A tqdm progress bar that the compiled loop updates at most about a hundred times per solve."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tqdm.auto
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from .._types import BoolScalar, IntScalar, Scalar
from ._state import LoopState

_DECADES = 1e3
"""A span whose ends have one sign and differ by more than this factor is measured in
`log|t|`: in `t` itself, a span from 1e-5 to 1e11 would sit at 0% until its last decade."""


@dataclasses.dataclass(frozen=True)
class Report:
    """What the loop tells the bar: the `percent` of the span covered (of the slowest lane
    still running under `vmap`; once every lane has ended, of the slowest lane), whether this is
    the solve's `first` step, and whether the solve is `done` (every lane reached the end of
    its span, failed or stopped)."""

    percent: int
    first: bool
    done: bool

    @classmethod
    def unpack(cls, packed) -> "Report":
        """The report `_Lane.packed` made."""
        percent, first, done = np.asarray(packed).tolist()
        return cls(percent, bool(first), bool(done))


class ProgressBar:
    """Host-side bar: opens at the first step of a solve and closes when the solve ends, at the
    percent it reached (below 100 for a solve that failed or stopped early). All instances
    compare equal so that a new bar does not force `jit` to recompile."""

    def __init__(self):
        self._bar = None

    def __eq__(self, other) -> bool:
        return isinstance(other, ProgressBar)

    def __hash__(self) -> int:
        return hash(ProgressBar)

    def show(self, report: Report) -> None:
        """Open, move or close the bar as `report` says."""
        if report.first:
            self._close()
            self._bar = tqdm.auto.tqdm(
                total=100, initial=report.percent, unit="%", desc="odeckpt.solve"
            )
        elif self._bar is None:
            # A reverse sweep that recomputes steps past the engine's record of them reports
            # again; the bar belongs to the forward solve, which has ended.
            return
        else:
            self._bar.n = report.percent
            self._bar.refresh()
        if report.done:
            self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressMeter(eqx.Module):
    """Reports to `bar` when a step takes the part of the span covered past a whole percent,
    and at the first and the last step of the solve: at most 102 host callbacks per solve,
    whatever its number of steps, also under `vmap` (where the slowest running lane counts).
    Each step pays a few scalar operations and one `lax.cond` whose untaken branch is empty.

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

    def update(
        self, before: LoopState, after: LoopState, ran: BoolScalar, running: BoolScalar
    ) -> None:
        """Report the step from `before` (where the lane `ran`) to `after` (where it is still
        `running`) if it passes a whole percent, is the solve's first step or ends it."""
        first = before.num_steps == 0
        lane = _Lane(
            jnp.where(first, -1, self.fraction(before.t)), ran, self.fraction(after.t), running
        )
        # Not differentiated: a reverse sweep past its record of the steps differentiates
        # them as they are, and JAX cannot linearize a `custom_vmap` call that has tangents.
        _reporter(self.bar)(jax.lax.stop_gradient(lane))


class _Lane(eqx.Module):
    """One lane's step as progress sees it: the part covered at its `start` (-1 at the solve's
    first step, so that it always reports), whether the lane `ran` before it, the part covered
    at its `end`, and whether the lane is still `running` after it."""

    start: Scalar
    ran: BoolScalar
    end: Scalar
    running: BoolScalar

    def reports(self) -> BoolScalar:
        """Whether the step passes a whole percent, is the solve's first or ends it."""
        return (_percent(self.end) > _percent(self.start)) | ~self.running

    def packed(self) -> Array:
        """Its `Report`, as one int32 vector: a callback's cost grows with its arguments."""
        return jnp.stack([_percent(self.end), self.start < 0, ~self.running]).astype(jnp.int32)


def _percent(part: Scalar) -> IntScalar:
    """Whole percent of `part` (-100 for the -1 before a solve's first step)."""
    return jnp.floor(100 * jnp.clip(part, -1, 1)).astype(jnp.int32)


def _reporter(bar: ProgressBar) -> Callable[[_Lane], Array]:
    """`report(lane)`: calls `bar` back when `lane`'s step passes a whole percent, is the first
    or ends the solve. Under `vmap` the lanes are reduced first (the slowest running one), so
    that the decision stays unbatched and the `lax.cond` around the callback stays a cond:
    JAX batches a cond on a batched predicate into a select, which would call back at every
    step."""

    show = lambda packed: bar.show(Report.unpack(packed))

    @custom_vmap
    def report(lane: _Lane) -> Array:
        reports = lane.reports()
        call = lambda lane: jax.debug.callback(show, lane.packed())
        jax.lax.cond(reports, call, lambda lane: None, lane)
        return reports

    @report.def_vmap
    def _slowest(axis_size: int, in_batched, lane: _Lane):
        batched = lambda x, b: x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        lane = jax.tree.map(batched, lane, in_batched[0])
        slowest = lambda part, mask: jnp.min(jnp.where(mask, part, jnp.inf), axis=0)
        running = jnp.any(lane.running, axis=0)
        end = jnp.where(running, slowest(lane.end, lane.running), jnp.min(lane.end, axis=0))
        reduced = _Lane(slowest(lane.start, lane.ran), jnp.any(lane.ran, axis=0), end, running)
        # Called again, so that an enclosing `vmap` reduces its own lanes.
        return report(reduced), False

    return report
