"""Offline binomial checkpointing (Revolve): the first sweep's stores for a known step count.

References:

- A. Griewank (1992), "Achieving logarithmic growth of temporal and spatial complexity in
  reverse automatic differentiation", Optimization Methods and Software 1(1).
- A. Griewank and A. Walther (2000), "Algorithm 799: Revolve: an implementation of checkpointing
  for the reverse or adjoint mode of computational differentiation", ACM TOMS 26(1).
"""

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

from ._binomial import check_counts, split
from ._schedule import NUMPY, Ops, Schedule


class OfflineStore(NamedTuple):
    """The next store of an offline schedule: `stored[slot]`, in `slot`."""

    position: Any
    slot: Any


@dataclasses.dataclass(frozen=True, eq=False)
class OfflineSchedule(Schedule):
    """Revolve's first sweep: `stored[k]` goes to slot `k` (`stored[0] = 0`), at most `c`
    positions."""

    stored: tuple[int, ...]
    online: ClassVar[bool] = False

    def start(self, ops: Ops = NUMPY) -> OfflineStore:
        return self._store(ops.int(1), ops)

    def advance(self, state: OfflineStore, ops: Ops = NUMPY) -> OfflineStore:
        return self._store(state.slot + 1, ops)

    def _store(self, slot, ops: Ops) -> OfflineStore:
        positions = ops.int((*self.stored, self.steps))  # past the last: none
        return OfflineStore(positions[ops.xp.minimum(slot, len(self.stored))], slot)


@functools.lru_cache(maxsize=64)
def offline_schedule(n: int, c: int) -> OfflineSchedule:
    """Revolve's first sweep for `n` steps with `c` snapshots, as a `Schedule`.

    Position `0` goes to slot `0`; then, from the last stored position `p` with `s` slots left,
    the next one is `p + split(n - p, s)`, until one slot is left or the next position would be
    the last step (which the loop keeps in hand anyway).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import offline_schedule
    >>> offline_schedule(10, 3).positions()
    (0, 4, 7)

    ```
    """
    check_counts(n, c)
    stored, p, s = [0], 0, c
    while s >= 2 and n - p >= 2:
        q = p + split(n - p, s)
        if q >= n - 1:
            break
        stored.append(q)
        p, s = q, s - 1
    return OfflineSchedule(c, n, tuple(stored))
