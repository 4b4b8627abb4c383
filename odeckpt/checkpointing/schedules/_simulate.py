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
        `("advance", pos)` and `("reverse", pos)` (and `("load", pos)`, a copy from host
        memory, for `simulate_offload`), only when `record=True`.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import offline_schedule, simulate
    >>> sim = simulate(offline_schedule(10, 3), 10)
    >>> sim.steps, sim.forward_steps, sim.step_evaluations, sim.peak_snapshots
    (10, 15, 26, 3)
    >>> sim.reversal_order[:3]
    (9, 8, 7)
    >>> simulate(offline_schedule(4, 2), 4, record=True).actions[:2]
    (('reverse', 3), ('restore', 2))

    ```
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
    >>> from odeckpt.checkpointing.schedules import offline_schedule, optimal_cost, simulate
    >>> sim = simulate(offline_schedule(10, 3), 10)
    >>> sim.forward_steps == optimal_cost(10, 3), sim.peak_snapshots
    (True, 3)

    ```
    """
    if not 1 <= n <= len(schedule):
        raise ValueError(f"n must be in [1, {len(schedule)}], got {n}")
    c = schedule.checkpoints
    stack = sorted(int(p) for p in schedule.slots_at(n) if p >= 0)
    replay = _Replay(c, record)
    replay.run(stack, n, n - 1)
    forward = n - 1 + replay.advances
    return Simulation(
        n, forward, forward + 1 + n, replay.peak, tuple(replay.order), tuple(replay.actions)
    )


def simulate_offload(n: int, segment: int, checkpoints: int, *, record: bool = False) -> Simulation:
    """Run the two-level schedule (host snapshots every `segment` steps, `checkpoints` device
    slots) for a loop that stops after `n` steps, exactly as the JAX loops with
    `offload="host"` do.

    The forward sweep stores positions `0, segment, 2 segment, ...` in host memory. The reverse
    sweep takes the segments last to first: it copies the segment's start into device slot 0
    (`("load", pos)` in `actions`) and reverses the segment like `simulate` with the stack
    `[start]`. `peak_snapshots` counts device slots.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import offload_cost, simulate_offload
    >>> sim = simulate_offload(1000, 100, 4)
    >>> sim.forward_steps == offload_cost(1000, 100, 4), sim.peak_snapshots
    (True, 4)

    ```
    """
    if n < 1 or segment < 1 or checkpoints < 1:
        raise ValueError(f"need n, segment, checkpoints >= 1, got {n}, {segment}, {checkpoints}")
    replay = _Replay(checkpoints, record)
    end, cur = n, n - 1
    for j in range((n - 1) // segment, -1, -1):
        if record:
            replay.actions.append(("load", j * segment))
        end, cur = replay.run([j * segment], end, cur)
    forward = n - 1 + replay.advances
    return Simulation(
        n, forward, forward + 1 + n, replay.peak, tuple(replay.order), tuple(replay.actions)
    )


class _Replay:
    """The reverse sweep of the JAX loops on a Python stack of stored positions."""

    def __init__(self, checkpoints: int, record: bool):
        self.c, self.record = checkpoints, record
        self.advances, self.peak = 0, 0
        self.order: list[int] = []
        self.actions: list[tuple[str, int]] = []

    def run(self, stored: list[int], end: int, cur: int) -> tuple[int, int]:
        """Reverse `[stored[0], end)` with `cur` in hand (`-1`: none); returns `(end, cur)`."""
        c, record, actions = self.c, self.record, self.actions
        stack = stored + [-1] * (c - len(stored))
        k = len(stored)
        self.peak = max(self.peak, k)
        bottom = stored[0]
        while end > bottom:
            top = stack[k - 1]
            if cur < 0:
                cur = top
                if record:
                    actions.append(("restore", cur))
            length, free = end - top, c - k + 1
            if free >= 2 and cur < end - 1 and cur == top + split(length, free):
                stack[k] = cur
                k += 1
                self.peak = max(self.peak, k)
                if record:
                    actions.append(("store", cur))
            if cur == end - 1:
                self.order.append(cur)
                if record:
                    actions.append(("reverse", cur))
                end, cur = end - 1, -1
                if end == stack[k - 1]:
                    k -= 1
            else:
                if record:
                    actions.append(("advance", cur))
                cur += 1
                self.advances += 1
        return end, cur
