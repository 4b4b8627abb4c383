"""`bounded_while_loop`: an early-exit while loop, differentiable by online checkpointing."""

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.tree_util as jtu

from .._autodiff import _tree, on_mesh_of_inputs
from . import _host, schedules
from ._loop import EngineLoop, LoopInputs
from ._regimes import check_plan, run
from ._while_body import (
    check_max_steps,
    check_record,
    check_snapshot,
    engine_loop,
)
from .schedules import Plan


class _Budget(NamedTuple):
    """What a while loop's `Plan` is made from besides the loop: the arguments of
    `schedules.plan` that `bounded_while_loop` and `while_loop_plan` take."""

    checkpoints: int | dict[str, int] | None
    memory_budget: int | str | dict[str, int | str] | None
    online: bool
    offload: Literal["host"] | None

    @property
    def sizes_residuals(self) -> bool:
        """Whether the plan may store every step's residuals, and so must know their size."""
        offline = self.memory_budget is not None or not self.online
        return self.offload is None and self.checkpoints is None and offline

    def plan(self, steps: int, snapshot_bytes: int, residual_bytes: int | None = None) -> Plan:
        return schedules.plan(steps, snapshot_bytes, residual_bytes, **self._asdict())


def while_loop_plan(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None, outputs: Any = None,
    online: bool = True, snapshot: tuple[Callable, Callable] | None = None,
    record_decisions: bool | int = False, offload: Literal["host"] | None = None,
) -> Plan:  # fmt: skip
    """The `Plan` that `bounded_while_loop` with the same arguments follows.

    Pass it to `bounded_while_loop(cond_fun, body_fun, init_val, plan=...)` (with the same
    `outputs`, `snapshot` and `record_decisions`) to plan once. The functions are traced only
    when the plan may store every step's residuals, to size them (with `memory_budget`, or
    `online=False` without `checkpoints`); `bounded_while_loop` checks what they return.

    **Arguments:**

    - `cond_fun`, `body_fun`, `init_val`, `max_steps`: as `bounded_while_loop` (`max_steps`:
        static bound `>= 1`, the number of positions the schedule covers).
    - `checkpoints`, `memory_budget`, `online`, `offload`: the budget, as
        `bounded_while_loop`. With `offload="host"`, raises a `ValueError` on a backend
        without host memory.
    - `outputs`, `snapshot`, `record_decisions`: as `bounded_while_loop`: `snapshot` sets
        what one snapshot holds (and so its bytes), `record_decisions` and `outputs` what
        `body_fun` returns.

    **Returns:**

    A `Plan` with `steps = max_steps` and `online` as given: the regime, the number of
    snapshots, the predicted memory and forward steps at `max_steps`, and with `offload` the
    host level (`segment`, `host_checkpoints`, `transfers`).

    **Example:**

    ```python
    >>> from odeckpt.checkpointing import while_loop_plan
    >>> body = lambda v: (v[0] * 1.1, v[1] + 1.0)
    >>> cond = lambda v: v[1] < 10.0
    >>> p = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, checkpoints=3)
    >>> p.regime, p.checkpoints, p.online
    ('binomial', 3, True)
    >>> p = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, offload="host",
    ...                     checkpoints={"device": 2, "host": 10})
    >>> p.checkpoints, p.host_checkpoints, p.segment, p.slots
    (2, 10, 10, 12)

    ```
    """
    max_steps = check_max_steps(max_steps)
    init_val, snapshot_bytes = _checked_init(init_val, snapshot, record_decisions)
    budget = _Budget(checkpoints, memory_budget, online, offload)
    if offload is not None:
        _host.check_host_memory("while_loop_plan")
    if not budget.sizes_residuals:
        return budget.plan(max_steps, snapshot_bytes)
    loop, params = engine_loop(
        cond_fun, body_fun, init_val, outputs, max_steps, snapshot, record_decisions
    )
    return _sized_plan(loop, params, init_val, snapshot_bytes, budget)


