"""A `bounded_while_loop`'s functions in the engine's normal form (`EngineLoop`), and the checks
of what they and its other arguments are."""

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._autodiff import _tree, convert
from ._loop import RECORDED_STEPS, EngineLoop, Progress, Stepped
from ._vmap import lane_running

_WRITE_FIX = (
    "with outputs=buffers, body_fun must return (val, (index, values)): index an int32 array "
    "of shape [k] (k >= 1), values a pytree like outputs whose leaves have shape "
    "[k, *leaf.shape[1:]]; with outputs=[group, ...] (a list of buffer groups), it returns "
    "(val, [(index, values), ...]) with one write per group"
)
_DECISIONS_FIX = (
    "with record_decisions=True, body_fun(val, recorded) returns (val, made) (with outputs: "
    "(val, writes, made)): `made` a pytree of arrays recording the step's decisions, "
    "`recorded` None on the first run and the recorded `made` on a recomputation"
)


def check_max_steps(max_steps) -> int:
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(
            f"max_steps must be a Python int >= 1 (a static bound on the number of steps), "
            f"got {max_steps!r}; pass e.g. max_steps=4096"
        )
    return max_steps


def check_record(record_decisions) -> int:
    """The number of leading steps whose decisions are recorded (0: none)."""
    if isinstance(record_decisions, bool | np.bool_):
        return RECORDED_STEPS if record_decisions else 0
    if isinstance(record_decisions, int | np.integer) and record_decisions >= 1:
        return int(record_decisions)
    raise TypeError(
        f"record_decisions must be True, False or an int >= 1, got {record_decisions!r}; pass "
        "record_decisions=True to record each step's decisions for the reverse sweep"
    )


def check_snapshot(snapshot, init_val):
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


def _first_args(record_decisions: bool) -> tuple:
    """The arguments after `val` of the forward run of `body_fun`: `recorded=None` if it
    records its decisions."""
    return (None,) if record_decisions else ()


def _check_body(pred, out, init_val, outputs, record_decisions):
    """Check `cond_fun`'s and the first body's output structures (`pred`, `out`)."""
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


def _buffer_length(outputs) -> int:
    leaves = jtu.tree_leaves(outputs)
    lengths = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if not leaves or len(lengths) != 1 or None in lengths:
        raise ValueError(
            "outputs must be a pytree of arrays sharing one leading axis (the buffer length m); "
            f"got leading axes {sorted(map(str, lengths))}"
        )
    length = lengths.pop()
    assert length is not None  # refused above
    return int(length)


class LoopParams(NamedTuple):
    """The arrays a `bounded_while_loop`'s closure-converted functions close over (`None` for
    a function it does not have): they cross the custom JVP as the loop's `params`."""

    body: Any
    cond: Any
    pack: Any
    replay: Any
    unpack: Any
    milestone: Any = None
    report: Any = None


def _check_progress(progress) -> None:
    if progress is not None and not (
        isinstance(progress, tuple) and len(progress) == 2 and all(map(callable, progress))
    ):
        raise TypeError(
            "progress=(milestone, report) takes two functions: milestone(val) returns an int32 "
            "scalar, report(val) the int32 milestone at which to report next; got "
            f"{progress!r}"
        )


