"""`BacksolveAdjoint`'s differentiation rule: a plain forward solve that stores a few states, and
a reverse sweep that solves the adjoint equations backwards."""

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._autodiff import Sweeps, differentiable
from ..._checks import all_finite
from ..._loop import IntegrationLoop, LoopState, Outputs
from ..._status import Status
from .._base import while_loop
from ._anchors import Anchoring
from ._backward import Backward, BackwardStats, solve_backwards, solve_with_forward_states
from ._problem import Problem, pair
from ._setup import BackwardSetup
from ._stops import Stops, dense_stops, jump_stops, output_stops


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
    "The continuous adjoints (BacksolveAdjoint, InterpolatingAdjoint) support reverse mode only "
    "(jax.grad, jax.vjp, jax.jacrev). Fix: for jax.jvp / jax.jacfwd use "
    "adjoint='forward_sensitivity' (error-controlled sensitivities), adjoint='forward' "
    "(ForwardMode) or adjoint='direct' (DirectAdjoint)."
)


SECOND_ORDER_ERROR = (
    "The continuous adjoints (BacksolveAdjoint, InterpolatingAdjoint): reverse mode over their "
    "gradient (jax.grad(jax.grad(f))) is not supported, as their backward solve is a while "
    "loop, which JAX cannot reverse. Fix: take second derivatives forward over reverse, "
    "`jax.jacfwd(jax.jacrev(f))` or `jax.hessian(f)`."
)


def backsolve(inputs: BacksolveInputs, setup: BackwardSetup, anchoring: Anchoring | None):
    """`(final state, outputs)` of the loop run from `inputs`, differentiable in reverse mode
    by solving the adjoint equations backwards (forward mode raises, naming the fix). The
    forward solve stores states as `anchoring` says (`None`: none)."""
    arrays, static = eqx.partition(_Arguments.of(inputs, setup), eqx.is_array)
    whole = lambda arrays: eqx.combine(arrays, static)

    def sweeps() -> Sweeps:
        def forward(arrays: _Arguments):
            final, outputs, stored = _forward(whole(arrays).inputs, anchoring)
            return (final, outputs), (final, outputs, stored)

        def reverse(arrays: _Arguments, saved, ct_out, want: _Arguments) -> _Arguments:
            arguments = whole(arrays)
            ct = _reverse(arguments.inputs, saved, ct_out, want, arguments.setup)
            return _Arguments.of(ct, None)

        return Sweeps(forward, reverse)

    primal = lambda arrays: _forward(whole(arrays).inputs, anchoring)[:2]
    return differentiable(
        primal, sweeps, arrays, forward_error=FORWARD_MODE_ERROR,
        second_order_error=SECOND_ORDER_ERROR,
    )  # fmt: skip


def _forward(inputs: BacksolveInputs, anchoring: Anchoring | None):
    """The plain forward solve, storing step-end states on the way as `anchoring` says."""
    loop, state, outputs = inputs
    store = None if anchoring is None else anchoring.watch(state, loop.t_end)
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
    jumps = jump_stops(loop, init, final)
    # Jump stops first: at a time they share with another stop (the end of the step before a
    # jump time, saved), the jump time's cotangent takes `a` from the side after the jump.
    kinds = [*([jumps] if jumps is not None else []), *kinds]
    stops = Stops.make([*kinds, *([dense] if dense is not None else [])], init.t, init.y)
    backward = Backward(setup, loop, init, final, problem, diff, stops)
    g = jax.tree.map(jnp.zeros_like, diff)
    a = ct_final.y
    ct_t_end = _ct_t_end(problem, diff, final, ct_final)
    if loop.events is not None:
        a, g, ct_t_end = _terminal_event(loop, problem, diff, final, ct_final, ct_t_end)
    ct_jumps = None if jumps is None else jnp.zeros_like(loop.jump_ts)
    if setup.reconstruct_forward:
        (a, g, ct_jumps), stats = solve_with_forward_states(backward, stored, (a, g), ct_jumps)
    else:
        (a, g, ct_jumps), stats = solve_backwards(backward, (final.y, a, g), ct_jumps)
    if setup.on_backward is not None:
        _report(setup.on_backward, stats)
    a, g, ct_jumps = _checked(loop, final, stats, (a, g, ct_jumps), setup.failure)
    g_f, g_args = g
    grad_loop = dataclasses.replace(
        empty(loop), f=g_f, args=g_args, t_end=ct_t_end,
        ts=_ct_ts(loop, problem, diff, outputs, ct_outputs), jump_ts=ct_jumps,
    )  # fmt: skip
    ct_t0 = -pair(a, problem.f(init.t, init.y, diff)).astype(init.t.dtype)
    grad_init = dataclasses.replace(empty(init), y=a, t=ct_t0)
    return BacksolveInputs(grad_loop, grad_init, None)


def _checked(loop: IntegrationLoop, final: LoopState, stats: BackwardStats, a_g, message: str):
    """`a_g`, raising `message` (with `throw`) if the backward solve failed after a successful
    forward one, and NaN wherever either failed. A failed forward solve has NaN derivatives already
    (and raised, with `throw`): its backward solve fails too, and says nothing more."""
    forward_ok = loop.final_status(final) == Status.successful
    if loop.throw:
        a_g = eqx.error_if(a_g, forward_ok & ~stats.succeeded, message)
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
