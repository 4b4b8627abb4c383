"""The engine: one forward loop that stores snapshots, one reverse loop that replays a schedule.

The forward loop holds one step function, the reverse loop one VJP of it and an inner loop of
plain steps (its advances), whatever the number of steps or the schedule's depth. The forward
loop runs the schedule's generator of stores (`schedules.Schedule`) as it steps; the reverse
loop's decisions come from Revolve's `split` read from a small table of binomials
(`schedules.BinomialTable`): unbatched, never from batched data, and neither sized by the
number of steps.
"""

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._autodiff import _tree, cond, while_loop
from .._errors import error_if
from ._vmap import any_lane
from .schedules import BinomialTable, Ops, Schedule

_INT = jnp.int32
OPS = Ops(jnp, _INT, cond)
"""How the loops run a schedule's arithmetic."""

RECORDED_STEPS = 2**20
"""How many leading steps' decisions `record_decisions=True` keeps: the record's memory is
bounded whatever `max_steps` is."""

DIVERGED = (
    "the reverse sweep recomputed a step past the recorded decisions, and it took other "
    "decisions than the forward run (it does not end where the next step began): its gradient "
    "would be the derivative of another trajectory. Fix: record more steps "
    "(bounded_while_loop(record_decisions=n)), take fewer steps, or (for odeckpt.solve) use an "
    "adjoint that recomputes nothing: ForwardSensitivity or BacksolveAdjoint"
)
"""The error a broken chain raises with `throw`."""


class Stepped(NamedTuple):
    """What one step of an `EngineLoop` returns.

    - `state`: the state after the step.
    - `index`, `values`: `values` are written to the buffers at `index` (int32 `[k]`, out of
        range dropped; a tuple of them, one per group, for grouped buffers).
    - `made`: the step's record of its discrete decisions (`None` if it keeps none).
    """

    state: Any
    index: Any
    values: Any
    made: Any


@dataclasses.dataclass(frozen=True, eq=False)
class EngineLoop:
    """A loop in the engine's normal form, which `checkpointed_scan` and `bounded_while_loop`
    bring theirs to.

    - `step(params, state, x, i, recorded=None) -> Stepped`: one step. The reverse sweep passes
        the step's record of its decisions (`Stepped.made`) back as `recorded` when it
        recomputes the step, which must then take those decisions again, so that a
        recomputation that rounds differently (XLA compiles it separately) still follows the
        forward trajectory.
    - `cond(params, state) -> bool` or `None` (a scan: run exactly `steps` steps).
    - `steps`: `n` for a scan, `max_steps` for a while loop.
    - `pack(params, state) -> packed`, `unpack(params, packed) -> state`: what a snapshot
        holds (default: the whole state). `unpack` must rebuild exactly the state that was
        packed; it runs once per restore in the reverse sweep.
    - `decisions`: the structure (`jax.ShapeDtypeStruct`s) of `made`, or `None`.
    - `recorded_steps`: with `decisions`, how many leading steps' records the forward run
        keeps. Past them the recomputation decides afresh (`recorded=None`), and the reverse
        sweep checks that each step it reverses ends where the next one began.
    - `throw`: whether a broken chain raises (through `_errors.error_if`) besides turning the
        cotangents NaN.
    - `pack_state`: whether the snapshot sweeps carry the state packed into one vector per dtype
        (`_flat.flat_loop`; `bounded_while_loop(pack_state=True)`).
    - `progress`: a `Progress` (or `None`): the forward run reports as it goes.
    - `unraveled`: for a loop over raveled states (`_tree.Raveled`, see `_flat.flat_loop`),
        the same loop over the states themselves (else `None`). The reverse sweep
        differentiates its steps, so that each leaf's cotangent stays an array of its own
        (XLA drops those nobody reads: of the time, of the step size); the cotangents then
        have the structure of the unraveled state.
    """

    step: Callable[..., Stepped]
    cond: Callable[..., jax.Array] | None
    steps: int
    pack: Callable[..., Any] | None = None
    unpack: Callable[..., Any] | None = None
    decisions: Any = None
    recorded_steps: int = 0
    throw: bool = False
    pack_state: bool = False
    progress: "Progress | None" = None
    unraveled: "EngineLoop | None" = None

    @property
    def tape_length(self) -> int:
        """The number of steps whose decisions the forward run records."""
        return 0 if self.decisions is None else min(self.steps, self.recorded_steps)

    @property
    def checks_chain(self) -> bool:
        """Whether some step may be recomputed without its record."""
        return self.decisions is not None and self.steps > self.recorded_steps

    def packed(self, params, state) -> _tree.Raveled:
        """What a snapshot of `state` holds, raveled: a few arrays, not one per leaf."""
        return _tree.ravel(state if self.pack is None else self.pack(params, state))

    def unpacked(self, params, packed: _tree.Raveled):
        """The state a snapshot holds."""
        tree = packed.unravel()
        return tree if self.unpack is None else self.unpack(params, tree)

    def predicate(self, params, state) -> jax.Array:
        """`cond(params, state)`; `True` for a scan."""
        return jnp.array(True) if self.cond is None else self.cond(params, state)

    def running(self, i, pred) -> jax.Array:
        """Whether step `i` runs: `i < steps` and, for a while loop, `pred` holds in some lane
        (unbatched under `vmap`)."""
        going = i < self.steps
        return going if self.cond is None else going & any_lane(pred)


