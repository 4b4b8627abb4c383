"""Offline binomial checkpointing (Revolve): closed forms and the optimal first split.

References:

- A. Griewank (1992), "Achieving logarithmic growth of temporal and spatial complexity in
  reverse automatic differentiation", Optimization Methods and Software 1(1).
- A. Griewank and A. Walther (2000), "Algorithm 799: Revolve: an implementation of checkpointing
  for the reverse or adjoint mode of computational differentiation", ACM TOMS 26(1).
"""

import math

import numpy as np


def binomial(s: int, r: int) -> int:
    """`beta(s, r) = C(s + r, s)`: the most steps `s` snapshots reverse with repetition `r`.

    By convention `beta(s, r) = 0` for `r < 0`.

    **Example:**

    ```python
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
    """
    _check(n, c)
    if c == 1:
        return n - 1
    r = 0
    while binomial(c, r) < n:
        r += 1
    return r


def optimal_cost(n: int, c: int) -> int:
    """Minimal number of forward steps `t(n, c) = r*n - C(c+r, r-1)` to reverse `n` steps.

    Counts every forward step, the first sweep from `0` to `n - 1` included, but not the `n`
    reverse steps (Griewank 1992, Griewank & Walther 2000).

    **Example:**

    ```python
    >>> optimal_cost(10, 3), optimal_cost(10, 10), optimal_cost(10, 1)
    (15, 9, 45)

    ```
    """
    r = repetition_number(n, c)
    return r * n - binomial(c + 1, r - 1)


def split(length: int, snapshots: int) -> int:
    """Optimal first advance `m` for reversing `length` steps with `snapshots` slots.

    `snapshots` counts the slot that holds the segment's start. Any `m` with
    `beta(s, r-2) <= m <= beta(s, r-1)` and `beta(s-1, r-1) <= length - m <= beta(s-1, r)` is
    optimal, because `t(., s)` is convex and piecewise linear with slope `r` on
    `(beta(s, r-1), beta(s, r)]`; we return the largest such `m`. With one slot there is no
    split: advance to the last step (`m = length - 1`).
    """
    if length < 2:
        raise ValueError(f"split needs length >= 2, got {length}")
    if snapshots <= 1:
        return length - 1
    r = repetition_number(length, snapshots)
    return min(binomial(snapshots, r - 1), length - binomial(snapshots - 1, r - 1))


def binomial_table(c: int, length: int, *, repetitions: int | None = None) -> np.ndarray:
    """`table[s, r] = min(beta(s, r), length + 1)` for `s <= c` and every `r` that matters.

    The JAX loops compute `split` from this small table with integer arithmetic:
    `r = sum(table[s] < L)` and `m = min(table[s, r-1], L - table[s-1, r-1])`, for any
    `L <= length` whose repetition number with `s` slots is at most `repetitions` (default:
    every `L <= length` and `2 <= s <= c`). The columns go to `repetitions + 1`.
    """
    if repetitions is None:
        repetitions = 0 if c < 2 else repetition_number(max(length, 2), 2)
    # beta(s, r) = sum_{t <= s} beta(t, r - 1): each column the running sum of the one before
    table = np.ones((c + 1, repetitions + 2), dtype=np.int64)
    for r in range(1, repetitions + 2):
        table[:, r] = np.minimum(np.cumsum(table[:, r - 1]), length + 1)
    return table


def _check(n: int, c: int) -> None:
    if n < 1:
        raise ValueError(f"need at least one step, got n={n}")
    if c < 1:
        raise ValueError(
            f"checkpoints must be >= 1 (the slot holding the initial state), got {c}; "
            "pass checkpoints=1 or more, or a memory_budget"
        )
