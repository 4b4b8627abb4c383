"""`bounded_while_loop`: an early-exit while loop, differentiable by online checkpointing."""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _host, _tree
from ._custom import convert, run
from ._loop import Loop
from ._vmap import lane_running
from .schedules import Plan, plan

_WRITE_FIX = (
    "with outputs=buffers, body_fun must return (val, (index, values)): index an int32 array "
    "of shape [k] (k >= 1), values a pytree like outputs whose leaves have shape "
    "[k, *leaf.shape[1:]]; with outputs=[group, ...] (a list of buffer groups), it returns "
    "(val, [(index, values), ...]) with one write per group"
)


def _check_max_steps(max_steps) -> int:
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(
            f"max_steps must be a Python int >= 1 (a static bound on the number of steps), "
            f"got {max_steps!r}; pass e.g. max_steps=4096"
        )
    return max_steps


def _buffer_length(outputs) -> int:
    leaves = jtu.tree_leaves(outputs)
    lengths = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if not leaves or len(lengths) != 1 or None in lengths:
        raise ValueError(
            "outputs must be a pytree of arrays sharing one leading axis (the buffer length m); "
            f"got leading axes {sorted(map(str, lengths))}"
        )
    return int(lengths.pop())


_DECISIONS_FIX = (
    "with record_decisions=True, body_fun(val, recorded) returns (val, made) (with outputs: "
    "(val, writes, made)): `made` a pytree of arrays recording the step's decisions, "
    "`recorded` None on the first run and the recorded `made` on a recomputation"
)


def _check_record(record_decisions):
    if not isinstance(record_decisions, bool):
        raise TypeError(
            f"record_decisions must be True or False, got {record_decisions!r}; pass "
            "record_decisions=True to record each step's decisions for the reverse sweep"
        )


def _first_body(body_fun, record_decisions):
    """The body of the forward run: a recording body is called with `recorded=None`."""
    return (lambda val: body_fun(val, None)) if record_decisions else body_fun


def _check_body(pred, out, init_val, outputs, record_decisions):
    """Check `cond_fun`'s and the first body's output structures (`pred`, `out`); return
    `out` without the recorded decisions."""
    if jnp.shape(pred) != () or pred.dtype != jnp.bool_:
        raise TypeError(f"cond_fun must return a scalar bool, got {pred}")
    if record_decisions:
        size = 2 if outputs is None else 3
        if not (isinstance(out, tuple) and len(out) == size):
            raise TypeError(f"{_DECISIONS_FIX}; got {out}")
        out = out[0] if outputs is None else out[:2]
    fix = "return a val with the same structure, shapes and dtypes as init_val"
    if outputs is None:
        _tree.check_same_structure("body_fun", init_val, out, fix)
        return
    grouped = isinstance(outputs, list)
    if not (
        isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list if grouped else tuple)
    ):
        raise TypeError(f"{_WRITE_FIX}; got {out}")
    val, writes = out
    _tree.check_same_structure("body_fun", init_val, val, fix)
    writes, groups = (writes, outputs) if grouped else ([writes], [outputs])
    if len(writes) != len(groups):
        raise TypeError(f"{_WRITE_FIX}; got {len(writes)} writes for {len(groups)} groups")
    for write, group in zip(writes, groups, strict=True):
        _check_write(write, group)


def _check_write(write, outputs):
    if not isinstance(write, tuple) or len(write) != 2:
        raise TypeError(f"{_WRITE_FIX}; got {write}")
    idx, values = write
    if jnp.ndim(idx) != 1 or not jnp.issubdtype(idx.dtype, jnp.integer) or idx.shape[0] < 1:
        raise TypeError(f"{_WRITE_FIX}; got index {idx}")
    k = idx.shape[0]
    expected = jtu.tree_map(
        lambda b: jax.ShapeDtypeStruct((k, *jnp.shape(b)[1:]), b.dtype), outputs
    )
    try:
        _tree.check_same_structure("the written values", expected, values, _WRITE_FIX)
    except TypeError as e:
        raise TypeError(f"{e} (k = {k})") from None