@dataclasses.dataclass(frozen=True)
class Progress:
    """What the forward run of an `EngineLoop` reports (`bounded_while_loop(progress=...)`):
    `report(params, state)` before the first step returns a target, and the run goes on in
    stretches until `milestone(params, state)` (an int32 scalar) reaches the target, calling
    `report` after each stretch for the next target. Reverse sweeps never report."""

    milestone: Callable[..., jax.Array]
    report: Callable[..., jax.Array]

    def raveled(self) -> "Progress":
        """The same, of a raveled state (`_tree.Raveled`, see `_flat.flat_loop`)."""
        milestone, report = self.milestone, self.report
        return Progress(
            lambda params, flat: milestone(params, flat.unravel()),
            lambda params, flat: report(params, flat.unravel()),
        )


class LoopInputs(NamedTuple):
    """The inputs a run of an `EngineLoop` is differentiated with respect to: `params`, the
    initial state `init`, the per-step inputs `xs` (leading axis `steps`, or `None`) and the
    initial contents of the output `buffers`. Also their cotangents, and (as bools) which of
    them are wanted."""

    params: Any
    init: Any
    xs: Any
    buffers: Any


class Snapshots(NamedTuple):
    """What the forward sweep leaves for the reverse sweep.

    - `steps`: the number of steps run `n`.
    - `held`: the state before the last step (the reverse sweep starts from it).
    - `snaps`: the snapshot slots (`Raveled`, leading axis `c`).
    - `positions`: the position each slot holds (`-1`: empty).
    - `tape`: the recorded decisions of the first `EngineLoop.tape_length` steps, or `None`.
    - `final`: the state after the last step when the reverse sweep checks the chain (else
        `None`).
    """

    steps: jax.Array
    held: Any
    snaps: Any
    positions: jax.Array
    tape: Any
    final: Any


class _Forward(NamedTuple):
    """The forward sweep's carry: step `i` is next, `prev` is the state before `state`,
    `stores` the schedule's next store, `pred` the loop predicate on `state`."""

    i: jax.Array
    state: Any
    prev: Any
    snaps: Any
    positions: Any
    stores: Any
    buffers: Any
    pred: jax.Array
    tape: Any


def x_at(xs, i):
    """The per-step input of step `i` (`None` without `xs`)."""
    return None if xs is None else _tree.index(xs, i)


def step_forward(loop: EngineLoop, params, xs, carry):
    """`carry` (a carry with fields `i`, `state`, `prev`, `buffers`, `pred`, `tape`) after
    step `i`: writes the buffers and records the step's decisions on the tape (if any)."""
    stepped = loop.step(params, carry.state, x_at(xs, carry.i), carry.i)
    buffers = _tree.write(carry.buffers, stepped.index, stepped.values)
    tape = carry.tape
    if tape is not None:
        # past the tape's length the write is dropped
        tape = jax.tree.map(lambda a, v: a.at[carry.i].set(v, mode="drop"), tape, stepped.made)
    return carry._replace(
        i=carry.i + 1, state=stepped.state, prev=carry.state, buffers=buffers,
        pred=loop.predicate(params, stepped.state), tape=tape,
    )  # fmt: skip


