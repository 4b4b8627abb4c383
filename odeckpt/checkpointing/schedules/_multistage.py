"""Two-level checkpointing: periodic snapshots in slow (host) memory, Revolve in fast (device)
memory between them.

The forward sweep stores the state at positions `0, m, 2m, ...` (every `segment = m` steps) in
host memory and nothing on the device. The reverse sweep takes the segments last to first: it
copies the segment's start from the host into device slot 0 (one transfer per segment), then
reverses the segment with `c` device slots (slot 0 included) by Revolve. Each segment costs two
transfers (one write in the forward sweep, one read in the reverse sweep) and the recomputations
of Revolve on `m` steps, whatever the host memory's latency.

This is the periodic structure that Aupy & Herrmann prove (asymptotically) optimal for two
levels of storage whose first level (here the device) is free to read and write and whose
second (here the host) costs a transfer, the setting of Stumm & Walther's multistage
checkpointing.

References:

- P. Stumm and A. Walther (2009), "MultiStage approaches for optimal offline checkpointing",
  SIAM J. Sci. Comput. 31(3).
- G. Aupy, J. Herrmann, P. Hovland and Y. Robert (2016), "Optimal multistage algorithm for
  adjoint computation", SIAM J. Sci. Comput. 38(3).
- G. Aupy and J. Herrmann (2019), "Periodicity in optimal hierarchical checkpointing schemes for
  adjoint computations", Optimization Methods and Software 34(6).
"""

from ._binomial import BinomialTable, exact_table, optimal_cost


def segment_cost(length: int, checkpoints: int) -> int:
    """Forward steps to reverse `length` steps from a stored start with `checkpoints` slots
    (`t(length, checkpoints)`, `0` for `length <= 1`).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import segment_cost
    >>> segment_cost(10, 3), segment_cost(1, 3), segment_cost(0, 3)
    (15, 0, 0)

    ```
    """
    return 0 if length <= 1 else optimal_cost(length, checkpoints)


def host_slots(steps: int, segment: int) -> int:
    """Host snapshots a loop of at most `steps` steps stores: one per segment started,
    `ceil(steps / segment)`.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import host_slots
    >>> host_slots(1000, 100), host_slots(1001, 100)
    (10, 11)

    ```
    """
    return -(-steps // segment)


def offload_cost(n: int, segment: int, checkpoints: int) -> int:
    """Forward steps (Revolve's convention: the first sweep to step `n - 1` plus every
    recomputation) when a loop of `n` steps is reversed with host snapshots every `segment`
    steps and `checkpoints` device slots.

    The first sweep costs `n - 1`. The last segment starts at `J m` with `J = (n - 1) // m`;
    its last step is reversed from the state the loop still holds, and the rest, `n - 1 - J m`
    steps, from the restored start. Each earlier segment costs `t(m, c)`:

    `n - 1 + J t(m, c) + t(n - 1 - J m, c)` (`offload_recomputations`).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import offload_cost
    >>> offload_cost(1000, 100, 4), offload_cost(1000, 1, 1)
    (4734, 999)

    ```
    """
    if n < 1:
        raise ValueError(f"need at least one step, got n={n}")
    table = exact_table(segment, checkpoints)
    return n - 1 + int(offload_recomputations(table, n, segment, checkpoints))


def offload_recomputations(table: BinomialTable, n, segment: int, checkpoints: int):
    """Steps the two-level reverse sweep recomputes after `n` steps (`0` for `n = 0`):
    `J t(m, c) + t(n - 1 - J m, c)`, read from `table` (rows to `checkpoints + 1`, repetition
    numbers of lengths up to `segment`) in its array namespace.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import (
    ...     BinomialTable, offline_schedule, offload_cost, offload_recomputations)
    >>> table = BinomialTable(offline_schedule(100, 4).binomials)
    >>> int(offload_recomputations(table, 1000, 100, 4)) == offload_cost(1000, 100, 4) - 999
    True

    ```
    """
    n = table.ops.int(n)
    last = table.ops.xp.maximum(n - 1, 0) // segment
    full = table.optimal_cost(table.ops.int(segment), checkpoints)
    return last * full + table.optimal_cost(n - 1 - last * segment, checkpoints)
