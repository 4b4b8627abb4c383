"""The engine: one forward loop that stores snapshots, one reverse loop that replays a schedule.

The forward loop holds one step function, the reverse loop one VJP of it and an inner loop of
plain steps (its advances), whatever the number of steps or the schedule's depth, so compile time
does not depend on either. The forward loop runs the schedule's generator of stores
(`schedules.Schedule`) as it steps, and the reverse loop's decisions come from integer
arithmetic on a small table of binomials (`split`, see `schedules.split`): unbatched, never
from batched data, and neither sized by the number of steps.
"""

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _tree
from ._vmap import any_lane
from .schedules import BinomialTable, Ops, Schedule

_INT = jnp.int32
OPS = Ops(jnp, _INT, lax.cond)
"""How the loops run a schedule's generator."""


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """A loop in the engine's normal form.

    - `step(params, state, x, i, recorded=None) -> (state, index, values, made)`: one step;
        `values` are written to the buffers at `index` (int32 `[k]`, out of range dropped).
        `made` is the step's record of its discrete decisions (`None` if it keeps none); the
        reverse sweep passes it back as `recorded` when it recomputes the step, and the step
        must then take those decisions again, so that a recomputation that rounds differently
        (XLA compiles it separately) still follows the forward trajectory.
    - `cond(params, state) -> bool` or `None` (a scan: run exactly `steps` steps).
    - `steps`: `n` for a scan, `max_steps` for a while loop.
    - `decisions`: the structure (`jax.ShapeDtypeStruct`s) of `made`, or `None`.
    - `pack(params, state) -> packed`, `unpack(params, packed) -> state`: what a snapshot
        holds (default: the whole state). `unpack` must rebuild exactly the state that was
        packed; it runs once per restore in the reverse sweep.
    """

    step: Callable[..., tuple[Any, jax.Array, Any]]
    cond: Callable[..., jax.Array] | None
    steps: int
    pack: Callable[..., Any] | None = None
    unpack: Callable[..., Any] | None = None
    decisions: Any = None

    def packed(self, params, state) -> _tree.Raveled:
        """What a snapshot of `state` holds, raveled: a few arrays, not one per leaf."""
        return _tree.ravel(state if self.pack is None else self.pack(params, state))

    def unpacked(self, params, packed: _tree.Raveled):
        """The state a snapshot holds."""
        tree = packed.unravel()
        return tree if self.unpack is None else self.unpack(params, tree)


def _x(xs, i):
    return None if xs is None else _tree.index(xs, i)


def forward(loop: Loop, params, init, xs, buffers, schedule: Schedule | None):
    """Run the loop; with a `schedule`, store snapshots as it says.

    Returns `(state, buffers, residuals)`; `residuals = (n, held, snaps, pos, tape)` (the
    number of steps run, the state before the last step, the snapshot array, the position each
    slot holds, and each step's recorded decisions or `None`), or `None` without a schedule.
    """
    save = schedule is not None
    record = save and loop.decisions is not None
    tape = _tree.stack_zeros(loop.decisions, loop.steps) if record else None
    if save:
        c = schedule.checkpoints
        packed = loop.packed(params, init)
        snaps = _tree.update(_tree.stack_zeros(packed, c), packed, 0)
        pos = jnp.full((c,), -1, _INT).at[0].set(0)
        stores = schedule.start(OPS)  # the next store: its position and slot
    else:
        snaps = pos = stores = None
    pred = jnp.array(True) if loop.cond is None else loop.cond(params, init)
    carry = (jnp.array(0, _INT), init, init, snaps, pos, stores, buffers, pred, tape)

    def keep_going(carry):
        i, *_, pred, _ = carry
        going = i < loop.steps
        return going if loop.cond is None else going & any_lane(pred)

    def body(carry):
        i, state, prev, snaps, pos, stores, buffers, _, tape = carry
        if save:
            # position i - 1 is decided one step later, at iteration i (see `Schedule`)
            hit = stores.position == i - 1
            snaps = _store(snaps, hit, stores.slot, loop.packed(params, prev))
            pos = jnp.where(hit, pos.at[stores.slot].set(i - 1), pos)
            stores = lax.cond(hit, lambda s: schedule.advance(s, OPS), lambda s: s, stores)
        new, idx, values, made = loop.step(params, state, _x(xs, i), i)
        buffers = _tree.write(buffers, idx, values)
        if record:
            tape = _tree.update(tape, made, i)
        pred = jnp.array(True) if loop.cond is None else loop.cond(params, new)
        return i + 1, new, state, snaps, pos, stores, buffers, pred, tape

    n, state, held, snaps, pos, _, buffers, _, tape = lax.while_loop(keep_going, body, carry)
    return state, buffers, ((n, held, snaps, pos, tape) if save else None)


def reverse(
    loop: Loop, params, xs, residuals, ct_state, ct_buffers, checkpoints: int,
    binomials: np.ndarray | None, want: tuple[bool, bool] = (True, True),
):  # fmt: skip
    """Replay the schedule backwards from the snapshots; returns the input cotangents.

    Returns `(ct_params, ct_init, ct_xs, ct_buffers)` for the inexact leaves (`None`
    elsewhere), `ct_buffers` being the cotangent of the initial buffer contents. `want` says
    whether the cotangents of `params` and `xs` are needed (else `None`: no `[n, ...]` buffer
    for constant `xs`). `binomials`: the schedule's (`Schedule.binomials`), or `None` with a
    slot for every step.
    """
    n, held, snaps, pos, tape = residuals
    c = checkpoints
    big = jnp.iinfo(_INT).max
    perm = jnp.argsort(jnp.where(pos >= 0, pos, big)).astype(_INT)
    stack = pos[perm]
    k = jnp.sum(pos >= 0).astype(_INT)
    ct_params, ct_xs = cotangent_zeros(params, xs, want)
    body = reverse_body(loop, params, xs, tape, c, binomials, perm, want)
    carry = (n, n - 1, k, stack, held, snaps, ct_state, ct_params, ct_xs, ct_buffers)
    out = lax.while_loop(lambda carry: carry[0] > 0, body, carry)
    ct_state, ct_params, ct_xs, ct_buffers = out[6:]
    return ct_params, ct_state, ct_xs, ct_buffers


