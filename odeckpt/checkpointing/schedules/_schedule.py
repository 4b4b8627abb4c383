"""A checkpoint schedule as data: which slot, if any, each position's state is stored in."""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """Where the forward sweep stores states.

    **Fields:**

    - `checkpoints`: number of snapshot slots `c` (slot `0` always holds the initial state).
    - `store`: integer array over positions; `store[i] = k >= 0` stores the state before step
        `i` in slot `k` (overwriting what was there), `-1` stores nothing. The decision for
        position `i` is taken once step `i + 1` is known to run (the loop keeps the previous
        state in hand), so a schedule never wastes a slot on the last state before the stop.
    - `online`: whether the schedule is valid for every stopping step (while loops) or for its
        length only (scans).

    The reverse sweep needs nothing else: it sorts the stored positions and reverses segment by
    segment with `split` (see `simulate`).
    """

    checkpoints: int
    store: np.ndarray
    online: bool

    def __len__(self) -> int:
        return len(self.store)

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
        n = len(self.store) if n is None else n
        return tuple(int(p) for p in sorted(p for p in self.slots_at(n) if p >= 0))
