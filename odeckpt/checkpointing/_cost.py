"""The reverse sweep's cost in the graph: what `schedules.simulate` counts, for a step count
known only at run time (a while loop's)."""

import jax
import jax.numpy as jnp
import numpy as np

from .schedules import Schedule, binomial, repetition_number

_INT = jnp.int32
_CAP = 2**30
"""Table entries are capped here; the entries the cost formula reads stay below it."""


def recomputed_steps(schedule: Schedule, n: jax.Array) -> jax.Array:
    """Forward steps the reverse sweep recomputes after the loop ran `n` steps under
    `schedule`: `simulate(schedule, n).forward_steps - (n - 1)`, as int32.

    The snapshots held at the stop split `[0, n)` into segments; segment `j` (from the `j`-th
    stored position) is reversed with `c - j` free slots at the optimal cost `t(L_j, c - j)`,
    less the `L - 1` steps of the first sweep for the last segment, whose input state the loop
    still holds.
    """
    c, steps = schedule.checkpoints, len(schedule)
    n = jnp.asarray(n, _INT)
    # the position each slot holds at the stop: the last i in [1, n - 2] stored there
    i = jnp.arange(steps, dtype=_INT)
    store = jnp.asarray(schedule.store, _INT)
    stored = (i >= 1) & (i <= n - 2) & (store >= 0)
    held = jax.ops.segment_max(jnp.where(stored, i, -1), jnp.where(stored, store, 0), c)
    held = jnp.maximum(held, -1).at[0].set(0)
    pos = jnp.sort(jnp.where(held >= 0, held, _CAP))
    k = jnp.sum(held >= 0)
    j = jnp.arange(c, dtype=_INT)
    ends = jnp.where(j + 1 < k, jnp.append(pos[1:], _CAP), n)
    lengths = jnp.where(j < k, ends - pos, 0)
    cost = jax.vmap(_optimal_cost, in_axes=(0, 0, None))(lengths, c - j, _table(c, steps))
    last = jnp.where(j == k - 1, jnp.maximum(lengths - 1, 0), 0)
    return jnp.sum(cost - last).astype(_INT)


def offload_recomputed_steps(segment: int, checkpoints: int, n: jax.Array) -> jax.Array:
    """Forward steps the two-level reverse sweep (`offload="host"`) recomputes after the loop
    ran `n` steps: `schedules.offload_cost(n, segment, checkpoints) - (n - 1)`, as int32."""
    n = jnp.asarray(n, _INT)
    table = _table(checkpoints, segment)
    last = jnp.maximum(n - 1, 0) // segment
    full = _optimal_cost(jnp.asarray(segment, _INT), checkpoints, table)
    rest = _optimal_cost(jnp.maximum(n - 1 - last * segment, 0), checkpoints, table)
    return jnp.where(n >= 1, last * full + rest, 0).astype(_INT)


def _optimal_cost(length, slots, table):
    """`t(length, slots) = r * length - beta(slots + 1, r - 1)` (0 for `length <= 1`)."""
    r = jnp.sum(table[slots] < length).astype(_INT)
    multi = r * length - table[slots + 1, jnp.maximum(r - 1, 0)]
    single = length * (length - 1) // 2  # one slot: advance from the start every time
    cost = jnp.where(slots == 1, single, multi)
    return jnp.where(length <= 1, 0, cost)


def _table(c: int, steps: int) -> jax.Array:
    """`table[s, r] = min(beta(s, r), _CAP)` for `s <= c + 1` and every `r` that matters."""
    rmax = repetition_number(max(steps, 2), 2) + 2
    table = np.array(
        [[min(binomial(s, r), _CAP) for r in range(rmax + 1)] for s in range(c + 2)], np.int64
    )
    return jnp.asarray(table, _INT)
