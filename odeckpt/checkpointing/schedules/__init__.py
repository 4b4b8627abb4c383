"""Checkpoint schedules as data: planning, cost model and simulator, in pure Python and NumPy.

Importing this package does not import JAX: schedules are planned at trace time from static step
counts and tested on their own. A schedule is a generator of stores run from a few integers per
slot (`Schedule`), with a table of binomials of `O(c r)` entries (`BinomialTable`): nothing is
sized by the number of steps. Both are written against an array namespace (`Ops`): the JAX loops
of `odeckpt.checkpointing` run the same generator as they step and read the same table with the
same arithmetic.

- `offline_schedule(n, c)`: Revolve, optimal `t(n, c)` forward steps (Griewank 1992; Griewank &
  Walther 2000, ACM TOMS 26, Algorithm 799).
- `online_schedule(max_steps, c)`: for loops that stop early (Stumm & Walther 2010, SISC 32(2)):
  optimal up to `C(c+2, 2)` steps, at most one step above the optimum up to `C(c+3, 3)`.
- `simulate(schedule, n)`: recomputations, peak snapshots and reversal order.
- `plan(...)`: from bytes per snapshot and a memory budget to a regime and `c`; with
  `offload="host"`, two levels: host snapshots every `segment` steps, Revolve on the device
  in between (`offload_cost`, `simulate_offload`; Stumm & Walther 2009, Aupy & Herrmann).
"""

from ._binomial import (
    BinomialTable as BinomialTable,
    binomial as binomial,
    binomial_table as binomial_table,
    optimal_cost as optimal_cost,
    repetition_number as repetition_number,
    split as split,
)
from ._multistage import (
    host_slots as host_slots,
    offload_cost as offload_cost,
    offload_recomputations as offload_recomputations,
    segment_cost as segment_cost,
)
from ._offline import offline_schedule as offline_schedule
from ._online import online_schedule as online_schedule
from ._ops import Ops as Ops
from ._planner import (
    DEFAULT_HOST_MEMORY_BUDGET as DEFAULT_HOST_MEMORY_BUDGET,
    DEFAULT_MEMORY_BUDGET as DEFAULT_MEMORY_BUDGET,
    DEFAULT_MIN_CHECKPOINTS as DEFAULT_MIN_CHECKPOINTS,
    MIN_HOST_SLOTS as MIN_HOST_SLOTS,
    Plan as Plan,
    parse_memory as parse_memory,
    plan as plan,
)
from ._schedule import Schedule as Schedule
from ._simulate import (
    Simulation as Simulation,
    simulate as simulate,
    simulate_offload as simulate_offload,
)

__all__ = [
    "DEFAULT_HOST_MEMORY_BUDGET",
    "DEFAULT_MEMORY_BUDGET",
    "DEFAULT_MIN_CHECKPOINTS",
    "MIN_HOST_SLOTS",
    "BinomialTable",
    "Ops",
    "Plan",
    "Schedule",
    "Simulation",
    "binomial",
    "binomial_table",
    "host_slots",
    "offline_schedule",
    "offload_cost",
    "offload_recomputations",
    "online_schedule",
    "optimal_cost",
    "parse_memory",
    "plan",
    "repetition_number",
    "segment_cost",
    "simulate",
    "simulate_offload",
    "split",
]