def engine_loop(
    cond_fun, body_fun, init_val, outputs, max_steps: int, snapshot,
    record_decisions: bool | int, progress=None,
) -> tuple[EngineLoop, LoopParams]:  # fmt: skip
    """The loop in the engine's normal form: a masked step (finished lanes keep `val`, drop
    writes), and the arrays its functions close over; with `progress = (milestone, report)`
    (`bounded_while_loop`), it reports as `_loop.Progress` says.

    Traces `cond_fun` once and `body_fun` once (twice when recording: the replay takes an
    array `recorded`), and checks what they return."""
    recorded_steps = check_record(record_decisions)
    record_decisions = recorded_steps > 0
    first = _first_args(record_decisions)
    cond_p, cond_s = convert(cond_fun, init_val)
    body_p, body_s = convert(body_fun, init_val, *first)
    first_out = eqx.combine(body_p, body_s).out_struct
    pred = eqx.combine(cond_p, cond_s).out_struct
    _check_body(pred, first_out, init_val, outputs, record_decisions)
    params = LoopParams(body_p, cond_p, None, None, None)
    pack = unpack = replay = decisions = None
    if snapshot is not None:
        (pack_p, pack_s) = convert(snapshot[0], init_val)
        (unpack_p, unpack_s) = convert(snapshot[1], jax.eval_shape(snapshot[0], init_val))
        params = params._replace(pack=pack_p, unpack=unpack_p)
        pack = lambda params, val: eqx.combine(params.pack, pack_s)(val)
        unpack = lambda params, packed: eqx.combine(params.unpack, unpack_s)(packed)
    if record_decisions:
        decisions = first_out[-1]
        # The replay is traced separately: `recorded` is an array there, `None` in `first`.
        example = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), decisions)
        (replay_p, replay_s) = convert(body_fun, init_val, example)
        replay_out = eqx.combine(replay_p, replay_s).out_struct
        _tree.check_same_structure("body_fun(val, recorded)", first_out, replay_out, _DECISIONS_FIX)
        params = params._replace(replay=replay_p)
        replay = lambda params, val, recorded: eqx.combine(params.replay, replay_s)(val, recorded)
    cond = lambda params, val: eqx.combine(params.cond, cond_s)(val)
    body = lambda params, val: eqx.combine(params.body, body_s)(val, *first)
    step = _masked_step(cond, body, replay, outputs, record_decisions)
    loop = EngineLoop(step, cond, max_steps, pack, unpack, decisions, recorded_steps)
    if progress is not None:
        loop, params = _with_progress(loop, params, progress, init_val)
    return loop, params


def _with_progress(loop: EngineLoop, params: LoopParams, progress, init_val):
    """`loop` reporting by `progress = (milestone, report)`, and the arrays those close over."""
    _check_progress(progress)
    milestone_p, milestone_s = convert(progress[0], init_val)
    level = eqx.combine(milestone_p, milestone_s).out_struct
    if jnp.shape(level) != () or level.dtype != jnp.int32:
        raise TypeError(f"progress: milestone(val) must return an int32 scalar, got {level}")
    report_p, report_s = convert(progress[1], init_val)
    target = eqx.combine(report_p, report_s).out_struct
    if not (isinstance(target, jax.ShapeDtypeStruct) and target.shape == ()) or (
        target.dtype != jnp.int32
    ):
        raise TypeError(
            "progress: report(val) must return an int32 scalar (the milestone at which to "
            f"report next), got {target}"
        )
    hooks = Progress(
        lambda params, val: eqx.combine(params.milestone, milestone_s)(val),
        lambda params, val: eqx.combine(params.report, report_s)(val),
    )
    loop = dataclasses.replace(loop, progress=hooks)
    return loop, params._replace(milestone=milestone_p, report=report_p)


def _masked_step(cond, body, replay, outputs, record_decisions: bool):
    """The loop's step: `body` (or `replay` on a recorded step) brought to a `Stepped`, masked
    by the lane's predicate; buffer writes go to an out-of-range index on finished lanes."""
    grouped = isinstance(outputs, list)
    if outputs is None:
        lengths = None
    else:
        lengths = [_buffer_length(group) for group in (outputs if grouped else [outputs])]

    def step(params, val, x, i, recorded=None) -> Stepped:
        del x, i
        active = lane_running(cond(params, val))
        out = body(params, val) if recorded is None else replay(params, val, recorded)
        made = None
        if record_decisions:
            *out, made = out
            out = out[0] if outputs is None else tuple(out)
        if outputs is None:
            new, idx, values = out, jnp.zeros((1,), jnp.int32), None
        else:
            assert lengths is not None  # measured where there are outputs
            new, writes = out
            idx, values = zip(*writes, strict=True) if grouped else ([writes[0]], [writes[1]])
            idx = tuple(
                jnp.where(active, jnp.asarray(i, jnp.int32), m)
                for i, m in zip(idx, lengths, strict=True)
            )
            # one group: the buffers themselves; groups: a list of them
            idx, values = (idx, list(values)) if grouped else (idx[0], values[0])
        return Stepped(_tree.where(active, new, val), idx, values, made)

    return step
