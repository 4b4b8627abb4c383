"""A window of the forward solution, re-solved from a stored state and kept as the continuous
extensions of its last steps: how `BacksolveAdjoint(reconstruct="forward")` reads `y(t)` for the
adjoint equations without integrating `y` backwards in time."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._loop import IntegrationLoop, LoopState, Outputs, StepRecord, Writes, piecewise
from ..._status import Status
from ..._types import BoolScalar, Scalar, Y
from .._base import AbstractWatch, while_loop


class Window(eqx.Module):
    """The continuous extensions of up to `rows` consecutive accepted steps, oldest first.

    Unused rows come last, with `starts = ends = inf`; an empty window (every row unused) has
    `start = inf`, so it covers no time at all.

    **Fields:**

    - `starts`, `ends`: each step's start and end (internal times, increasing).
    - `coeffs`: each step's polynomial coefficients in `theta = (t - start) / (end - start)`
        (see `Step.dense`), leaves of shape `(rows, degree + 1, *leaf_shape)`.
    """

    starts: Array
    ends: Array
    coeffs: Y

    @classmethod
    def empty(cls, loop: IntegrationLoop, t0: Scalar, y0: Y, rows: int) -> "Window":
        """A window of `rows` unused rows for the dense output of `loop.stepper`."""

        def dense():
            state = loop.stepper.init(loop.f, t0, y0, loop.args)
            return loop.stepper.step(loop.f, t0, t0, y0, loop.args, state).dense

        inf = jnp.full((rows,), jnp.inf, jnp.result_type(t0))
        coeffs = jax.tree.map(lambda c: jnp.zeros((rows, *c.shape), c.dtype), jax.eval_shape(dense))
        return cls(starts=inf, ends=inf, coeffs=coeffs)

    @property
    def start(self) -> Scalar:
        """The earliest time the window covers."""
        return self.starts[0]

    def evaluate(self, tau: Scalar) -> Y:
        """The forward solution at internal time `tau` inside the window."""
        return piecewise(self.starts, self.ends, self.coeffs, tau, self.starts.shape[0])


class _Ring(AbstractWatch):
    """The window as a ring buffer of the last accepted steps' dense output, filled as the
    loop steps."""

    window: Window
    max_steps: int = eqx.field(static=True)

    def update(
        self, before: LoopState, after: LoopState, writes: Writes, record: StepRecord
    ) -> "_Ring":
        del record
        rows = self.window.starts.shape[0]
        assert writes.dense is not None  # the window's loop writes dense output
        index = writes.dense.index  # the accepted step's number, or out of range
        ring = jnp.where(index < self.max_steps, index % rows, rows)
        put = lambda buffer, row: buffer.at[ring].set(row, mode="drop")
        t1, dense = writes.dense.values.t, writes.dense.values.values
        window = Window(
            starts=put(self.window.starts, before.t[None]),
            ends=put(self.window.ends, t1),
            coeffs=jax.tree.map(put, self.window.coeffs, dense),
        )
        return _Ring(window, self.max_steps)


def solve_window(
    loop: IntegrationLoop, t0: Scalar, y0: Y, dt0: Scalar, rows: int
) -> tuple[Window, BoolScalar]:
    """Solve `loop` (which keeps dense output) forwards from `(t0, y0)` with first step `dt0`
    to `loop.t_end`, keeping the continuous extensions of the last `rows` accepted steps (a ring
    buffer, so memory does not grow with the number of steps). The solve is deterministic, so
    solving again from the same state to an earlier `t_end` reproduces the same steps: that is
    how the window moves back.

    **Returns:** the window, which ends exactly at `loop.t_end`, and whether the solve reached
    it.
    """
    state, _ = loop.init_state(t0, y0, dt0)
    ring = _Ring(Window.empty(loop, t0, y0, rows), loop.max_steps)
    final, _, ring = while_loop(loop, state, Outputs(), ring)
    count = final.num_accepted
    # Oldest row first: after more than `rows` steps the oldest sits at `count % rows`.
    shift = jnp.where(count > rows, count % rows, 0)
    window = jax.tree.map(lambda x: jnp.roll(x, -shift, axis=0), ring.window)
    ok = (final.status == Status.successful) & (final.t >= loop.t_end) & (count > 0)
    return window, ok