def _loop(cond_fun, body_fun, init_val, outputs, max_steps, snapshot, record_decisions):
    """The engine's normal form: a masked step (finished lanes keep `val`, drop writes).

    Traces `cond_fun` once and `body_fun` once (twice when recording: the replay takes an
    array `recorded`), and checks what they return."""
    (cond_p, cond_s) = convert(cond_fun, init_val)
    (body_p, body_s) = convert(_first_body(body_fun, record_decisions), init_val)
    first_out = eqx.combine(body_p, body_s).out_struct
    pred = eqx.combine(cond_p, cond_s).out_struct
    _check_body(pred, first_out, init_val, outputs, record_decisions)
    params = dict(cond=cond_p, body=body_p)
    codec, decisions = {}, None
    if snapshot is not None:
        pack_fun, unpack_fun = snapshot
        (params["pack"], pack_s) = convert(pack_fun, init_val)
        (params["unpack"], unpack_s) = convert(unpack_fun, jax.eval_shape(pack_fun, init_val))
        codec = dict(
            pack=lambda params, val: eqx.combine(params["pack"], pack_s)(val),
            unpack=lambda params, packed: eqx.combine(params["unpack"], unpack_s)(packed),
        )
    if record_decisions:
        decisions = first_out[-1]
        # The replay is traced separately: `recorded` is an array there, `None` in `first`.
        example = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), decisions)
        (params["replay"], replay_s) = convert(body_fun, init_val, example)
        replay_out = eqx.combine(params["replay"], replay_s).out_struct
        _tree.check_same_structure("body_fun(val, recorded)", first_out, replay_out, _DECISIONS_FIX)
    grouped = isinstance(outputs, list)
    if outputs is None:
        lengths = None
    else:
        lengths = [_buffer_length(group) for group in (outputs if grouped else [outputs])]

    def cond(params, val):
        return eqx.combine(params["cond"], cond_s)(val)

    def step(params, val, x, i, recorded=None):
        del x, i
        active = lane_running(cond(params, val))
        if recorded is None:
            out = eqx.combine(params["body"], body_s)(val)
        else:
            out = eqx.combine(params["replay"], replay_s)(val, recorded)
        made = None
        if record_decisions:
            *out, made = out
            out = out[0] if outputs is None else tuple(out)
        if outputs is None:
            new, idx, values = out, jnp.zeros((1,), jnp.int32), None
        else:
            new, writes = out
            idx, values = zip(*writes, strict=True) if grouped else ([writes[0]], [writes[1]])
            idx = tuple(
                jnp.where(active, jnp.asarray(i, jnp.int32), m)
                for i, m in zip(idx, lengths, strict=True)
            )
            # one group: the buffers themselves; groups: a list of them
            idx, values = (idx, list(values)) if grouped else (idx[0], values[0])
        return _tree.where(active, new, val), idx, values, made

    return Loop(step, cond, max_steps, **codec, decisions=decisions), params


def while_loop_plan(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None, outputs: Any = None,
    online: bool = True, snapshot: tuple[Callable, Callable] | None = None,
    record_decisions: bool = False, offload: Literal["host"] | None = None,
) -> Plan:  # fmt: skip
    """The `Plan` that `bounded_while_loop` with the same arguments follows.

    **Example:**

    ```python
    >>> body = lambda v: (v[0] * 1.1, v[1] + 1.0)
    >>> cond = lambda v: v[1] < 10.0
    >>> p = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, checkpoints=3)
    >>> p.regime, p.checkpoints, p.online
    ('binomial', 3, True)
    >>> p = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, offload="host",
    ...                     checkpoints={"device": 2, "host": 10})
    >>> p.checkpoints, p.host_checkpoints, p.segment
    (2, 10, 10)

    ```
    """
    kwargs = dict(
        max_steps=max_steps, checkpoints=checkpoints, memory_budget=memory_budget,
        outputs=outputs, online=online, snapshot=snapshot, record_decisions=record_decisions,
        offload=offload,
    )  # fmt: skip
    return checked_plan(cond_fun, body_fun, init_val, kwargs, check=True)


def checked_plan(cond_fun, body_fun, init_val, kwargs: dict, *, check: bool) -> Plan:
    """`while_loop_plan(cond_fun, body_fun, init_val, **kwargs)`; with `check=False` the
    functions are traced only if the plan must size the step's residuals (for a loop that
    `bounded_while_loop` has already checked)."""
    max_steps = _check_max_steps(kwargs["max_steps"])
    record_decisions = kwargs.get("record_decisions", False)
    outputs, snapshot = kwargs.get("outputs"), kwargs.get("snapshot")
    _check_record(record_decisions)
    init_val = _tree.strong(init_val)
    packed = _check_snapshot(snapshot, init_val)
    budget = dict(checkpoints=kwargs.get("checkpoints"), memory_budget=kwargs.get("memory_budget"),
                  online=kwargs.get("online", True), offload=kwargs.get("offload"))  # fmt: skip
    if budget["offload"] is not None:
        _host.check_host_memory("while_loop_plan")
    if _sizes_residuals(**budget):
        loop, params = _loop(
            cond_fun, body_fun, init_val, outputs, max_steps, snapshot, record_decisions
        )
        return _plan(loop, params, init_val, packed, **budget)
    if check:  # the plan needs no trace of the step: only check what the functions return
        pred = jax.eval_shape(cond_fun, init_val)
        out = jax.eval_shape(_first_body(body_fun, record_decisions), init_val)
        _check_body(pred, out, init_val, outputs, record_decisions)
    return plan(max_steps, _tree.nbytes(packed), None, **budget)


