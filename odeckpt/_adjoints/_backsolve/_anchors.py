"""Where the forward solve of a continuous adjoint stores the states its backward solve re-anchors
`y` at, or re-solves the forward solution from: at evenly spaced times (`BacksolveAdjoint`), or
every so many accepted steps (`InterpolatingAdjoint`, as CVODES places its checkpoints)."""

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._loop import LoopState, StepRecord, Writes
from .._base import AbstractWatch
from ._stops import StoredStates


class Anchoring(eqx.Module):
    """How many states the forward solve stores (`slots`), and where: every `every` accepted
    steps (`None`: at the first step ends past `slots` evenly spaced times)."""

    slots: int = eqx.field(static=True)
    every: int | None = eqx.field(static=True)

    def watch(self, state: LoopState, t_end) -> "TimeAnchors | StepAnchors":
        """The watch that stores the states as the forward loop runs from `state`."""
        if self.every is None:
            return TimeAnchors.make(self.slots, state, t_end)
        return StepAnchors.make(self.slots, self.every, state)


def _empty(k: int, state: LoopState) -> StoredStates:
    return StoredStates(
        t=jnp.full((k,), jnp.inf, state.t.dtype),
        y=jax.tree.map(lambda y: jnp.full((k, *y.shape), jnp.inf, y.dtype), state.y),
        dt=jnp.zeros((k,), state.dt.dtype),
    )


def _put(stored: StoredStates, index, state: LoopState) -> StoredStates:
    """`stored` with row `index` (dropped if out of range) set to `state`'s time, state and
    next step size."""
    put = lambda buffer, value: buffer.at[index].set(value, mode="drop")
    return StoredStates(
        t=put(stored.t, state.t),
        y=jax.tree.map(put, stored.y, state.y),
        dt=put(stored.dt, state.dt),
    )


class TimeAnchors(AbstractWatch):
    """Stores the first accepted step end at or after each of the `targets` times."""

    targets: jax.Array
    stored: StoredStates
    next_slot: jax.Array

    @classmethod
    def make(cls, k: int, state: LoopState, t_end) -> "TimeAnchors":
        """`k` slots for the times `t0 + j (t_end - t0) / (k + 1)`, `j = 1..k`."""
        fractions = jnp.arange(1, k + 1, dtype=state.t.dtype) / (k + 1)
        targets = state.t + fractions * (t_end - state.t)
        return cls(targets, _empty(k, state), jnp.zeros((), jnp.int32))

    def update(
        self, before: LoopState, after: LoopState, writes: Writes, record: StepRecord
    ) -> "TimeAnchors":
        del record
        k = self.targets.shape[0]
        accepted = after.num_accepted > before.num_accepted
        target = self.targets[jnp.minimum(self.next_slot, k - 1)]
        hit = accepted & (self.next_slot < k) & (after.t >= target)
        stored = _put(self.stored, jnp.where(hit, self.next_slot, k), after)
        # A long step may pass several targets; they share this one stored state.
        passed = jnp.sum(self.targets <= after.t, dtype=self.next_slot.dtype)
        return TimeAnchors(self.targets, stored, jnp.where(hit, passed, self.next_slot))


class StepAnchors(AbstractWatch):
    """Stores the state after every `spacing`-th accepted step in `k` slots. When they are all
    full and another is due, the states at odd multiples of `spacing` are dropped and `spacing`
    doubles, so that the slots always cover the whole solve, `spacing` to `2 spacing` steps
    apart, whatever its number of steps. Slots are reused in place (their rows are not in time
    order; a free one has time `inf`).

    **Fields:** `stored` the states; `positions` the accepted-step number each slot holds
    (`-1`: free); `spacing` the accepted steps between stored states.
    """

    stored: StoredStates
    positions: jax.Array
    spacing: jax.Array

    @classmethod
    def make(cls, k: int, every: int, state: LoopState) -> "StepAnchors":
        positions = jnp.full((k,), -1, jnp.int32)
        return cls(_empty(k, state), positions, jnp.asarray(every, jnp.int32))

    def update(
        self, before: LoopState, after: LoopState, writes: Writes, record: StepRecord
    ) -> "StepAnchors":
        del record
        k = self.positions.shape[0]
        count = after.num_accepted
        due = (count > before.num_accepted) & (count % self.spacing == 0)
        thin = due & jnp.all(self.positions >= 0)
        dropped = thin & ((self.positions // self.spacing) % 2 == 1)
        positions = jnp.where(dropped, -1, self.positions)
        spacing = jnp.where(thin, 2 * self.spacing, self.spacing)
        store = due & (count % spacing == 0)
        index = jnp.where(store, jnp.argmax(positions < 0), k)
        stored = self.stored
        stored = StoredStates(jnp.where(dropped, jnp.inf, stored.t), stored.y, stored.dt)
        return StepAnchors(
            stored=_put(stored, index, after),
            positions=positions.at[index].set(count, mode="drop"),
            spacing=spacing,
        )
