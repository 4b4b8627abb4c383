"""Online checkpointing: the number of steps is unknown until the loop stops (`<= max_steps`).

References:

- P. Stumm and A. Walther (2010), "New algorithms for optimal online checkpointing",
  SIAM J. Sci. Comput. 32(2), 836-854.
- A. Griewank and A. Walther (2000), "Algorithm 799: Revolve", ACM TOMS 26(1) (the repetition
  numbers and the binomial bounds `beta(s, r)` used below).
- Q. Wang, P. Moin and G. Iaccarino (2009), "Minimal repetition dynamic checkpointing algorithm
  for unsteady adjoint calculation", SIAM J. Sci. Comput. 31(4), 2549-2567 (the previous
  rule beyond `C(c+2, 2)`, measured 15-33% above `t(n, c)`; replaced).
"""

import functools
import itertools

import numpy as np

from ._binomial import _check, binomial
from ._schedule import Schedule


@functools.lru_cache(maxsize=64)
def online_schedule(max_steps: int, c: int) -> Schedule:
    """An online schedule for any stopping step `n <= max_steps` with `c` snapshots.

    Phases by repetition number `r`, with `beta(s, r) = C(s+r, r)`, `A = beta(c, 2)` and
    `B = beta(c, 3)`; the cost is compared with the offline optimum `t(n, c)`:

    1. `n <= c + 1`: store every state (slots `0..c-1`). Optimal.
    2. `n <= A` (`r = 2`): Stumm & Walther's first algorithm. After the fill, rounds
        `o = c-1, ..., 1` each skip one state and then store the next `o` states, the first in
        slot `o` and the rest in slots `1, ..., o-1`. Optimal: `t(n, c)` at every `n`.
    3. `A < n <= B` (`r = 3`): our variant of Stumm & Walther's second algorithm (the rule
        is in `_later_phases`). Cost `t(n, c) + 1` at worst, at about one stop in three, for
        every `c` we checked (`2..60`). No online schedule does better: `t(n, c)` at every
        `n` in `(A, B]` is impossible (see `docs/checkpointing.md`).
    4. `n > B` (`r >= 4`): the same rule, one phase per repetition number. Measured for
        `c <= 20` up to `2 * 10**4` steps (`10**5` for `c <= 3`): at most 12.2% above
        `t(n, c)`, 9.1% for `c >= 3`, 5% for `c >= 5`; Wang, Moin & Iaccarino's rule, used
        here before, is 15-33% above.

    **Example:**

    ```python
    >>> s = online_schedule(20, 3)
    >>> s.positions(10), s.positions(20)
    ((0, 4, 7), (0, 10, 16))

    ```
    """
    _check(max_steps, c)
    store = np.full(max_steps, -1, dtype=np.int64)
    store[0] = 0
    i = _fill(store, c)
    _stumm_walther(store, c, i)
    if c >= 2 and max_steps > binomial(c, 2):
        _later_phases(store, c)
    return Schedule(c, store, online=True)


def _fill(store: np.ndarray, c: int) -> int:
    n = min(c, len(store))
    store[1:n] = np.arange(1, n)
    return n


def _stumm_walther(store: np.ndarray, c: int, i: int) -> None:
    """Phase 2 (repetition number 2), up to position `C(c+2, 2) - 1`."""
    limit = min(len(store), binomial(c, 2) - 1)
    for o in range(c - 1, 0, -1):
        i += 1  # this round skips one state
        for j, slot in enumerate([o, *range(1, o)]):
            if i + j >= limit:
                return
            store[i + j] = slot
        i += o


def _later_phases(store: np.ndarray, c: int) -> None:
    """Phases `r = 3, 4, ...` from the placement phase 2 leaves at `n = C(c+2, 2)`.

    Phase `r` starts at `n = beta(c, r-1)` with the segments between the sorted snapshots
    `p_0 < ... < p_{c-1}` at the upper ends `beta(c-j, r-2)` of their optimal ranges for
    `r - 1`, which are the lower ends for `r` (segment `j` is reversed with `c - j` slots; the
    open segment from `p_{c-1}` to the state in hand has one). It ends at `n = beta(c, r)`
    with them at `beta(c-j, r-1)`. The final positions `P_k = sum_{j<k} beta(c-j, r-1)` are
    the targets: the newest state is stored every `r` steps (`r + 1` while the distance to
    the next target is not a multiple of `r`, so that each target is hit exactly), and a
    stored target is never released. Each store releases the latest snapshot `p_i` (not a
    target) whose two neighbouring segments, merged, still fit the upper bound
    `beta(c-i+1, r-1)` of the merged segment. See `docs/checkpointing.md` for the measured
    excess over `t(n, c)`.
    """
    held = np.zeros(c, dtype=np.int64)  # phase 2 fills every slot
    for i in range(1, binomial(c, 2) - 1):
        if store[i] >= 0:
            held[store[i]] = i
    slot_of = {int(p): s for s, p in enumerate(held)}
    pos = sorted(slot_of)
    r = 3
    while True:
        targets = itertools.accumulate(binomial(c - j, r - 1) for j in range(c - 1))
        pinned = {0}
        for target in targets:
            while pos[-1] < target:
                d = target - pos[-1]
                q = pos[-1] + (r + 1 if d % r and d > r else min(r, d))
                if q >= len(store):
                    return
                p = pos.pop(_release(pos, pinned, q, c, r))
                store[q] = slot_of[q] = slot_of.pop(p)
                pos.append(q)
            pinned.add(target)
        r += 1


def _release(pos: list[int], pinned: set[int], q: int, c: int, r: int) -> int:
    """Index of the snapshot to release when position `q` is stored (see `_later_phases`)."""
    # fewer than c - 1 targets are stored while a phase runs: some p_i (i >= 1) is releasable
    best, best_over = c - 1, None
    for i in range(c - 1, 0, -1):
        if pos[i] in pinned:
            continue
        merged = (pos[i + 1] if i + 1 < c else q) - pos[i - 1]
        over = merged - binomial(c - i + 1, r - 1)
        if over <= 0:
            return i
        if best_over is None or over < best_over:
            best, best_over = i, over
    return best  # least overflowing merge; never reached (checked: all c <= 60, some to 300)
