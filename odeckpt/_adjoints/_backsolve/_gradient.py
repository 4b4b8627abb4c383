"""`BacksolveAdjoint`'s differentiation rule: a plain forward solve that stores a few states, and
a reverse sweep that solves the adjoint equations backwards."""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._checks import all_finite
from ..._integrate import IntegrationLoop
from ..._loop_state import LoopState
from ..._outputs import Outputs, Writes
from ..._status import Status
from ...checkpointing import Sweeps, differentiable
from .._base import AbstractWatch, while_loop
from ._backward import Backward, BackwardStats, solve_backwards, solve_with_forward_states
from ._problem import Problem, pair
from ._setup import BackwardSetup
from ._stops import Stops, StoredStates, dense_stops, output_stops

_BACKWARD_FAILED = (
    "BacksolveAdjoint: the backward (adjoint) solve failed (max_steps reached, step size "
    "underflow, a non-finite adjoint, or the reconstructed state drifted from the forward "
    "solution by more than `max_drift`). Fix: re-anchor with "
    "`BacksolveAdjoint(checkpoints=...)` or use `reconstruct='forward'`, tighten the backward "
    "`rtol`/`atol`, raise `max_steps`, or use `RecursiveCheckpointAdjoint`, whose gradients "
    "do not solve a backward ODE."
)


class _Store(AbstractWatch):
    """Stores the first accepted step end at or after each of the `targets` times."""

    targets: jax.Array
    stored: StoredStates
    next_slot: jax.Array

    @classmethod
    def make(cls, k: int, state: LoopState, t_end) -> "_Store":
        """`k` slots for the times `t0 + j (t_end - t0) / (k + 1)`, `j = 1..k`."""
        fractions = jnp.arange(1, k + 1, dtype=state.t.dtype) / (k + 1)
        stored = StoredStates(
            t=jnp.full((k,), jnp.inf, state.t.dtype),
            y=jax.tree.map(lambda y: jnp.full((k, *y.shape), jnp.inf, y.dtype), state.y),
            dt=jnp.zeros((k,), state.dt.dtype),
        )
        targets = state.t + fractions * (t_end - state.t)
        return cls(targets, stored, jnp.zeros((), jnp.int32))

    def update(self, before: LoopState, after: LoopState, writes: Writes) -> "_Store":
        k = self.targets.shape[0]
        accepted = after.num_accepted > before.num_accepted
        target = self.targets[jnp.minimum(self.next_slot, k - 1)]
        hit = accepted & (self.next_slot < k) & (after.t >= target)
        index = jnp.where(hit, self.next_slot, k)
        put = lambda buffer, value: buffer.at[index].set(value, mode="drop")
        stored = StoredStates(
            t=put(self.stored.t, after.t),
            y=jax.tree.map(put, self.stored.y, after.y),
            dt=put(self.stored.dt, after.dt),
        )
        # A long step may pass several targets; they share this one stored state.
        passed = jnp.sum(self.targets <= after.t, dtype=self.next_slot.dtype)
        return _Store(self.targets, stored, jnp.where(hit, passed, self.next_slot))


class BacksolveInputs(NamedTuple):
    """What a backsolve run is differentiated with respect to."""

    loop: IntegrationLoop
    init: LoopState
    outputs: Outputs


class _Arguments(NamedTuple):
    """What the rule is differentiated with respect to: the inputs, and the setup, whose arrays
    (traced tolerances) must be arguments of the rule, never values it closes over."""

    loop: IntegrationLoop
    init: LoopState
    outputs: Outputs
    setup: BackwardSetup

    @classmethod
    def of(cls, inputs: BacksolveInputs, setup: BackwardSetup | None) -> "_Arguments":
        return cls(inputs.loop, inputs.init, inputs.outputs, setup)

    @property
    def inputs(self) -> BacksolveInputs:
        return BacksolveInputs(self.loop, self.init, self.outputs)


