"""A checkpoint schedule as data: a generator of the stores of the forward sweep, each a position
and the slot its state goes to, run from a state of a few integers per slot."""

import abc
import dataclasses
import functools
from typing import Any, ClassVar

import numpy as np

from ._binomial import binomial_table, repetition_number
from ._ops import NUMPY, Ops

MAX_STEPS = 2**30
"""Schedules count positions in int32 (in the JAX loops): `steps` stays below this."""


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule(abc.ABC):
    """Where the forward sweep stores states.

    **Fields:**

    - `checkpoints`: number of snapshot slots `c` (slot `0` always holds the initial state).
    - `steps`: number of positions `0, ..., steps - 1` (`n` for a scan, `max_steps` for a
        while loop).

    A schedule generates its stores `(position, slot)` in increasing position: the state of
    the generator, a few integers per slot, has fields `position` and `slot` (the next store;
    `position >= steps`: none), `start` gives the first and `advance` the next. Planning thus
    costs nothing per position, and the JAX loops run the same generator (`Ops`) as they step.
    Storing position `i` in slot `k` overwrites what `k` held. The decision for position `i`
    is taken once step `i + 1` is known to run (the loop keeps the previous state in hand), so
    a schedule never wastes a slot on the last state before the stop.

    `online`: whether the schedule is valid for every stopping step (while loops) or for its
    length only (scans). The reverse sweep needs nothing else: it sorts the stored positions
    and reverses segment by segment with `split` (see `simulate`), computed from `binomials`.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import Schedule, offline_schedule
    >>> s = offline_schedule(10, 3)
    >>> isinstance(s, Schedule), s.checkpoints, s.steps, s.online
    (True, 3, 10, False)
    >>> state, stores = s.start(), []
    >>> while state.position < s.steps:
    ...     stores.append((int(state.position), int(state.slot)))
    ...     state = s.advance(state)
    >>> stores, s.positions()  # (position, slot); slot 0 holds position 0
    ([(4, 1), (7, 2)], (0, 4, 7))

    ```
    """

    checkpoints: int
    steps: int
    online: ClassVar[bool]

    def __post_init__(self):
        if self.steps >= MAX_STEPS:
            raise ValueError(
                f"a checkpoint schedule counts positions in int32 and takes fewer than 2**30 "
                f"steps, got {self.steps}; lower max_steps (or the length of the scan)"
            )

    @abc.abstractmethod
    def start(self, ops: Ops = NUMPY) -> Any:
        """The generator's state at the first store."""

    @abc.abstractmethod
    def advance(self, state, ops: Ops = NUMPY) -> Any:
        """The generator's state at the store after `state`'s."""

    @functools.cached_property
    def repetitions(self) -> int:
        """Revolve's `r` for `steps` and `c`: the largest repetition number of the segments the
        reverse sweep reverses, each with its free slots (for an online schedule a property of
        its rule, which the tests check; `binomials` resolves one more)."""
        c = self.checkpoints
        return 1 if c < 2 else repetition_number(max(self.steps, 2), c)

    @functools.cached_property
    def binomials(self) -> np.ndarray:
        """`table[s, r] = min(beta(s, r), 2**30 - 1)` for `s <= c + 1` and the `r` the reverse
        sweep reads (`split`, and the costs `t(L, s)` of the segments it reverses): `O(c r)`
        entries (see `binomial_table`; the cost reads entries beyond `steps`)."""
        return binomial_table(self.checkpoints + 1, MAX_STEPS - 2, repetitions=self.repetitions + 1)

    @functools.cached_property
    def store(self) -> np.ndarray:
        """The stores as a table over positions: `store[i] = k >= 0` stores the state before
        step `i` in slot `k`, `-1` stores nothing (`O(steps)`: for inspection and tests)."""
        store = np.full(self.steps, -1, dtype=np.int64)
        store[0] = 0
        state = self.start()
        while state.position < self.steps:
            store[state.position] = state.slot
            state = self.advance(state)
        return store

    def __len__(self) -> int:
        return self.steps

    def slots_at(self, n: int) -> np.ndarray:
        """Position held by each slot when the loop stops after `n` steps (`-1`: empty)."""
        pos = np.full(self.checkpoints, -1, dtype=np.int64)
        pos[0] = 0
        for i in range(1, n - 1):
            k = self.store[i]
            if k >= 0:
                pos[k] = i
        return pos

    def positions(self, n: int | None = None) -> tuple[int, ...]:
        """Sorted stored positions when the loop stops after `n` steps (default: all)."""
        n = self.steps if n is None else n
        return tuple(int(p) for p in sorted(p for p in self.slots_at(n) if p >= 0))
