"""The sweeps of the continuous adjoints' rule: a plain forward solve that stores a few states,
and a reverse sweep that solves the adjoint equations backwards."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._checks import all_finite
from ..._loop import IntegrationLoop, LoopState, Outputs
from .._base import while_loop
from .._custom_rule import RuleInputs, checked, loop_cotangent
from .._derivatives import OutputTimes, crossing_cotangents, pair, terminated
from .._on_backward import report
from ._backward import Backward, BackwardStats
from ._problem import Problem
from ._setup import BackwardSetup
from ._stops import JumpStops, Stops, dense_stops, jump_stops, output_stops


def forward(inputs: RuleInputs):
    """`((final state, outputs), saved)`: the plain forward solve, storing step-end states on
    the way as `BackwardSetup.forward_anchoring` says."""
    loop, state, outputs = inputs.full_loop, inputs.init, inputs.outputs
    anchoring = inputs.settings.forward_anchoring
    store = None if anchoring is None else anchoring.watch(state, loop.t_end)
    final, outputs, store = while_loop(loop, state, outputs, store)
    stored = None if store is None else store.stored
    return (final, outputs), (final, outputs, stored)


def reverse(inputs: RuleInputs, saved, ct_out, want: RuleInputs) -> RuleInputs:
    """The cotangents of `inputs` from those of the final state and the outputs: the adjoint
    equations solved backwards."""
    final, outputs, stored = saved
    loop, init, setup = inputs.full_loop, inputs.init, inputs.settings
    ct_final, ct_outputs = ct_out
    diff, nondiff = eqx.partition((loop.f, loop.args), eqx.is_inexact_array)
    # The parameter integral is solved wherever an array of the loop is differentiated, its
    # jump times included.
    if not (want.loop or want.jump_ts):
        diff, nondiff = jax.tree.map(lambda _: None, diff), (loop.f, loop.args)
    problem = Problem(nondiff)
    stops, jumps = _stops(loop, init, final, outputs, stored, ct_outputs, setup)
    backward = Backward(setup, loop, init, final, problem, diff, stops)
    rate = problem.f(final.t, final.y, diff)
    a, g = _at_end(loop, problem, diff, final, rate, ct_final)
    keep = None if loop.ts is None else jax.vmap(all_finite)(outputs.ts)
    field = lambda t, y: problem.f(t, y, diff)
    times = OutputTimes(rate, terminated(loop, final), field, loop.ts, outputs.ts, keep)
    ct_t_end, ct_ts = times.cotangents(loop.t_end, ct_final.t, ct_final.y, ct_outputs.ts)
    ct_jumps = None if jumps is None else jnp.zeros_like(jumps.jump_ts)
    (a, g, ct_jumps), stats = setup.solve(backward, stored, a, g, ct_jumps)
    if setup.on_backward is not None:
        report(setup.on_backward, stats, _describe)
    a, g, ct_jumps = checked((a, g, ct_jumps), loop, final, [(stats.succeeded, setup.failure)])
    g_f, g_args = g
    ct_loop = loop_cotangent(loop, f=g_f, args=g_args, t_end=ct_t_end, ts=ct_ts,
                             jump_ts=ct_jumps)  # fmt: skip
    ct_t0 = -pair(a, problem.f(init.t, init.y, diff)).astype(init.t.dtype)
    ct_init = dataclasses.replace(jax.tree.map(lambda _: None, init), y=a, t=ct_t0)
    return RuleInputs.of(ct_loop, ct_init, None)


def _stops(
    loop: IntegrationLoop, init: LoopState, final: LoopState, outputs: Outputs, stored,
    ct_outputs: Outputs, setup: BackwardSetup,
) -> tuple[Stops, JumpStops | None]:  # fmt: skip
    """The backward solve's `Stops`, and its stops at the jump times (`None`: none)."""
    kinds = output_stops(loop, final, outputs, stored, ct_outputs)
    if setup.solve.reads_forward_states:
        kinds = [kind for kind in kinds if kind.jump_a is not None]
    dense = dense_stops(loop, init, final, outputs, ct_outputs)
    jumps = jump_stops(loop, init, final)
    # Jump stops first: at a time they share with another stop (the end of the step before a
    # jump time, saved), the jump time's cotangent takes `a` from the side after the jump.
    kinds = [*([jumps] if jumps is not None else []), *kinds]
    stops = Stops.make([*kinds, *([dense] if dense is not None else [])], init.t, init.y)
    return stops, jumps


def _at_end(loop: IntegrationLoop, problem: Problem, diff, final: LoopState, rate, ct_final):
    """The adjoint and the parameter integral at the end of the solve: the final state's
    cotangent and zero; where a terminal event ended the solve at its crossing time `t*`,
    which moves with `y(t*)` and the parameters (`crossing_tangent`), the transposes of those
    moves, through which the loss sees `t*` (Chen, Amos & Nickel, ICLR 2021)."""
    g = jax.tree.map(jnp.zeros_like, diff)
    events = loop.events
    if events is None:
        return ct_final.y, g
    assert final.events is not None  # carried wherever the loop has events
    index = jnp.maximum(final.events.event, 0)

    def value(t, y, d):
        _, args = eqx.combine(d, problem.nondiff)
        return events.values(t, y, args)[index]

    at_event = crossing_cotangents(value, final.t, final.y, diff, rate, ct_final.t, ct_final.y)
    fired = terminated(loop, final)
    pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(fired, a, b), new, old)
    return pick(at_event, (ct_final.y, g))


def _describe(stats: BackwardStats) -> dict:
    """What `on_backward` receives: the statistics as the Python values it documents."""
    accepted, rejected = stats.num_accepted.item(), stats.num_rejected.item()
    return {
        "num_backward_steps": accepted + rejected,
        "num_accepted_backward_steps": accepted,
        "num_rejected_backward_steps": rejected,
        "num_window_solves": stats.num_window_solves.item(),
        "max_drift": stats.max_drift.item(),
        "succeeded": stats.succeeded.item(),
    }