def _checked_init(init_val, snapshot, record_decisions) -> tuple[Any, int]:
    """`init_val` with strong dtypes and the bytes a snapshot of it holds, once `snapshot` and
    `record_decisions` are checked."""
    check_record(record_decisions)
    init_val = _tree.strong(init_val)
    return init_val, _tree.nbytes(check_snapshot(snapshot, init_val))


def _sized_plan(loop: EngineLoop, params, init_val, snapshot_bytes: int, budget: _Budget) -> Plan:
    """The plan for `budget`, with the size of the step's VJP residuals (for a budget that may
    store them)."""

    def step(params, val):
        stepped = loop.step(params, val, None, None)
        return stepped.state, stepped.values

    vjp_residuals = lambda params, val: jtu.tree_leaves(jax.vjp(step, params, val)[1])
    residual_bytes = _tree.nbytes(jax.eval_shape(vjp_residuals, params, init_val))
    return budget.plan(loop.steps, snapshot_bytes, residual_bytes)


@on_mesh_of_inputs
def bounded_while_loop(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int | None = None,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None, outputs: Any = None,
    online: bool | None = None, snapshot: tuple[Callable, Callable] | None = None,
    record_decisions: bool | int = False, offload: Literal["host"] | None = None,
    plan: Plan | None = None, throw: bool = False, pack_state: bool = False,
    progress: tuple[Callable, Callable] | None = None,
) -> Any:  # fmt: skip
    """A while loop that stops early, reverse-mode differentiable by online checkpointing.

    Runs `val = body_fun(val)` while `cond_fun(val)`, at most `max_steps` times (then returns
    the state reached: check `cond_fun` on it to detect that). Snapshots hold `val` only (or
    what `snapshot` packs of it).

    **Arguments:**

    - `cond_fun(val) -> bool`, `body_fun`, `init_val`: as `lax.while_loop`.
    - `max_steps`: static bound `>= 1`.
    - `plan`: a `Plan` made by `while_loop_plan` with the same functions, `init_val` and
        options, instead of `max_steps` and the budget (`checkpoints`, `memory_budget`,
        `online`, `offload`): plan once, then run and read what the plan says (`Plan.slots`,
        `recomputed_steps`). Raises if both are given, or if the plan's snapshots have
        another size than this loop's.
    - `checkpoints`, `memory_budget`: as `checkpointed_scan`; the schedule is online (the
        number of steps is only known when the loop stops).
    - `offload`: `"host"`: snapshots every `segment` steps in host memory, each segment
        reversed on the device by Revolve (as `checkpointed_scan`; the two-level schedule is
        the same whether or not the loop stops early, and its cost at every stop is
        `schedules.offload_cost`).
    - `online`: `False` when the loop is known to run (about) `max_steps` steps, e.g. a
        fixed-step solve whose step count is computed in advance: then the offline Revolve
        schedule for `max_steps` steps is used, which is optimal when the loop runs them all.
        Default `True`.
    - `snapshot`: optional `(pack, unpack)`: a snapshot keeps `pack(val)` instead of `val`,
        and the reverse sweep rebuilds `val = unpack(packed)` at each restore. `unpack` must
        rebuild the `val` that was packed; if it differs by rounding and the loop's control
        flow depends on it, use `record_decisions`. Use it to leave out of the snapshots what
        is cheap to recompute from the rest, trading one `unpack` per restore for memory.
    - `record_decisions`: the reverse sweep recomputes steps from snapshots, and XLA compiles
        those recomputations separately from the forward loop, so they may round differently;
        a threshold test in `body_fun` (`error <= 1`, `t + dt >= t_end`) can then flip and the
        recomputation leave the forward trajectory. With `True`, `body_fun(val, recorded)`
        also returns a record of its decisions, `(val, made)` (`(val, (index, values), made)`
        with `outputs`), `made` a pytree of arrays: branch choices, and values the gradient
        treats as fixed (an adaptive step size); `recorded` is `None` on the forward run and
        the `made` of that run when the step is recomputed, and the body must then follow it.
        Recorded values are constants to differentiation. The record keeps the first
        `2**20` steps' `made` (an int: that many steps), outside the snapshots, so its memory
        does not grow with `max_steps`. A step past them is recomputed with `recorded=None`
        and decides afresh, so it may round its way to other decisions. The reverse sweep
        then checks that each step it reverses ends where the next one began (`val` equal up
        to rounding: leaves that are not inexact exactly, inexact ones element by element to
        `sqrt(eps)` where their cotangent is not zero), and where one does not, the
        cotangents are NaN (per lane under `vmap`) instead of the derivative of another
        trajectory. The check sees `val` only: a
        decision that changes nothing but the step's writes to `outputs` must leave a trace
        in `val` (a count of the branches taken, say) to be seen.
    - `throw`: with `True`, a recomputation past the record that decides otherwise also
        raises when the gradient is evaluated (through a host callback, or after the call under
        `odeckpt.jit`).
    - `pack_state`: with `True`, the differentiated run carries `val` packed into one vector per
        dtype: fewer copies, stores and restores per step (XLA runs one kernel per array it
        moves), which pays for a state of many small leaves. The values are the same; under
        `vmap`, leaves of one dtype are batched together, so a leaf `vmap` would leave
        unbatched comes out batched.
    - `progress`: optional `(milestone, report)`, to follow the loop from the host at a cost
        per step of computing `milestone`: `milestone(val)` returns an int32 scalar (a
        percentage, say) and `report(val)` makes a host callback
        (`jax.experimental.io_callback`) that returns the int32 milestone at which to report
        next (`milestone + 1` to hear of every change, more to hear less often). The loop
        calls `report` once before the first step, then runs in stretches until `milestone`
        reaches the target the last report returned, calling `report` after each (also
        after a stretch that a host-offload segment cut short, where `milestone` is still
        below the target: return the same target there); the values computed are the same.
        A gradient that stores every step's residuals (a `lax.scan`) reports only before
        its first step and after its last; a reverse sweep never reports. Under `vmap` a
        stretch goes on while any lane's `milestone` is below the target, and `report` sees
        every lane's `val` (reduce the lanes to one value, with
        `jax.custom_batching.custom_vmap`, to keep one callback per report).
    - `outputs`: optional pytree of buffers (leading axis `m`). Then `body_fun(val)` returns
        `(val, (index, values))`: `index` int32 `[k]`, `values` like `outputs` with leaves
        `[k, *leaf.shape[1:]]`; entry `j` goes to `buffer[index[j]]`, out-of-range indices are
        dropped, indices within one write must be distinct. Buffers are written once per step,
        never snapshotted, and differentiable (each slot's cotangent flows to the step that
        wrote it last; unwritten slots to the initial buffers). Buffers of different lengths
        go in separate groups: `outputs=[group_1, group_2, ...]` (a Python list), each group a
        pytree of buffers sharing one length, and `body_fun` returns
        `(val, [(index_1, values_1), (index_2, values_2), ...])`.

    **Returns:** the final `val`, or `(val, outputs)` with `outputs` given. Differentiable in
    reverse mode (online checkpointing, or stored residuals when they fit the budget) and in
    forward mode (`jax.jvp`, a forward-mode loop).

    Under `vmap` with a batched predicate the loop runs in lockstep while any lane runs
    (`any_lane`); finished lanes keep their `val` and drop their writes; the step counter and
    the schedule stay unbatched.

    **Example:**

    ```python
    >>> import jax
    >>> from odeckpt.checkpointing import bounded_while_loop, while_loop_plan
    >>> def solve(rate):  # y <- (1 + rate) y until t = 10
    ...     body = lambda v: (v[0] + rate * v[0], v[1] + 1.0)
    ...     cond = lambda v: v[1] < 10.0
    ...     return bounded_while_loop(cond, body, (1.0, 0.0), max_steps=100, checkpoints=3)[0]
    >>> round(float(jax.grad(solve)(0.1)), 4)  # 10 * 1.1**9
    23.5795
    >>> def solve_offloaded(rate):  # host snapshots every 4 steps, 2 device slots
    ...     body = lambda v: (v[0] + rate * v[0], v[1] + 1.0)
    ...     cond = lambda v: v[1] < 10.0
    ...     return bounded_while_loop(cond, body, (1.0, 0.0), max_steps=100, offload="host",
    ...                               checkpoints={"device": 2, "host": 25})[0]
    >>> round(float(jax.grad(solve_offloaded)(0.1)), 4)
    23.5795
    >>> from odeckpt.checkpointing import recomputed_steps
    >>> body = lambda v: (v[0] * 1.1, v[1] + 1.0)
    >>> cond = lambda v: v[1] < 10.0
    >>> plan = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, checkpoints=3)
    >>> y, t = bounded_while_loop(cond, body, (1.0, 0.0), plan=plan)  # planned once
    >>> plan.slots, int(recomputed_steps(plan, 10))  # slots and recomputations at the stop
    (3, 6)

    ```

    **References:** Stumm & Walther (2010), "New algorithms for optimal online
    checkpointing", SIAM J. Sci. Comput. 32(2); Wang, Moin & Iaccarino (2009), "Minimal
    repetition dynamic checkpointing algorithm for unsteady adjoint calculation", SIAM J. Sci.
    Comput. 31(4).
    """
    budget = _Budget(checkpoints, memory_budget, True if online is None else online, offload)
    if plan is None and max_steps is None:
        raise ValueError(
            "bounded_while_loop needs max_steps (a static bound on the number of steps, e.g. "
            "max_steps=4096) or plan=while_loop_plan(...)"
        )
    if plan is None:
        max_steps = check_max_steps(max_steps)
    if not isinstance(throw, bool):
        raise TypeError(
            f"throw must be True or False, got {throw!r}; pass throw=True to raise when a "
            "recomputation past the recorded decisions leaves the forward trajectory"
        )
    init_val, snapshot_bytes = _checked_init(init_val, snapshot, record_decisions)
    if plan is None:
        # Checks the budget now; a plan that may store the step's residuals is only made (it
        # traces the step's VJP to size them) if the loop is differentiated.
        assert max_steps is not None  # checked above
        unsized = budget.plan(max_steps, snapshot_bytes)
    else:
        check_plan(plan, "bounded_while_loop", "while_loop_plan", snapshot_bytes,
                   max_steps=max_steps, checkpoints=checkpoints, memory_budget=memory_budget,
                   online=online, offload=offload)  # fmt: skip
        max_steps = plan.steps
    if (budget if plan is None else plan).offload is not None:
        _host.check_host_memory("bounded_while_loop")
    loop, params = engine_loop(
        cond_fun, body_fun, init_val, outputs, max_steps, snapshot, record_decisions, progress
    )
    if not isinstance(pack_state, bool):
        raise TypeError(f"pack_state={pack_state!r} must be True or False. Fix: pass a bool.")
    loop = dataclasses.replace(loop, throw=throw, pack_state=pack_state)
    if plan is not None:
        make_plan = lambda: plan
    elif budget.sizes_residuals:
        make_plan = lambda: _sized_plan(loop, params, init_val, snapshot_bytes, budget)
    else:  # `plan is None`: `unsized` is bound (pyright does not follow the two conditions)
        make_plan = lambda: unsized  # pyright: ignore[reportPossiblyUnboundVariable]
    val, buffers = run(loop, make_plan, LoopInputs(params, init_val, None, outputs))
    return val if outputs is None else (val, buffers)