def forward(loop: EngineLoop, inputs: LoopInputs, schedule: Schedule | None):
    """Run the loop; with a `schedule`, store snapshots as it says.

    Returns `((state, buffers), saved)`, `saved` the `Snapshots` (`None` without a schedule).
    """
    params, init, xs, buffers = inputs
    save = schedule is not None
    snaps = positions = stores = tape = None
    if save:
        c = schedule.checkpoints
        packed = loop.packed(params, init)
        snaps = _tree.update(_tree.stack_zeros(packed, c), packed, 0)
        positions = jnp.full((c,), -1, _INT).at[0].set(0)
        stores = schedule.start(OPS)  # the next store: its position and slot
        if loop.decisions is not None:
            tape = _tree.stack_zeros(loop.decisions, loop.tape_length)
    pred = loop.predicate(params, init)
    carry = _Forward(jnp.array(0, _INT), init, init, snaps, positions, stores, buffers, pred, tape)

    def body(carry: _Forward) -> _Forward:
        if save:
            assert schedule is not None  # `save` is that
            advance = schedule.advance
            # position i - 1 is decided one step later, at iteration i (see `Schedule`)
            i, slot = carry.i, carry.stores.slot
            hit = carry.stores.position == i - 1
            carry = carry._replace(
                snaps=_store(carry.snaps, hit, slot, loop.packed(params, carry.prev)),
                positions=jnp.where(hit, carry.positions.at[slot].set(i - 1), carry.positions),
                stores=cond(hit, lambda s: advance(s, OPS), lambda s: s, carry.stores),
            )  # fmt: skip
        return step_forward(loop, params, xs, carry)

    target = None if loop.progress is None else loop.progress.report(params, init)
    carry, _ = reporting_while_loop(loop, params, body, carry, target)
    final = carry.state if loop.checks_chain else None
    saved = Snapshots(carry.i, carry.prev, carry.snaps, carry.positions, carry.tape, final)
    return (carry.state, carry.buffers), (saved if save else None)


def reporting_while_loop(
    loop: EngineLoop, params, body: Callable, carry, target, within: Callable | None = None
):
    """`lax.while_loop` of `body` over a forward carry (fields `i`, `state`, `pred`) while
    `loop.running` (and `within(carry)`, if given) hold; **returns** the final carry and the
    progress `target` (`None` without `loop.progress`). With `loop.progress`, it runs in
    stretches until the milestone reaches `target`, and reports after each stretch (one that
    `within` cut short too: the report sees the milestone short of the target) for the next
    target: no `lax.cond`, so that the report may be an `io_callback` under `vmap`."""
    running = lambda carry: loop.running(carry.i, carry.pred)
    going = running if within is None else lambda carry: within(carry) & running(carry)
    progress = loop.progress
    if progress is None:
        return while_loop(going, body, carry), None
    short = lambda carry, target: any_lane(progress.milestone(params, carry.state) < target)

    def stretch(reporting):
        carry, target = reporting
        carry = while_loop(lambda c: going(c) & short(c, target), body, carry)
        return carry, progress.report(params, carry.state)

    return while_loop(lambda r: going(r[0]), stretch, (carry, target))


class Reversal(NamedTuple):
    """The reverse sweep's carry.

    - `end`: steps `end, ...` are reversed; step `end - 1` is next.
    - `cur`: the position of the state in hand, `held` (`-1`: none, restore a snapshot).
    - `k`, `stack`: `stack[:k]` are the stored positions, sorted.
    - `snaps`: the snapshot slots.
    - `cts`: the cotangents (`LoopInputs`): of the state after step `end - 1` (`init`), and
        those accumulated for `params`, `xs` and the buffers.
    """

    end: jax.Array
    cur: jax.Array
    k: jax.Array
    stack: jax.Array
    held: Any
    snaps: Any
    cts: LoopInputs


class _Advance(NamedTuple):
    """The carry of a reversal's inner loop of plain steps: the state `held` at `cur`, and the
    stack and slots it may store into."""

    cur: jax.Array
    k: jax.Array
    stack: jax.Array
    held: Any
    snaps: Any