def _check_snapshot(snapshot, init_val):
    """Check `snapshot`; return the structure a snapshot holds (`init_val`'s without one)."""
    fix = (
        "snapshot=(pack, unpack) takes two functions: pack(val) returns what a snapshot "
        "keeps, unpack(packed) rebuilds val from it"
    )
    if snapshot is None:
        return init_val
    if not (isinstance(snapshot, tuple) and len(snapshot) == 2 and all(map(callable, snapshot))):
        raise TypeError(f"{fix}; got {snapshot!r}")
    pack_fun, unpack_fun = snapshot
    packed = jax.eval_shape(pack_fun, init_val)
    rebuilt = jax.eval_shape(unpack_fun, packed)
    _tree.check_same_structure("unpack(pack(val))", init_val, rebuilt, fix)
    return packed


def _sizes_residuals(*, checkpoints, memory_budget, online, offload) -> bool:
    """Whether the plan may store every step's residuals, and so must know their size."""
    return offload is None and checkpoints is None and (memory_budget is not None or not online)


def _plan(loop, params, init_val, packed, **budget) -> Plan:
    """The plan for the budget (`checkpoints`, `memory_budget`, `online`, `offload`), sizing
    the step's residuals if it may store them."""
    residual_bytes = None
    if _sizes_residuals(**budget):
        step = lambda p, v: (lambda new, _, values, __: (new, values))(*loop.step(p, v, None, None))
        residuals = jax.eval_shape(
            lambda p, v: jtu.tree_leaves(jax.vjp(step, p, v)[1]), params, init_val
        )
        residual_bytes = _tree.nbytes(residuals)
    return plan(loop.steps, _tree.nbytes(packed), residual_bytes, **budget)


def bounded_while_loop(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None, outputs: Any = None,
    online: bool = True, snapshot: tuple[Callable, Callable] | None = None,
    record_decisions: bool = False, offload: Literal["host"] | None = None,
) -> Any:  # fmt: skip
    """A while loop that stops early, reverse-mode differentiable by online checkpointing.

    Runs `val = body_fun(val)` while `cond_fun(val)`, at most `max_steps` times (then returns
    the state reached: check `cond_fun` on it to detect that). Snapshots hold `val` only (or
    what `snapshot` packs of it).

    **Arguments:**

    - `cond_fun(val) -> bool`, `body_fun`, `init_val`: as `lax.while_loop`.
    - `max_steps`: static bound `>= 1`.
    - `checkpoints`, `memory_budget`: as `checkpointed_scan`; the schedule is online (the
        number of steps is only known when the loop stops).
    - `offload`: `"host"`: snapshots every `segment` steps in host memory, each segment
        reversed on the device by Revolve (as `checkpointed_scan`; the two-level schedule is
        the same whether or not the loop stops early, and its cost at every stop is
        `schedules.offload_cost`).
    - `online`: `False` when the loop is known to run (about) `max_steps` steps, e.g. a
        fixed-step solve whose step count is computed in advance: then the offline Revolve
        schedule for `max_steps` steps is used, which is optimal when the loop runs them all.
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
        Recorded values are constants to differentiation. The record costs `max_steps` copies
        of `made`, kept outside the snapshots.
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

    ```

    **References:** Stumm & Walther (2010), "New algorithms for optimal online
    checkpointing", SIAM J. Sci. Comput. 32(2); Wang, Moin & Iaccarino (2009), "Minimal
    repetition dynamic checkpointing algorithm for unsteady adjoint calculation", SIAM J. Sci.
    Comput. 31(4).
    """
    max_steps = _check_max_steps(max_steps)
    _check_record(record_decisions)
    init_val = _tree.strong(init_val)
    packed = _check_snapshot(snapshot, init_val)
    # Checks `checkpoints`/`memory_budget` now; the real plan (which traces the step's VJP to
    # size its residuals) is only made if the loop is differentiated.
    plan(max_steps, _tree.nbytes(packed), None, checkpoints=checkpoints,
         memory_budget=memory_budget, online=online, offload=offload)  # fmt: skip
    if offload is not None:
        _host.check_host_memory("bounded_while_loop")
    loop, params = _loop(
        cond_fun, body_fun, init_val, outputs, max_steps, snapshot, record_decisions
    )
    budget = dict(
        checkpoints=checkpoints, memory_budget=memory_budget, online=online, offload=offload
    )
    the_plan = lambda: _plan(loop, params, init_val, packed, **budget)
    val, buffers = run(loop, the_plan, params, init_val, None, outputs)
    return val if outputs is None else (val, buffers)