FORWARD_MODE_ERROR = (
    "adjoint=BacksolveAdjoint() supports reverse mode only (jax.grad, jax.vjp, jax.jacrev). "
    "Fix: for jax.jvp / jax.jacfwd use adjoint='forward' (ForwardMode) or adjoint='direct' "
    "(DirectAdjoint)."
)


def backsolve(inputs: BacksolveInputs, setup: BackwardSetup, checkpoints: int | None):
    """`(final state, outputs)` of the loop run from `inputs`, differentiable in reverse mode
    by solving the adjoint equations backwards (forward mode raises, naming the fix)."""
    arrays, static = eqx.partition(_Arguments.of(inputs, setup), eqx.is_array)
    whole = lambda arrays: eqx.combine(arrays, static)

    def sweeps() -> Sweeps:
        def forward(arrays: _Arguments):
            final, outputs, stored = _forward(whole(arrays).inputs, checkpoints)
            return (final, outputs), (final, outputs, stored)

        def reverse(arrays: _Arguments, saved, ct_out, want: _Arguments) -> _Arguments:
            arguments = whole(arrays)
            ct = _reverse(arguments.inputs, saved, ct_out, want, arguments.setup)
            return _Arguments.of(ct, None)

        return Sweeps(forward, reverse)

    primal = lambda arrays: _forward(whole(arrays).inputs, checkpoints)[:2]
    return differentiable(primal, sweeps, arrays, forward_error=FORWARD_MODE_ERROR)


def _forward(inputs: BacksolveInputs, checkpoints: int | None):
    """The plain forward solve, storing `checkpoints` step-end states on the way."""
    loop, state, outputs = inputs
    store = None if checkpoints is None else _Store.make(checkpoints, state, loop.t_end)
    final, outputs, store = while_loop(loop, state, outputs, store)
    return final, outputs, None if store is None else store.stored


def _reverse(
    inputs: BacksolveInputs,
    saved,
    ct_out,
    want: BacksolveInputs | _Arguments,
    setup: BackwardSetup,
) -> BacksolveInputs:
    """The cotangents of `inputs` from those of the final state and the outputs."""
    final, outputs, stored = saved
    loop, init, _ = inputs
    ct_final, ct_outputs = ct_out
    empty = lambda tree: jax.tree.map(lambda _: None, tree)
    diff, nondiff = eqx.partition((loop.f, loop.args), eqx.is_inexact_array)
    if not want.loop:
        diff, nondiff = empty(diff), (loop.f, loop.args)
    problem = Problem(nondiff)
    kinds = output_stops(loop, final, outputs, stored, ct_outputs)
    if setup.reconstruct_forward:
        kinds = [kind for kind in kinds if kind.jump_a is not None]
    dense = dense_stops(loop, init, final, outputs, ct_outputs)
    stops = Stops.make([*kinds, *([dense] if dense is not None else [])], init.t, init.y)
    backward = Backward(setup, loop, init, final, problem, diff, stops)
    g = jax.tree.map(jnp.zeros_like, diff)
    a = ct_final.y
    ct_t_end = _ct_t_end(problem, diff, final, ct_final)
    if loop.events is not None:
        a, g, ct_t_end = _terminal_event(loop, problem, diff, final, ct_final, ct_t_end)
    if setup.reconstruct_forward:
        (a, g), stats = solve_with_forward_states(backward, stored, (a, g))
    else:
        (a, g), stats = solve_backwards(backward, (final.y, a, g))
    if setup.on_backward is not None:
        _report(setup.on_backward, stats)
    a, g = _checked(loop, final, stats, (a, g))
    g_f, g_args = g
    grad_loop = dataclasses.replace(
        empty(loop), f=g_f, args=g_args, t_end=ct_t_end,
        ts=_ct_ts(loop, problem, diff, outputs, ct_outputs),
    )  # fmt: skip
    ct_t0 = -pair(a, problem.f(init.t, init.y, diff)).astype(init.t.dtype)
    grad_init = dataclasses.replace(empty(init), y=a, t=ct_t0)
    return BacksolveInputs(grad_loop, grad_init, None)