def reverse(
    loop: EngineLoop, inputs: LoopInputs, saved: Snapshots, ct_out, checkpoints: int,
    binomials: np.ndarray | None, want: LoopInputs,
) -> LoopInputs:  # fmt: skip
    """Replay the schedule backwards from the snapshots; returns the cotangents of `inputs`
    (inexact leaves, `None` elsewhere, and `None` for `params` and `xs` unless `want`ed:
    no `[n, ...]` buffer for constant `xs`), `buffers` the cotangent of the initial buffer
    contents. `ct_out`: the cotangent of `(state, buffers)`. `binomials`: the schedule's
    (`Schedule.binomials`), or `None` when every state is stored (no advance).
    """
    positions = saved.positions
    big = jnp.iinfo(_INT).max
    perm = jnp.argsort(jnp.where(positions >= 0, positions, big)).astype(_INT)
    k = jnp.sum(positions >= 0).astype(_INT)
    body = reverse_body(loop, inputs, saved, checkpoints, binomials, perm, want)
    cts = initial_cotangents(inputs, ct_out, want)
    n = saved.steps
    carry = Reversal(n, n - 1, k, positions[perm], saved.held, saved.snaps, cts)
    return while_loop(lambda carry: carry.end > 0, body, carry).cts


def initial_cotangents(inputs: LoopInputs, ct_out, want: LoopInputs) -> LoopInputs:
    """The reverse sweep's cotangents before it starts: those of the final state and buffers
    (`ct_out`), and zeros for the inexact leaves of `params` and `xs` where wanted."""
    ct_state, ct_buffers = _tree.split_inexact(ct_out)[0]
    zeros = lambda tree: _tree.zeros_like(_tree.split_inexact(tree)[0])
    ct_params = zeros(inputs.params) if want.params else None
    ct_xs = None if inputs.xs is None or not want.xs else zeros(inputs.xs)
    return LoopInputs(ct_params, ct_state, ct_xs, ct_buffers)


def reverse_body(
    loop: EngineLoop, inputs: LoopInputs, saved, c: int, binomials: np.ndarray | None, perm,
    want: LoopInputs,
) -> Callable[[Reversal], Reversal]:  # fmt: skip
    """One iteration of the reverse sweep, which reverses one step: restore the top snapshot
    unless the state before step `end - 1` is in hand (`cur = end - 1`: the first iteration),
    advance from it to `end - 1` in an inner loop of plain steps, storing the states Revolve's
    split says, then reverse step `end - 1`. `perm[j]` is the slot of `stack[j]`; `binomials`
    is the table `split` reads (`None` when every state is stored: the restored snapshot is
    always the state before step `end - 1`). `saved`: the forward sweep's `tape` and `final`.

    A step recomputed without its record (past `loop.recorded_steps`) may decide otherwise
    than the forward run did: where the step reversed does not end where the next one began
    (the state after it, or the forward run's final state) up to rounding where a derivative
    flows (`_tree.agree`), the cotangents turn NaN.
    """
    params, xs = inputs.params, inputs.xs
    table = None if binomials is None else BinomialTable(jnp.asarray(binomials, _INT), OPS)
    step = _recorded_step(loop, saved.tape)
    plain = loop if loop.unraveled is None else loop.unraveled
    vjp_step = _vjp_step(plain, inputs, _recorded_step(plain, saved.tape), want)
    tree = (lambda state: state) if loop.unraveled is None else (lambda state: state.unravel())

    def advance(end, inner: _Advance) -> _Advance:
        """Step `cur` of the inner loop: store the state in hand if the split says so."""
        assert table is not None  # run only with a table (see `body`)
        top = inner.stack[inner.k - 1]
        free = c - inner.k + 1
        push = (free >= 2) & (inner.cur == top + table.split(end - top, free))
        slot = jnp.minimum(inner.k, c - 1)
        snaps = _store(inner.snaps, push, perm[slot], loop.packed(params, inner.held))
        stack = jnp.where(push, inner.stack.at[slot].set(inner.cur), inner.stack)
        stepped = step(params, inner.held, x_at(xs, inner.cur), inner.cur)
        return _Advance(inner.cur + 1, inner.k + push.astype(_INT), stack, stepped.state, snaps)

    def body(carry: Reversal) -> Reversal:
        # Every iteration but the first (which holds the state before the last step) restores
        # the top snapshot.
        first = carry.cur >= 0
        restore = lambda: loop.unpacked(params, _tree.index(carry.snaps, perm[carry.k - 1]))
        held = cond(first, lambda: carry.held, restore)
        cur = jnp.where(first, carry.cur, carry.stack[carry.k - 1])
        inner = _Advance(cur, carry.k, carry.stack, held, carry.snaps)
        if table is not None:
            # With every state stored, the snapshot restored is the state before step
            # `end - 1`: no advance, and no copy of the step compiled for one.
            going = lambda inner: inner.cur < carry.end - 1
            inner = while_loop(going, partial(advance, carry.end), inner)
        end = carry.end - 1
        cts, reached = vjp_step(end, tree(inner.held), carry.cts)
        if loop.checks_chain:
            # the state after step `end`: the one the previous iteration reversed it from
            after = tree(_tree.where(first, saved.final, carry.held))
            agree = _tree.agree(reached, after, carry.cts.init)
            chained = (end < loop.recorded_steps) | agree
            init = cts.init
            if loop.throw:
                init = error_if(init, ~chained, DIVERGED)
            # NaN in the state's cotangent reaches every earlier step's; the parameters' sum
            # has taken the later steps' already. The output buffers' (length m) stay as they
            # are, so that the check costs O(state) per step.
            nan = lambda tree: jax.tree.map(lambda x: jnp.where(chained, x, jnp.nan), tree)
            cts = cts._replace(init=nan(init), params=nan(cts.params))
        k = inner.k - (end == inner.stack[inner.k - 1]).astype(_INT)
        return Reversal(end, jnp.array(-1, _INT), k, inner.stack, inner.held, inner.snaps, cts)

    return body


