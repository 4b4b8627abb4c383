"""`bounded_while_loop`: an early-exit while loop, differentiable by online checkpointing."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from . import _tree
from ._custom import convert, run
from ._loop import Loop
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


def _check_body(cond_fun, body_fun, init_val, outputs):
    pred = jax.eval_shape(cond_fun, init_val)
    if jnp.shape(pred) != () or pred.dtype != jnp.bool_:
        raise TypeError(f"cond_fun must return a scalar bool, got {pred}")
    out = jax.eval_shape(body_fun, init_val)
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


def _loop(cond_fun, body_fun, init_val, outputs, max_steps, snapshot):
    """The engine's normal form: a masked step (finished lanes keep `val`, drop writes)."""
    (cond_p, cond_s), (body_p, body_s) = convert(cond_fun, init_val), convert(body_fun, init_val)
    params = (cond_p, body_p)
    codec = {}
    if snapshot is not None:
        pack_fun, unpack_fun = snapshot
        (pack_p, pack_s) = convert(pack_fun, init_val)
        (unpack_p, unpack_s) = convert(unpack_fun, jax.eval_shape(pack_fun, init_val))
        params += (pack_p, unpack_p)
        codec = dict(
            pack=lambda params, val: eqx.combine(params[2], pack_s)(val),
            unpack=lambda params, packed: eqx.combine(params[3], unpack_s)(packed),
        )
    grouped = isinstance(outputs, list)
    if outputs is None:
        lengths = None
    else:
        lengths = [_buffer_length(group) for group in (outputs if grouped else [outputs])]

    def cond(params, val):
        return eqx.combine(params[0], cond_s)(val)

    def step(params, val, x, i):
        del x, i
        active = cond(params, val)
        out = eqx.combine(params[1], body_s)(val)
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
        return _tree.where(active, new, val), idx, values

    return Loop(step, cond, max_steps, **codec), params


def while_loop_plan(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int,
    checkpoints: int | None = None, memory_budget: int | str | None = None, outputs: Any = None,
    online: bool = True, snapshot: tuple[Callable, Callable] | None = None,
) -> Plan:  # fmt: skip
    """The `Plan` that `bounded_while_loop` with the same arguments follows.

    **Example:**

    ```python
    >>> body = lambda v: (v[0] * 1.1, v[1] + 1.0)
    >>> cond = lambda v: v[1] < 10.0
    >>> p = while_loop_plan(cond, body, (1.0, 0.0), max_steps=100, checkpoints=3)
    >>> p.regime, p.checkpoints, p.online
    ('binomial', 3, True)

    ```
    """
    max_steps = _check_max_steps(max_steps)
    init_val = _tree.strong(init_val)
    _check_body(cond_fun, body_fun, init_val, outputs)
    _check_snapshot(snapshot, init_val)
    loop, params = _loop(cond_fun, body_fun, init_val, outputs, max_steps, snapshot)
    return _plan(loop, params, init_val, checkpoints, memory_budget, online)


def _check_snapshot(snapshot, init_val):
    fix = (
        "snapshot=(pack, unpack) takes two functions: pack(val) returns what a snapshot "
        "keeps, unpack(packed) rebuilds val from it"
    )
    if snapshot is None:
        return
    if not (isinstance(snapshot, tuple) and len(snapshot) == 2 and all(map(callable, snapshot))):
        raise TypeError(f"{fix}; got {snapshot!r}")
    pack_fun, unpack_fun = snapshot
    rebuilt = jax.eval_shape(lambda v: unpack_fun(pack_fun(v)), init_val)
    _tree.check_same_structure("unpack(pack(val))", init_val, rebuilt, fix)


def _plan(loop, params, init_val, checkpoints, memory_budget, online) -> Plan:
    residual_bytes = None
    if checkpoints is None and (memory_budget is not None or not online):
        # only then may the plan store every step's residuals: size them
        step = lambda p, v: loop.step(p, v, None, None)[0::2]
        residuals = jax.eval_shape(
            lambda p, v: jtu.tree_leaves(jax.vjp(step, p, v)[1]), params, init_val
        )
        residual_bytes = _tree.nbytes(residuals)
    snapshot = jax.eval_shape(loop.packed, params, init_val)
    return plan(loop.steps, _tree.nbytes(snapshot), residual_bytes,
                checkpoints=checkpoints, memory_budget=memory_budget, online=online)  # fmt: skip


def bounded_while_loop(
    cond_fun: Callable, body_fun: Callable, init_val: Any, *, max_steps: int,
    checkpoints: int | None = None, memory_budget: int | str | None = None, outputs: Any = None,
    online: bool = True, snapshot: tuple[Callable, Callable] | None = None,
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
    - `online`: `False` when the loop is known to run (about) `max_steps` steps, e.g. a
        fixed-step solve whose step count is computed in advance: then the offline Revolve
        schedule for `max_steps` steps is used, which is optimal when the loop runs them all.
    - `snapshot`: optional `(pack, unpack)`: a snapshot keeps `pack(val)` instead of `val`,
        and the reverse sweep rebuilds `val = unpack(packed)` at each restore. `unpack` must
        rebuild exactly the `val` that was packed, bitwise if the loop's control flow depends
        on it (a value that differs by rounding can change the replayed steps' decisions):
        use it to leave out of the snapshots what is cheap to recompute from the rest,
        trading one `unpack` per reversed step for memory.
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

    ```

    **References:** Stumm & Walther (2010), "New algorithms for optimal online
    checkpointing", SIAM J. Sci. Comput. 32(2); Wang, Moin & Iaccarino (2009), "Minimal
    repetition dynamic checkpointing algorithm for unsteady adjoint calculation", SIAM J. Sci.
    Comput. 31(4).
    """
    max_steps = _check_max_steps(max_steps)
    init_val = _tree.strong(init_val)
    _check_body(cond_fun, body_fun, init_val, outputs)
    _check_snapshot(snapshot, init_val)
    # Checks `checkpoints`/`memory_budget` now; the real plan (which traces the step's VJP to
    # size its residuals) is only made if the loop is differentiated.
    snapshot_val = init_val if snapshot is None else jax.eval_shape(snapshot[0], init_val)
    plan(max_steps, _tree.nbytes(snapshot_val), None, checkpoints=checkpoints,
         memory_budget=memory_budget, online=online)  # fmt: skip
    loop, params = _loop(cond_fun, body_fun, init_val, outputs, max_steps, snapshot)
    the_plan = lambda: _plan(loop, params, init_val, checkpoints, memory_budget, online)
    val, buffers = run(loop, the_plan, params, init_val, None, outputs)
    return val if outputs is None else (val, buffers)
