"""A window of the forward solution, re-solved from a stored state and kept as the continuous
extensions of its last steps: how `BacksolveAdjoint(reconstruct="forward")` obtains `y(t)`
for the adjoint equations without integrating `y` backwards in time."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._integrate import Loop
from ._solution import polynomial
from ._status import Status
from ._types import BoolScalar, Scalar, Y


class Trajectory(eqx.Module):
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

    @property
    def start(self) -> Scalar:
        """The earliest time the window covers."""
        return self.starts[0]

    def evaluate(self, tau: Scalar) -> Y:
        """The forward solution at internal time `tau` inside the window."""
        rows = self.starts.shape[0]
        index = jnp.clip(jnp.searchsorted(self.ends, tau, side="left"), 0, rows - 1)
        start, end = self.starts[index], self.ends[index]
        h = end - start
        theta = (tau - start) / jnp.where(h > 0, h, 1)

        return jax.tree.map(lambda coeffs: polynomial(coeffs[index], theta), self.coeffs)


def empty_trajectory(loop: Loop, t0: Scalar, y0: Y, rows: int) -> Trajectory:
    """A window of `rows` unused rows for the dense output of `loop.stepper`."""

    def dense():
        state = loop.stepper.init(loop.f, t0, y0, loop.args)
        return loop.stepper.step(loop.f, t0, t0, y0, loop.args, state).dense

    shapes = jax.eval_shape(dense)
    inf = jnp.full((rows,), jnp.inf, jnp.result_type(t0))
    coeffs = jax.tree.map(lambda c: jnp.zeros((rows, *c.shape), c.dtype), shapes)
    return Trajectory(starts=inf, ends=inf, coeffs=coeffs)


def resolve(loop: Loop, t0: Scalar, y0: Y, dt0: Scalar, rows: int) -> tuple[Trajectory, BoolScalar]:
    """Solve `loop` forwards from `(t0, y0)` with first step `dt0` to `loop.t_end`, keeping the
    continuous extensions of the last `rows` accepted steps (a ring buffer, so memory does not
    grow with the number of steps). The solve is deterministic, so solving again from the same
    state to an earlier `t_end` reproduces the same steps: that is how the window moves back.

    **Returns:** the window, which ends exactly at `loop.t_end`, and whether the solve reached
    it.
    """
    state, _ = loop.init_state(t0, y0, dt0)
    window = empty_trajectory(loop, t0, y0, rows)

    def cond(carry):
        state, _ = carry
        return loop.cond(state) & (state.num_steps < loop.max_steps)

    def body(carry):
        state, window = carry
        new, writes, _ = loop.step(state)
        index, (t1, dense) = writes[-1]
        # `index` is the accepted step's number, or out of range for a rejected step.
        ring = jnp.where(index < loop.max_steps, index % rows, rows)
        put = lambda buffer, rows_: buffer.at[ring].set(rows_, mode="drop")
        window = Trajectory(
            starts=put(window.starts, state.t[None]),
            ends=put(window.ends, t1),
            coeffs=jax.tree.map(put, window.coeffs, dense),
        )
        return new, window

    final, window = jax.lax.while_loop(cond, body, (state, window))
    count = final.num_accepted
    # Oldest row first: after more than `rows` steps the oldest sits at `count % rows`.
    shift = jnp.where(count > rows, count % rows, 0)
    window = jax.tree.map(lambda x: jnp.roll(x, -shift, axis=0), window)
    ok = (final.status == Status.successful) & (final.t >= loop.t_end) & (count > 0)
    return window, ok