def _recorded_step(loop: EngineLoop, tape) -> Callable[..., Stepped]:
    """`step(params, state, x, i) -> Stepped`: step `i` recomputed, following its recorded
    decisions where the tape holds them and deciding afresh past it."""
    if tape is None:
        return lambda params, state, x, i: loop.step(params, state, x, i)
    last = loop.tape_length - 1

    def step(params, state, x, i):
        follow = lambda: loop.step(params, state, x, i, _tree.index(tape, jnp.minimum(i, last)))
        if not loop.checks_chain:
            return follow()
        return cond(i <= last, follow, lambda: loop.step(params, state, x, i))

    return step


def _vjp_step(loop: EngineLoop, inputs: LoopInputs, step, want: LoopInputs):
    """`vjp_step(i, state, cts) -> (cts, reached)`: the cotangents after reversing step `i`
    from `state` (recomputed by `step`, as `_recorded_step`), and the state it reached.

    Only the inexact leaves are differentiated, and `params` and `xs` only where wanted."""
    params_f, params_rest = _tree.split_inexact(inputs.params)

    def vjp_step(i, state, cts: LoopInputs) -> tuple[LoopInputs, Any]:
        state_f, state_rest = _tree.split_inexact(state)
        x_f, x_rest = _tree.split_inexact(x_at(inputs.xs, i))

        def f(p_f, s_f, xx_f):
            p_f = p_f if want.params else params_f
            xx_f = xx_f if want.xs else x_f
            stepped = step(
                eqx.combine(p_f, params_rest), eqx.combine(s_f, state_rest),
                eqx.combine(xx_f, x_rest), i,
            )  # fmt: skip
            new, values = _tree.split_inexact((stepped.state, stepped.values))[0]
            return (new, values), (stepped.index, stepped.state)

        diff = (params_f if want.params else None, state_f, x_f if want.xs else None)
        _, vjp_fn, (idx, reached) = jax.vjp(f, *diff, has_aux=True)
        rows, rest = _tree.take(cts.buffers, idx)
        ct_p, ct_s, ct_x = vjp_fn((cts.init, rows))
        cts = LoopInputs(
            params=_tree.add(cts.params, ct_p) if want.params else cts.params,
            init=ct_s,
            xs=None if cts.xs is None else _tree.update(cts.xs, ct_x, i),
            buffers=rest,
        )
        return cts, reached

    return vjp_step


def _store(stack, pred, i, value):
    """`stack[i] = value` where `pred` holds (unbatched), else the index is out of range and
    the write is dropped: in place, one fused write per leaf, with no conditional."""
    i = jnp.where(pred, i, jax.tree.leaves(stack)[0].shape[0])
    return jax.tree.map(lambda s, v: s.at[i].set(v, mode="drop"), stack, value)
