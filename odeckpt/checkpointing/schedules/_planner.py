"""From a memory budget to a regime and a number of snapshots, with the predicted cost."""

import dataclasses
import re
from typing import Literal

from ._binomial import binomial, optimal_cost
from ._multistage import host_slots, offload_cost
from ._offline import offline_schedule
from ._online import online_schedule
from ._schedule import Schedule

DEFAULT_MEMORY_BUDGET = 64 * 2**20
"""Budget used when neither `checkpoints` nor `memory_budget` is given: 64 MiB."""
DEFAULT_MIN_CHECKPOINTS = 4
"""Fewest snapshots the default rule uses, however large the state; also the device slots an
offloading plan keeps when given no device budget."""
DEFAULT_HOST_MEMORY_BUDGET = 4 * 2**30
"""Host budget of an offloading plan given no host budget or host checkpoints: 4 GiB."""
MIN_HOST_SLOTS = 2
"""Slots of the smallest host buffer: a one-slot buffer would be read and written whole, which
XLA:GPU folds into a bitcast across memory spaces and fails to compile."""

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}

Regime = Literal["residuals", "states", "binomial"]
Offload = Literal["host"]
_LEVELS = ("device", "host")


def parse_memory(budget: int | str) -> int:
    """Bytes from an int or a string such as `"2GB"`, `"512MiB"` or `"1.5 GiB"`.

    **Arguments:**

    - `budget`: a positive int number of bytes, or a string: a number followed by a unit,
        case-insensitive, spaces allowed: `B`, decimal `KB`, `MB`, `GB`, `TB` (powers of
        1000) or binary `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024); no unit means bytes.

    **Returns:**

    The number of bytes, an int (rounded down). Raises a `ValueError` for a string it cannot
    parse or a value that is not positive, and a `TypeError` for another type (a `bool`
    included).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import parse_memory
    >>> parse_memory("2GB"), parse_memory("512MiB"), parse_memory(4096)
    (2000000000, 536870912, 4096)

    ```
    """
    if isinstance(budget, bool):
        raise TypeError("memory_budget must be an int number of bytes or a string like '2GB'")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", budget)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot parse memory_budget={budget!r}; write bytes as an int or a string "
                "such as '2GB', '512MiB' or '1.5GiB'"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise TypeError(
            f"memory_budget must be an int number of bytes or a string like '2GB', got "
            f"{type(budget).__name__}"
        )
    if value <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a checkpointed loop will run, decided at trace time.

    **Fields:**

    - `regime`: `"residuals"` (store the VJP residuals of every step: one forward sweep, no
        recomputation), `"states"` (store every state, each step recomputed once in its VJP) or
        `"binomial"` (`checkpoints < steps` snapshots, Revolve or online schedule).
    - `steps`: `n` for a scan, `max_steps` for a while loop.
    - `online`: whether the number of steps is only bounded (while loop).
    - `checkpoints`: snapshot slots `c` (`0` in the residuals regime).
    - `snapshot_bytes`, `residual_bytes`: bytes of one state and of one step's VJP residuals.
    - `memory_bytes`: predicted bytes held for the reverse sweep.
    - `forward_steps`: predicted forward steps at `steps` (Revolve's convention, first sweep
        included); for online schedules exact up to `C(c+2, 2)` steps and at most `steps` more
        beyond (see `online_schedule`); with `offload`, exact at every stop
        (`offload_cost`).
    - `offload`: `None`, or `"host"`: snapshots every `segment` steps go to host memory, and
        `checkpoints` (device slots, slot 0 holding the copy of the segment's start) reverse
        each segment by Revolve. Then `memory_bytes` counts device memory only.
    - `segment`: steps between host snapshots (`None` without `offload`).
    - `host_checkpoints`: host snapshots at `steps`; `host_bytes`: the host buffer's bytes, with
        at least `MIN_HOST_SLOTS` slots (XLA:GPU cannot compile a one-slot host buffer).
    - `transfers`: predicted copies between device and host at `steps` (one write and one
        read per segment).

    `slots` and `schedule` follow from these.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import plan
    >>> p = plan(10_000, snapshot_bytes=2**20, memory_budget="16MiB")
    >>> p.regime, p.checkpoints, p.forward_steps
    ('binomial', 16, 44015)
    >>> p.schedule.positions()[:4], p.slots
    ((0, 4845, 6940, 7620), 16)

    ```
    """

    regime: Regime
    steps: int
    online: bool
    checkpoints: int
    snapshot_bytes: int
    residual_bytes: int | None
    memory_bytes: int
    forward_steps: int
    offload: Offload | None = None
    segment: int | None = None
    host_checkpoints: int = 0
    host_bytes: int = 0
    transfers: int = 0

    @property
    def slots(self) -> int:
        """Snapshot slots the reverse sweep keeps: `checkpoints`, plus `host_checkpoints` with
        `offload` (`0` in the residuals regime)."""
        return self.checkpoints + self.host_checkpoints

    @property
    def schedule(self) -> Schedule | None:
        """The schedule the snapshots follow: `online_schedule(steps, checkpoints)` or
        `offline_schedule(steps, checkpoints)`; with `offload`, Revolve's for one segment,
        `offline_schedule(segment, checkpoints)`; `None` in the residuals regime."""
        if self.regime == "residuals":
            return None
        if self.offload is not None:
            return offline_schedule(self.segment, self.checkpoints)
        return (online_schedule if self.online else offline_schedule)(self.steps, self.checkpoints)

    def __str__(self) -> str:
        mib = self.memory_bytes / 2**20
        steps = f"{self.steps} {'max ' if self.online else ''}steps"
        if self.offload is None:
            return (
                f"Plan({self.regime}: {steps}, {self.checkpoints} snapshots, {mib:.3g} MiB, "
                f"{self.forward_steps} forward steps)"
            )
        host_mib = self.host_bytes / 2**20
        return (
            f"Plan({self.regime}, offload={self.offload}: {steps}, {self.checkpoints} device "
            f"snapshots ({mib:.3g} MiB) + {self.host_checkpoints} host snapshots every "
            f"{self.segment} steps ({host_mib:.3g} MiB), {self.forward_steps} forward steps, "
            f"{self.transfers} transfers)"
        )


def plan(
    steps: int,
    snapshot_bytes: int,
    residual_bytes: int | None = None,
    *,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None,
    online: bool = False,
    offload: Offload | None = None,
) -> Plan:
    """Choose the regime and the number of snapshots.

    Rule: with `checkpoints=c`, binomial when `c < steps`, else states. A while loop
    (`online`) with neither argument keeps the fewest `c` with `C(c+2, 2) >= steps` snapshots
    (within the default budget), whatever the sizes. With a budget `B`
    (default `DEFAULT_MEMORY_BUDGET`): residuals if `steps * residual_bytes <= B`, else states
    if `steps * snapshot_bytes <= B`, else binomial with `c = B // snapshot_bytes` (an explicit
    budget must hold one snapshot; the default never goes below `DEFAULT_MIN_CHECKPOINTS`).

    With `offload="host"` (two levels, see `offload_cost`): `checkpoints` and `memory_budget`
    may be dicts with keys `"device"` and `"host"` (slots, or bytes/strings); a plain value is
    the host's. Host: `h` slots (from `checkpoints["host"]`, or the host budget
    `// snapshot_bytes`, default `DEFAULT_HOST_MEMORY_BUDGET`), at most `steps`; snapshots go
    to host memory every `segment = ceil(steps / h)` steps. Device: `c` slots (from
    `checkpoints["device"]`, or the device budget `// snapshot_bytes`, default
    `DEFAULT_MIN_CHECKPOINTS`), at most `segment`, reverse each segment by Revolve. Explicit
    budgets must hold one snapshot on each level.

    **Example:**

    ```python
    >>> from odeckpt.checkpointing.schedules import plan
    >>> print(plan(10_000, snapshot_bytes=2**20, memory_budget="16MiB"))
    Plan(binomial: 10000 steps, 16 snapshots, 16 MiB, 44015 forward steps)
    >>> p = plan(10_000, 2**20, memory_budget={"device": "4MiB", "host": "1GiB"}, offload="host")
    >>> p.checkpoints, p.host_checkpoints, p.segment, p.transfers
    (4, 1000, 10, 2000)

    ```
    """
    if steps < 1:
        raise ValueError(f"need at least one step, got {steps}; max_steps must be >= 1")
    if checkpoints is not None and memory_budget is not None:
        raise ValueError("pass either checkpoints or memory_budget, not both")
    snapshot_bytes = max(int(snapshot_bytes), 1)
    if offload is not None:
        if offload != "host":
            raise ValueError(
                f"offload must be None or 'host', got {offload!r}; pass offload='host' to keep "
                "the snapshots in host memory, or leave it out"
            )
        return _offload_plan(steps, snapshot_bytes, residual_bytes, checkpoints,
                             memory_budget, online)  # fmt: skip
    for name, value in (("checkpoints", checkpoints), ("memory_budget", memory_budget)):
        if isinstance(value, dict):
            raise ValueError(
                f"{name} as a dict {{'device': ..., 'host': ...}} splits snapshots between "
                f"device and host memory and needs offload='host'; pass offload='host', or "
                f"one value for {name}"
            )
    if checkpoints is not None:
        checkpoints = _check_checkpoints(checkpoints, "checkpoints")
        return _snapshots(steps, min(checkpoints, steps), snapshot_bytes, residual_bytes, online)
    assert not isinstance(memory_budget, dict)  # refused above
    explicit = memory_budget is not None
    budget = parse_memory(memory_budget) if explicit else DEFAULT_MEMORY_BUDGET
    if online and not explicit:
        c = _online_default(steps, budget // snapshot_bytes)
        return _snapshots(steps, min(c, steps), snapshot_bytes, residual_bytes, online)
    if residual_bytes is not None and steps * residual_bytes <= budget:
        return Plan(
            "residuals",
            steps,
            online,
            0,
            snapshot_bytes,
            residual_bytes,
            steps * residual_bytes,
            steps,
        )
    c = budget // snapshot_bytes
    if c < 1 and explicit:
        raise ValueError(
            f"memory_budget={memory_budget!r} ({budget} bytes) cannot hold one snapshot of the "
            f"loop state ({snapshot_bytes} bytes); raise memory_budget to at least "
            f"{snapshot_bytes} bytes, or pass checkpoints=1"
        )
    if not explicit:
        c = max(c, DEFAULT_MIN_CHECKPOINTS)
    return _snapshots(steps, min(c, steps), snapshot_bytes, residual_bytes, online)


def _check_checkpoints(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be an int >= 1 (slot 0 holds the initial state), got {value!r}; "
            "use checkpoints=1 for the least memory"
        )
    return value


def _levels(value, name: str) -> dict:
    """`{"device": ..., "host": ...}` (missing levels `None`) from a dict or a plain value."""
    if value is None:
        return dict.fromkeys(_LEVELS)
    if not isinstance(value, dict):
        return {"device": None, "host": value}
    unknown = set(value) - set(_LEVELS)
    if unknown:
        raise ValueError(
            f"{name} takes the keys 'device' and 'host', got {sorted(map(repr, unknown))}; "
            f"e.g. {name}={{'device': ..., 'host': ...}}"
        )
    return {level: value.get(level) for level in _LEVELS}


def _slots(level: str, checkpoints, budget, snapshot_bytes: int, default: int) -> int:
    """Snapshot slots of one memory level from its checkpoints or budget (or the default)."""
    if checkpoints is not None:
        return _check_checkpoints(checkpoints, f"checkpoints[{level!r}]")
    if budget is None:
        return max(default, 1)
    size = parse_memory(budget)
    if size < snapshot_bytes:
        raise ValueError(
            f"memory_budget[{level!r}]={budget!r} ({size} bytes) cannot hold one snapshot of "
            f"the loop state ({snapshot_bytes} bytes); raise it to at least {snapshot_bytes} "
            f"bytes, or pass checkpoints={{{level!r}: 1, ...}}"
        )
    return size // snapshot_bytes


def _offload_plan(steps, snapshot_bytes, residual_bytes, checkpoints, memory_budget, online):
    slots, budgets = _levels(checkpoints, "checkpoints"), _levels(memory_budget, "memory_budget")
    host_default = DEFAULT_HOST_MEMORY_BUDGET // snapshot_bytes
    h = _slots("host", slots["host"], budgets["host"], snapshot_bytes, host_default)
    segment = -(-steps // min(h, steps))
    c = _slots("device", slots["device"], budgets["device"], snapshot_bytes,
               DEFAULT_MIN_CHECKPOINTS)  # fmt: skip
    c = min(c, segment)
    h = host_slots(steps, segment)
    return Plan(
        "states" if c >= segment else "binomial",
        steps,
        online,
        c,
        snapshot_bytes,
        residual_bytes,
        c * snapshot_bytes,
        offload_cost(steps, segment, c),
        offload="host",
        segment=segment,
        host_checkpoints=h,
        host_bytes=max(h, MIN_HOST_SLOTS) * snapshot_bytes,
        transfers=2 * h,
    )


def _online_default(steps: int, affordable: int) -> int:
    """Snapshots for a while loop by default: the fewest `c` with `C(c+2, 2) >= steps`, so
    that the online schedule is optimal (each step recomputed at most twice) for any stop up
    to `steps`, within the default budget. A while loop may stop long before `max_steps`, so
    regimes whose cost grows with `max_steps` itself (storing every step's residuals or state)
    are not defaults there."""
    c = 1
    while binomial(c, 2) < steps:
        c += 1
    return max(min(c, affordable), DEFAULT_MIN_CHECKPOINTS)


def _snapshots(steps, c, snapshot_bytes, residual_bytes, online) -> Plan:
    regime: Regime = "states" if c >= steps else "binomial"
    return Plan(
        regime,
        steps,
        online,
        c,
        snapshot_bytes,
        residual_bytes,
        c * snapshot_bytes,
        optimal_cost(steps, c),
    )
