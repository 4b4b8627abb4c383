"""Online checkpointing: the number of steps is unknown until the loop stops (`<= max_steps`).

References:

- P. Stumm and A. Walther (2010), "New algorithms for optimal online checkpointing",
  SIAM J. Sci. Comput. 32(2), 836-854.
- Q. Wang, P. Moin and G. Iaccarino (2009), "Minimal repetition dynamic checkpointing algorithm
  for unsteady adjoint calculation", SIAM J. Sci. Comput. 31(4), 2549-2567.
"""

import functools

import numpy as np

from ._binomial import _check, binomial
from ._schedule import Schedule


@functools.lru_cache(maxsize=64)
def online_schedule(max_steps: int, c: int) -> Schedule:
    """An online schedule for any stopping step `n <= max_steps` with `c` snapshots.

    Three phases, by the position `i` whose storage is being decided:

    1. `i < c`: store every state (slot `i`); optimal while `n <= c + 1`.
    2. up to `C(c+2, 2)` steps: Stumm & Walther's first algorithm (repetition number 2). After
        the fill, rounds `o = c-1, ..., 1` each skip one state and then store the next `o`
        states, the first in slot `o` and the rest in slots `1, ..., o-1`. The segments between
        stored positions then always fit the bounds `1 <= len_j <= c - j + 1` under which the
        reversal is optimal, so the cost equals the offline optimum `t(n, c)` for every
        `n <= C(c+2, 2)`.
    3. beyond: Wang, Moin & Iaccarino's dynamic checkpointing. Every new state is stored; each
        slot has a level; a slot is dispensable when a later slot has a higher level. The new
        state replaces the latest dispensable slot (level 0), or, if none, the latest slot, with
        that slot's level plus one.

    Exact optimality at every `n` is impossible past `C(c+2, 2)` in this model (for `c = 2`
    the optimal second position is `{3, 4}`, `{4, 5}`, `{5, 6}`, `{6}` for `n = 7, 8, 9, 10`,
    and a position can only be replaced by the newest one), so phase 3 aims at the
    repetition-number bound instead: tests check `forward_steps <= t(n, c) + n`.

    **Example:**

    ```python
    >>> online_schedule(10, 3).positions()
    (0, 4, 7)

    ```
    """
    _check(max_steps, c)
    store = np.full(max_steps, -1, dtype=np.int64)
    store[0] = 0
    i = _fill(store, c)
    i = _stumm_walther(store, c, i)
    _wang_moin_iaccarino(store, c, i)
    return Schedule(c, store, online=True)


def _fill(store: np.ndarray, c: int) -> int:
    n = min(c, len(store))
    store[1:n] = np.arange(1, n)
    return n


def _stumm_walther(store: np.ndarray, c: int, i: int) -> int:
    """Phase 2; returns the first position it leaves to phase 3 (position `C(c+2,2) - 1`)."""
    limit = min(len(store), binomial(c, 2) - 1)
    for o in range(c - 1, 0, -1):
        i += 1  # this round skips one state
        for j, slot in enumerate([o, *range(1, o)]):
            if i + j >= limit:
                return limit
            store[i + j] = slot
        i += o
    return limit


def _wang_moin_iaccarino(store: np.ndarray, c: int, start: int) -> None:
    if c < 2 or start >= len(store):
        return
    pos = np.full(c, -1, dtype=np.int64)
    pos[0] = 0
    for i in range(1, start):
        if store[i] >= 0:
            pos[store[i]] = i
    level = np.zeros(c, dtype=np.int64)
    level[0] = np.iinfo(np.int64).max // 2  # the initial state is never replaced
    for i in range(start, len(store)):
        order = np.argsort(pos)
        # suffix maximum of levels over later positions: dispensable if a later level is higher
        later = np.maximum.accumulate(level[order][::-1])[::-1]
        later = np.append(later[1:], -1)
        dispensable = order[level[order] < later]
        if len(dispensable):
            slot, new_level = int(dispensable[-1]), 0
        else:
            slot = int(order[-1])
            new_level = int(level[slot]) + 1
        store[i] = slot
        pos[slot], level[slot] = i, new_level
