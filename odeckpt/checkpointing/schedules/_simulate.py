"""Execute a schedule on a Python model of the loop: the reference for the JAX reverse sweep."""

import dataclasses

from ._binomial import split
from ._schedule import Schedule


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What running a schedule for `n` steps costs.

    **Fields:**

    - `steps`: number of steps `n` the loop ran.
    - `forward_steps`: forward steps in Revolve's convention: the first sweep to step `n - 1`
        plus every recomputation. Equals `optimal_cost(n, c)` for an optimal schedule.
    - `step_evaluations`: evaluations of the step function by odeckpt's loops: the `n` forward
        steps of the primal sweep, the recomputations, and one VJP per step
        (`forward_steps + 1 + n`).
    - `peak_snapshots`: most slots in use at once.
    - `reversal_order`: the step indices in the order their VJPs run (always `n-1, ..., 0`).
    - `actions`: the reverse sweep as a list of `("restore", pos)`, `("store", pos)`,
        `("advance", pos)` and `("reverse", pos)` (only when `record=True`).
    """

    steps: int
    forward_steps: int
    step_evaluations: int
    peak_snapshots: int
    reversal_order: tuple[int, ...]
    actions: tuple[tuple[str, int], ...] = ()


def simulate(schedule: Schedule, n: int, *, record: bool = False) -> Simulation:
    """Run `schedule` for a loop that stops after `n` steps, exactly as the JAX loops do.

    The reverse sweep keeps the stored positions as a stack (sorted). Each iteration evaluates
    the step function once: restore the top snapshot if no state is in hand; store the state in
    hand if it sits at `top + split(end - top, free slots + 1)`; then reverse step `end - 1` if
    the state in hand is its input, else advance one step.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import offline_schedule, optimal_cost
    >>> sim = simulate(offline_schedule(10, 3), 10)
    >>> sim.forward_steps == optimal_cost(10, 3), sim.peak_snapshots
    (True, 3)

    ```
    """
    if not 1 <= n <= len(schedule):
        raise ValueError(f"n must be in [1, {len(schedule)}], got {n}")
    c = schedule.checkpoints
    slots = schedule.slots_at(n)
    stack = sorted(int(p) for p in slots if p >= 0)
    peak = len(stack)
    stack += [-1] * (c - len(stack))
    k = len([p for p in stack if p >= 0])
    end, cur, advances = n, n - 1, 0
    order: list[int] = []
    actions: list[tuple[str, int]] = []
    while end > 0:
        top = stack[k - 1]
        if cur < 0:
            cur = top
            if record:
                actions.append(("restore", cur))
        length, free = end - top, c - k + 1
        if free >= 2 and cur < end - 1 and cur == top + split(length, free):
            stack[k] = cur
            k += 1
            peak = max(peak, k)
            if record:
                actions.append(("store", cur))
        if cur == end - 1:
            order.append(cur)
            if record:
                actions.append(("reverse", cur))
            end, cur = end - 1, -1
            if end == stack[k - 1]:
                k -= 1
        else:
            if record:
                actions.append(("advance", cur))
            cur += 1
            advances += 1
    forward = n - 1 + advances
    return Simulation(n, forward, forward + 1 + n, peak, tuple(order), tuple(actions))