def cotangent_zeros(params, xs, want: tuple[bool, bool]):
    """Zero cotangents `(ct_params, ct_xs)` of the inexact leaves, `None` where not wanted."""
    want_params, want_xs = want
    ct_params = _tree.zeros_like(_tree.split_inexact(params)[0]) if want_params else None
    ct_xs = None if xs is None or not want_xs else _tree.zeros_like(_tree.split_inexact(xs)[0])
    return ct_params, ct_xs


def reverse_body(
    loop: Loop, params, xs, tape, c: int, binomials: np.ndarray | None, perm,
    want: tuple[bool, bool],
):  # fmt: skip
    """One iteration of the reverse sweep, which reverses one step, on the carry `(end, cur,
    k, stack, held, snaps, ct_state, ct_params, ct_xs, ct_buffers)`: restore the top snapshot
    unless the state before step `end - 1` is in hand (`cur = end - 1`: the first iteration),
    advance from it to `end - 1` in an inner loop of plain steps, storing the states Revolve's
    split says, then reverse step `end - 1`. `stack[:k]` are the stored positions (sorted),
    `perm[j]` the slot of `stack[j]`; `binomials` is the table `split` reads (`None` with a
    slot for every step: the restored snapshot is always the state before step `end - 1`).
    """
    want_params, want_xs = want
    recorded = lambda cur: None if tape is None else _tree.index(tape, cur)
    table = None if binomials is None else BinomialTable(jnp.asarray(binomials, _INT), OPS)
    params_f, params_rest = _tree.split_inexact(params)

    def vjp_step(cur, state, ct_state, ct_params, ct_buffers):
        state_f, state_rest = _tree.split_inexact(state)
        x = _x(xs, cur)
        x_f, x_rest = _tree.split_inexact(x)

        def f(p_f, s_f, xx_f):
            p_f = p_f if want_params else params_f
            xx_f = xx_f if want_xs else x_f
            new, idx, values, _ = loop.step(
                _combine(p_f, params_rest), _combine(s_f, state_rest), _combine(xx_f, x_rest), cur,
                recorded(cur),
            )  # fmt: skip
            return (_tree.split_inexact(new)[0], _tree.split_inexact(values)[0]), idx

        diff = (params_f if want_params else None, state_f, x_f if want_xs else None)
        _, vjp_fn, idx = jax.vjp(f, *diff, has_aux=True)
        ct_p, ct_s, ct_x = vjp_fn((ct_state, _tree.gather(ct_buffers, idx)))
        if want_params:
            ct_params = _tree.add(ct_params, ct_p)
        return ct_s, ct_params, ct_x, idx

    def advance(end, inner):
        """Step `cur` of the inner loop: store the state in hand if the split says so."""
        cur, k, stack, held, snaps = inner
        top = stack[k - 1]
        free = c - k + 1
        split = 1 if table is None else table.split(end - top, free)
        push = (free >= 2) & (cur == top + split)
        snaps = _store(snaps, push, perm[jnp.minimum(k, c - 1)], loop.packed(params, held))
        stack = jnp.where(push, stack.at[jnp.minimum(k, c - 1)].set(cur), stack)
        held = loop.step(params, held, _x(xs, cur), cur, recorded(cur))[0]
        return cur + 1, k + push.astype(_INT), stack, held, snaps

    def body(carry):
        end, cur, k, stack, held, snaps, ct_state, ct_params, ct_xs, ct_buffers = carry
        # Every iteration but the first (which holds the state before the last step) restores
        # the top snapshot.
        restore = lambda: loop.unpacked(params, _tree.index(snaps, perm[k - 1]))
        held = lax.cond(cur < 0, restore, lambda: held)
        cur = jnp.where(cur < 0, stack[k - 1], cur)
        if table is not None:
            # With a slot for every step, the snapshot restored is the state before step
            # `end - 1`: no advance, and no copy of the step compiled for one.
            inner = (cur, k, stack, held, snaps)
            inner = lax.while_loop(lambda inner: inner[0] < end - 1, partial(advance, end), inner)
            _, k, stack, held, snaps = inner
        ct_state, ct_params, ct_x, idx = vjp_step(end - 1, held, ct_state, ct_params, ct_buffers)
        ct_buffers = _tree.clear(ct_buffers, idx)
        if ct_xs is not None:
            ct_xs = _tree.update(ct_xs, ct_x, end - 1)
        end = end - 1
        k = k - (end == stack[k - 1]).astype(_INT)
        cur = jnp.array(-1, _INT)
        return end, cur, k, stack, held, snaps, ct_state, ct_params, ct_xs, ct_buffers

    return body


def _store(stack, pred, i, value):
    """`stack[i] = value` where `pred` holds (unbatched), else the index is out of range and
    the write is dropped: in place, one fused write per leaf, with no conditional."""
    i = jnp.where(pred, i, jax.tree.leaves(stack)[0].shape[0])
    return jax.tree.map(lambda s, v: s.at[i].set(v, mode="drop"), stack, value)


def _combine(a, b):
    return eqx.combine(a, b)
