"""Offline binomial checkpointing (Revolve): closed forms and the optimal first split.

References:

- A. Griewank (1992), "Achieving logarithmic growth of temporal and spatial complexity in
  reverse automatic differentiation", Optimization Methods and Software 1(1).
- A. Griewank and A. Walther (2000), "Algorithm 799: Revolve: an implementation of checkpointing
  for the reverse or adjoint mode of computational differentiation", ACM TOMS 26(1).
"""

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from ._ops import NUMPY, Ops


def binomial(s: int, r: int) -> int:
    """`beta(s, r) = C(s + r, s)`: the most steps `s` snapshots reverse with repetition `r`.

    By convention `beta(s, r) = 0` for `r < 0`.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import binomial
    >>> binomial(3, 2)
    10

    ```
    """
    if r < 0 or s < 0:
        return 0
    return math.comb(s + r, s)


def repetition_number(n: int, c: int) -> int:
    """The repetition number `r`: the unique integer with `beta(c, r-1) < n <= beta(c, r)`.

    **Arguments:**

    - `n`: number of steps, `n >= 1`.
    - `c`: number of snapshots (counting the slot that holds the initial state), `c >= 1`.

    **Returns:**

    `r`: the most times Revolve's optimal schedule advances any one step, the first sweep
    included (`n - 1` for a single snapshot).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import binomial, repetition_number
    >>> binomial(3, 2), repetition_number(10, 3), repetition_number(11, 3)
    (10, 2, 3)
    >>> repetition_number(10, 1)
    9

    ```
    """
    check_counts(n, c)
    if c == 1:
        return n - 1
    r = 0
    while binomial(c, r) < n:
        r += 1
    return r


@functools.lru_cache(maxsize=2**16)
def optimal_cost(n: int, c: int) -> int:
    """Minimal number of forward steps `t(n, c) = r*n - C(c+r, r-1)` to reverse `n` steps.

    Counts every forward step, the first sweep from `0` to `n - 1` included, but not the `n`
    reverse steps (Griewank 1992, Griewank & Walther 2000). Evaluates
    `BinomialTable.optimal_cost`, the arithmetic the JAX loops run.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import optimal_cost
    >>> optimal_cost(10, 3), optimal_cost(10, 10), optimal_cost(10, 1)
    (15, 9, 45)

    ```
    """
    check_counts(n, c)
    return int(exact_table(n, c).optimal_cost(n, c))


@functools.lru_cache(maxsize=2**16)
def split(length: int, snapshots: int) -> int:
    """Optimal first advance `m` for reversing `length` steps with `snapshots` slots.

    `snapshots` counts the slot that holds the segment's start. Any `m` with
    `beta(s, r-2) <= m <= beta(s, r-1)` and `beta(s-1, r-1) <= length - m <= beta(s-1, r)` is
    optimal, because `t(., s)` is convex and piecewise linear with slope `r` on
    `(beta(s, r-1), beta(s, r)]`; we return the largest such `m`. With one slot there is no
    split: advance to the last step (`m = length - 1`). Evaluates `BinomialTable.split`, the
    arithmetic the JAX loops run.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import split
    >>> split(10, 3), split(10, 10), split(10, 1)
    (4, 1, 9)

    ```
    """
    if length < 2:
        raise ValueError(f"split needs length >= 2, got {length}")
    if snapshots <= 1:
        return length - 1
    return int(exact_table(length, snapshots).split(length, snapshots))


def binomial_table(c: int, length: int, *, repetitions: int | None = None) -> np.ndarray:
    """`table[s, r] = min(beta(s, r), length + 1)` for `s <= c` and every `r` that matters.

    `BinomialTable` reads Revolve's arithmetic from it for any `L <= length` whose repetition
    number with `s` slots is at most `repetitions` (default: every `L <= length` and
    `2 <= s <= c`). The columns go to `repetitions + 1`.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import binomial_table
    >>> binomial_table(3, 100, repetitions=2)
    array([[ 1,  1,  1,  1],
           [ 1,  2,  3,  4],
           [ 1,  3,  6, 10],
           [ 1,  4, 10, 20]])

    ```
    """
    if repetitions is None:
        repetitions = 0 if c < 2 else repetition_number(max(length, 2), 2)
    # beta(s, r) = sum_{t <= s} beta(t, r - 1): each column the running sum of the one before
    table = np.ones((c + 1, repetitions + 2), dtype=np.int64)
    for r in range(1, repetitions + 2):
        table[:, r] = np.minimum(np.cumsum(table[:, r - 1]), length + 1)
    return table


@dataclasses.dataclass(frozen=True)
class BinomialTable:
    """Revolve's arithmetic read from a table of binomials `table[s, r] = beta(s, r)`, capped
    above the lengths it is asked about (`binomial_table`), in the array namespace of `ops`.

    The one implementation of the repetition number, `split` and `t(L, s)`: the Python
    functions of this module evaluate it with NumPy, the JAX loops with `jax.numpy` on traced
    lengths and slot counts (`Ops`). Rows must reach `s + 1`, columns the repetition number.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import BinomialTable, binomial_table
    >>> table = BinomialTable(binomial_table(4, 100))
    >>> int(table.repetition_number(10, 3)), int(table.split(10, 3))
    (2, 4)
    >>> int(table.optimal_cost(10, 3)), int(table.optimal_cost(1, 3))
    (15, 0)

    ```
    """

    table: Any
    ops: Ops = NUMPY

    def repetition_number(self, length, slots):
        """`r` with `beta(slots, r-1) < length <= beta(slots, r)`: the number of entries of
        row `slots` below `length` (`0` for `length <= 1`)."""
        return self.ops.xp.sum(self.table[slots] < length, dtype=self.ops.dtype)

    def split(self, length, slots):
        """`split(length, slots)` for `length >= 2` and `slots >= 2` (values below are read as
        `2`: the loops only use the result where they hold)."""
        xp = self.ops.xp
        slots = xp.clip(slots, 2, self.table.shape[0] - 1)
        length = xp.maximum(length, 2)
        r = self.repetition_number(length, slots)
        return xp.minimum(self.table[slots, r - 1], length - self.table[slots - 1, r - 1])

    def optimal_cost(self, length, slots):
        """`t(length, slots) = r * length - beta(slots + 1, r - 1)`, `0` for `length <= 1`."""
        xp = self.ops.xp
        r = self.repetition_number(length, slots)
        multi = r * length - self.table[slots + 1, xp.maximum(r - 1, 0)]
        single = length * (length - 1) // 2  # one slot: advance from the start every time
        cost = xp.where(slots == 1, single, multi)
        return xp.where(length <= 1, 0, cost)


_INT64_HEADROOM = 2**62


def exact_table(n: int, c: int) -> BinomialTable:
    """A table that reads `t(L, s)` and `split(L, s)` exactly for `L <= n`, `s <= c`: columns
    to the repetition number, entries capped above `r n` (the largest the cost reads)."""
    r = repetition_number(n, c) if c >= 2 else 1
    cap = (r + 1) * n
    if (c + 3) * cap >= _INT64_HEADROOM:
        raise ValueError(
            f"t(n, c) for n={n}, c={c} exceeds the integer range of the schedules; "
            "lower the number of steps"
        )
    return BinomialTable(binomial_table(c + 1, cap, repetitions=r))


def check_counts(n: int, c: int) -> None:
    if n < 1:
        raise ValueError(f"need at least one step, got n={n}")
    if c < 1:
        raise ValueError(
            f"checkpoints must be >= 1 (the slot holding the initial state), got {c}; "
            "pass checkpoints=1 or more, or a memory_budget"
        )
