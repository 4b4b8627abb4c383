"""What a plan's reverse sweep recomputes, for a step count known only at run time (a while
loop's): what `schedules.simulate` and `schedules.simulate_offload` count, in the graph."""

from typing import TYPE_CHECKING, cast

import jax
import jax.numpy as jnp
from jax import lax

from .._autodiff import on_auto_axes
from ._loop import OPS
from .schedules import BinomialTable, Plan, Schedule, binomial, offload_recomputations

if TYPE_CHECKING:
    from .schedules._offline import OfflineSchedule
    from .schedules._online import OnlineSchedule

_INT = jnp.int32
_CAP = 2**30
"""Past every position: the sort key of an empty slot."""


def recomputed_steps(plan: Plan, num_steps) -> jax.Array:
    """The forward steps the reverse sweep recomputes after the loop ran `num_steps` steps under
    `plan`, exactly as its schedule does.

    `0` in the residuals and states regimes; with `offload`, the two-level count
    (`schedules.offload_cost(n, segment, checkpoints) - (n - 1)`); else
    `schedules.simulate(plan.schedule, n).forward_steps - (n - 1)`. Computed in the graph from
    the schedule's small tables, for a step count known only at run time.

    **Arguments:**

    - `plan`: the loop's `Plan` (`while_loop_plan`, `scan_plan`).
    - `num_steps`: the steps the loop ran, `0 <= num_steps <= plan.steps` (an int, or a
        traced integer scalar).

    **Returns:** an int32 scalar.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing import recomputed_steps, schedules
    >>> plan = schedules.plan(20, 8, checkpoints=3, online=True)
    >>> [int(recomputed_steps(plan, n)) for n in (1, 5, 10, 20)]
    [0, 1, 6, 26]
    >>> schedules.simulate(plan.schedule, 20).forward_steps - 19
    26

    ```
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"recomputed_steps takes a Plan (while_loop_plan, scan_plan); got {plan!r}")
    n = jnp.asarray(num_steps, _INT)
    if plan.offload is not None:
        assert plan.schedule is not None and plan.segment is not None  # set with `offload`
        schedule, segment = plan.schedule, plan.segment
        # (read from the tables at the step count: a lane's own under `vmap`)
        return on_auto_axes(lambda n: _offload_recomputations(schedule, segment, n), n)
    if plan.regime != "binomial":  # every step's residuals or state are stored
        return jnp.zeros((), _INT)
    assert plan.schedule is not None  # set in the binomial regime
    schedule = plan.schedule
    return on_auto_axes(lambda n: _schedule_recomputations(schedule, n), n)


def _schedule_recomputations(schedule: Schedule, n: jax.Array) -> jax.Array:
    """Forward steps the reverse sweep recomputes after the loop ran `n` steps under
    `schedule`: `simulate(schedule, n).forward_steps - (n - 1)`, as int32.

    Reads the schedule's small tables (`O(c r)` entries). An online schedule is optimal up to
    `C(c+2, 2)` steps (Stumm & Walther's rounds), so there the cost is `t(n, c)`; beyond, its
    rule runs again over the stores of the phase the stop falls in, from the placement the
    phase starts with, to find the positions held at the stop.
    """
    c = schedule.checkpoints
    n = jnp.asarray(n, _INT)
    table = BinomialTable(jnp.asarray(schedule.binomials, _INT), OPS)
    if not schedule.online:
        stored = jnp.asarray(cast("OfflineSchedule", schedule).stored, _INT)
        held = jnp.full((c,), -1, _INT).at[: stored.shape[0]].set(stored)
        return _placement_cost(jnp.where(held <= n - 2, held, -1).at[0].set(0), n, table)
    optimal = (table.optimal_cost(n, c) - jnp.maximum(n - 1, 0)).astype(_INT)
    schedule = cast("OnlineSchedule", schedule)
    if not schedule.later_phases:
        return optimal
    # the phase of the last store before the stop: the one starting at the last
    # beta(c, r - 1) <= n - 2 (from r = 3 on)
    r = jnp.maximum(3, 2 + jnp.sum(table.table[c, 2:] <= n - 2, dtype=_INT))
    at_stop = lambda s: s.position <= n - 2
    state = lax.while_loop(
        at_stop, lambda s: schedule.advance(s, OPS), schedule.phase_start(r, OPS)
    )
    return jnp.where(n <= binomial(c, 2), optimal, _placement_cost(state.held, n, table))


def _offload_recomputations(schedule: Schedule, segment: int, n: jax.Array) -> jax.Array:
    """Forward steps the two-level reverse sweep recomputes after the loop ran `n` steps, with
    host snapshots every `segment` steps and Revolve's `schedule` for one segment on the
    device: `schedules.offload_cost(n, segment, c) - (n - 1)`, as int32."""
    table = BinomialTable(jnp.asarray(schedule.binomials, _INT), OPS)
    return offload_recomputations(table, n, segment, schedule.checkpoints).astype(_INT)


def _placement_cost(held, n, table):
    """Recomputed steps from the positions `held` by the slots at the stop `n` (`-1`: empty).

    The held positions split `[0, n)` into segments; segment `j` (from the `j`-th position) is
    reversed from its restored start with `c - j` free slots at the optimal cost
    `t(L_j, c - j)`. The last step of the last one is reversed from the state the loop still
    holds, and the rest of it, `L - 1` steps, from its start: `t(L - 1, c - k + 1)`.
    """
    c = held.shape[0]
    pos = jnp.sort(jnp.where(held >= 0, held, _CAP))
    k = jnp.sum(held >= 0)
    j = jnp.arange(c, dtype=_INT)
    ends = jnp.where(j + 1 < k, jnp.append(pos[1:], _CAP), n)
    lengths = jnp.where(j < k, ends - pos, 0)
    lengths = jnp.where(j == k - 1, jnp.maximum(lengths - 1, 0), lengths)
    cost = jax.vmap(table.optimal_cost)(lengths, c - j)
    return jnp.sum(cost).astype(_INT)