def _checked(loop: IntegrationLoop, final: LoopState, stats: BackwardStats, a_g):
    """`a_g`, raising (with `throw`) if the backward solve failed after a successful forward
    one, and NaN wherever either failed. A failed forward solve has NaN derivatives already
    (and raised, with `throw`): its backward solve fails too, and says nothing more."""
    forward_ok = loop.final_status(final) == Status.successful
    if loop.throw:
        a_g = eqx.error_if(a_g, forward_ok & ~stats.succeeded, _BACKWARD_FAILED)
    failed = ~(forward_ok & stats.succeeded)
    return jax.tree.map(lambda x: jnp.where(failed, jnp.nan, x), a_g)


def _terminal_event(
    loop: IntegrationLoop, problem: Problem, diff, final: LoopState, ct_final, ct_t_end
):
    """The adjoint and parameter integral at a terminal event's time `t*`, and the cotangent
    of `t1` (zero: the event ended the solve before it).

    `t*` solves `g(t*, y(t*), args) = 0`, so moving `y(t*)` or the parameters moves `t*` by
    `-(dg) / g'` with `g' = dg/dt + <dg/dy, f>` (the implicit function theorem); the loss sees
    `t*` through its own cotangent and through `y(t*)` moving along `f`, together `c_t`. Hence
    `a(t*) = dL/dy - (c_t / g') dg/dy` and the parameters gain `-(c_t / g') dg/dparams`
    (Chen, Amos & Nickel, ICLR 2021)."""
    fired = final.events.event >= 0
    index = jnp.maximum(final.events.event, 0)
    rate = problem.f(final.t, final.y, diff)
    c_t = ct_final.t + pair(ct_final.y, rate).astype(final.t.dtype)

    def value(t, y, d):
        _, args = eqx.combine(d, problem.nondiff)
        return loop.events.values(t, y, args)[index]

    _, vjp = jax.vjp(value, final.t, final.y, diff)
    g_t, g_y, g_d = vjp(jnp.ones((), final.t.dtype))
    slope = g_t + pair(g_y, rate).astype(final.t.dtype)
    weight = jnp.where(fired, -c_t / jnp.where(fired, slope, 1), 0)
    scaled = lambda tree: jax.tree.map(lambda x: (weight * x).astype(x.dtype), tree)
    a = jax.tree.map(jnp.add, ct_final.y, scaled(g_y))
    return a, scaled(g_d), jnp.where(fired, 0, ct_t_end)


def _ct_t_end(problem: Problem, diff, final: LoopState, ct_final):
    """`dL/dt1 = <dL/dy(t1), f(t1, y(t1))>`, plus the cotangent of the final time itself."""
    ct = pair(ct_final.y, problem.f(final.t, final.y, diff)).astype(final.t.dtype)
    return ct + ct_final.t


def _ct_ts(loop: IntegrationLoop, problem: Problem, diff, outputs: Outputs, ct: Outputs):
    """`dL/dts_i = <dL/dy(ts_i), f(ts_i, y(ts_i))>` for the save times (0 for unreached ones)."""
    if loop.ts is None:
        return None
    rate = lambda t, y, c: pair(c, problem.f(t, y, diff))
    values = jax.vmap(rate)(loop.ts, outputs.ts, ct.ts).astype(loop.ts.dtype)
    return jnp.where(jax.vmap(all_finite)(outputs.ts), values, 0)


def _report(on_backward: Callable[[dict], None], stats: BackwardStats) -> None:
    """Hand `stats` to `on_backward` on the host, as the Python values it documents. Under
    `vmap` `jax.debug.callback` unrolls over the batch: one call per element, with scalars."""

    def on_host(stats: BackwardStats) -> None:
        accepted, rejected = stats.num_accepted.item(), stats.num_rejected.item()
        on_backward(
            {
                "num_backward_steps": accepted + rejected,
                "num_accepted_backward_steps": accepted,
                "num_rejected_backward_steps": rejected,
                "num_window_solves": stats.num_window_solves.item(),
                "max_drift": stats.max_drift.item(),
                "succeeded": stats.succeeded.item(),
            }
        )

    jax.debug.callback(on_host, stats)
