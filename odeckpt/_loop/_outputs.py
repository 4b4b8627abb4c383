"""The output buffers of the integration loop, and the rows each step writes to them.

Buffers are never part of the loop state, so a checkpointing runner never copies them: each step
writes its rows once, at their indices (an out-of-range index drops a row).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._checks import all_finite, leading_mask
from .._types import Scalar, Y
from ._landing import distinct_save_times


class TimedRows(eqx.Module):
    """Rows with a time each: `t[i]` and the leading row `i` of every leaf of `values`."""

    t: Array
    values: Y


class Rows(eqx.Module):
    """Rows to write: `values` (leaves with a leading axis `k`) go to the rows `index` (int32
    `[k]`) of a buffer group."""

    index: Int[Array, " k"]
    values: Y


class Writes(eqx.Module):
    """What one step writes, by output group (`None` for a group not requested): the save
    times it interpolates, its end (`SaveAt(steps=True)`), its continuous extension
    (`SaveAt(dense=True)`)."""

    ts: Rows | None = None
    steps: Rows | None = None
    dense: Rows | None = None

    def only_where(self, keep: Array) -> "Writes":
        """These writes where `keep` holds; elsewhere (a finished lane under `vmap`) every row
        goes to an out-of-range index, which the buffers drop."""

        def mask(rows):
            return (
                None if rows is None else Rows(index_unless_dropped(keep, rows.index), rows.values)
            )

        return Writes(mask(self.ts), mask(self.steps), mask(self.dense))


def index_unless_dropped(keep: Array, index: Array) -> Array:
    """`index` where `keep` holds, else an index past any buffer (a write there is dropped)."""
    return jnp.where(keep, index, jnp.iinfo(jnp.int32).max)


class Outputs(eqx.Module):
    """The output buffers of a solve, by group (`None` for a group not requested).

    **Fields:**

    - `ts`: one row per distinct save time (a pytree like `y0` with a leading axis).
    - `steps`: the end time and state of every accepted step, `max_steps` rows.
    - `dense`: the end time and continuous extension of every accepted step, `max_steps` rows.
    """

    ts: Y | None = None
    steps: TimedRows | None = None
    dense: TimedRows | None = None

    def groups(self) -> list:
        """The requested groups, in a fixed order: what a loop runner takes as buffers."""
        return [g for g in (self.ts, self.steps, self.dense) if g is not None]

    def from_groups(self, groups: list) -> "Outputs":
        """These outputs with their groups replaced by `groups` (as `groups()` orders them)."""
        it = iter(groups)
        kept = (None if g is None else next(it) for g in (self.ts, self.steps, self.dense))
        return Outputs(*kept)

    def write(self, writes: Writes) -> "Outputs":
        """Scatter each group's rows into its buffers, dropping out-of-range rows."""

        def scatter(group, rows):
            if group is None:
                return None
            return jax.tree.map(
                lambda buffer, v: buffer.at[rows.index].set(v, mode="drop"), group, rows.values
            )

        return Outputs(
            scatter(self.ts, writes.ts),
            scatter(self.steps, writes.steps),
            scatter(self.dense, writes.dense),
        )


def written_groups(writes: Writes) -> list[tuple[Array, Y]]:
    """A step's writes as `(index, values)` pairs in the order of `Outputs.groups()`: what the
    checkpointing engine takes."""
    return [(w.index, w.values) for w in (writes.ts, writes.steps, writes.dense) if w is not None]


class DistinctSaveTimes(eqx.Module):
    """Save times with each value once, as the loop takes them: `ts` sorted, the repeats of a
    value replaced by `inf` at the end (never reached), `rows[i]`, the row of `ts` that holds
    the `i`-th save time of the original array (see `_landing.distinct_save_times`), and
    `first[i]`, the position in the original array of that value's first occurrence."""

    ts: Float[Array, " n"]
    rows: Int[Array, " n"]
    first: Int[Array, " n"]

    @classmethod
    def make(cls, ts: Float[Array, " n"]) -> "DistinctSaveTimes":
        """From sorted save times `ts` (internal times: increasing)."""
        first = jnp.searchsorted(ts, ts, side="left").astype(jnp.int32)
        return cls(*distinct_save_times(jnp, ts), first)

    def gather(
        self,
        ys: Y,
        ts: Float[Array, " n"] | None = None,
        rate: Callable[[Scalar, Y], Y] | None = None,
    ) -> Y:
        """The saved values `ys` (one row per distinct time) as one row per original time.

        A repeated time's row holds its first occurrence's value, and so its derivatives. With
        the original times `ts` and `rate(t, y)`, the solution's derivative in time, each row
        also moves with its own time: the repeat's row gains `rate * (d ts[i] - d ts[first])`
        (the value is unchanged).
        """
        gathered = jax.tree.map(lambda y: y[self.rows], ys)
        if ts is None or rate is None:
            return gathered
        reached = jax.vmap(lambda *row: all_finite(row))(*jax.tree.leaves(gathered))
        fixed = jax.lax.stop_gradient(gathered)
        safe_t = jnp.where(reached, ts, 0)
        safe_y = jax.tree.map(lambda y: jnp.where(leading_mask(reached, y), y, 0), fixed)
        moved = ts - ts[self.first]
        moved = jnp.where(reached, moved - jax.lax.stop_gradient(moved), 0)
        slopes = jax.vmap(rate)(jax.lax.stop_gradient(safe_t), safe_y)
        return jax.tree.map(
            lambda y, s: y + leading_mask(moved, s).astype(s.dtype) * s, gathered, slopes
        )
