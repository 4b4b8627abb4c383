"""`BacksolveAdjoint`'s custom VJP: a plain forward solve that stores a few states, and a
backward pass that solves the adjoint equations."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._checks import all_finite
from ..._integrate import IntegrationLoop
from ..._loop_state import LoopState
from ..._outputs import Outputs, Writes
from ..._status import Status
from .._base import AbstractWatch, while_loop
from ._backward import Backward, BackwardStats, solve_backwards, solve_with_forward_states
from ._problem import Problem, has_ct, pair, zeros_for_none
from ._setup import BackwardSetup
from ._stops import Stops, StoredStates, dense_stops, output_stops

_BACKWARD_FAILED = (
    "BacksolveAdjoint: the backward (adjoint) solve failed (max_steps reached, step size "
    "underflow or a non-finite adjoint). Fix: raise `max_steps`, loosen the backward `rtol`/"
    "`atol`, re-anchor with `BacksolveAdjoint(checkpoints=...)`, or use "
    "`RecursiveCheckpointAdjoint`, whose gradients do not solve a backward ODE."
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


def _forward(loop: IntegrationLoop, state: LoopState, outputs: Outputs, checkpoints: int | None):
    """The plain forward solve, storing `checkpoints` step-end states on the way."""
    store = None if checkpoints is None else _Store.make(checkpoints, state, loop.t_end)
    final, outputs, store = while_loop(loop, state, outputs, store)
    return final, outputs, None if store is None else store.stored


@eqx.filter_custom_vjp
def backsolve(inputs, setup: BackwardSetup, checkpoints: int | None):
    """`(final state, outputs)` of the loop run from `inputs = (loop, state, outputs)`,
    differentiated by solving the adjoint equations backwards."""
    loop, state, outputs = inputs
    final, outputs, _ = _forward(loop, state, outputs, checkpoints)
    return final, outputs


@backsolve.def_fwd
def _backsolve_fwd(perturbed, inputs, setup: BackwardSetup, checkpoints: int | None):
    del perturbed
    loop, state, outputs = inputs
    final, outputs, stored = _forward(loop, state, outputs, checkpoints)
    return (final, outputs), (final, outputs, stored)


@backsolve.def_bwd
def _backsolve_bwd(residuals, ct, perturbed, inputs, setup: BackwardSetup, checkpoints):
    del checkpoints
    final, outputs, stored = residuals
    loop, init, _ = inputs
    ct_final, ct_outputs = ct
    none = lambda tree: jax.tree.map(lambda _: None, tree)
    ct_outputs = none(outputs) if ct_outputs is None else ct_outputs
    ct_final = none(final) if ct_final is None else ct_final
    p_loop, p_init, _ = perturbed
    diff, nondiff = eqx.partition((loop.f, loop.args), (p_loop.f, p_loop.args))
    problem = Problem(nondiff)
    ct_y1 = zeros_for_none(ct_final.y, final.y)
    kinds = output_stops(loop, final, outputs, stored, ct_outputs)
    if setup.reconstruct_forward:
        kinds = [kind for kind in kinds if kind.jump_a is not None]
    dense = dense_stops(loop, init, final, outputs, ct_outputs)
    stops = Stops.make([*kinds, *([dense] if dense is not None else [])], init.t)
    backward = Backward(setup, loop, init, final, problem, diff, stops)
    g = jax.tree.map(jnp.zeros_like, diff)
    if setup.reconstruct_forward:
        (a, g), stats = solve_with_forward_states(backward, stored, (ct_y1, g))
    else:
        (a, g), stats = solve_backwards(backward, (final.y, ct_y1, g))
    if setup.on_backward is not None:
        _report(setup.on_backward, stats)
    a, g = _checked(loop, final, stats, (a, g))
    g_f, g_args = g
    grad_loop = dataclasses.replace(
        none(loop), f=g_f, args=g_args, t_end=_ct_t_end(p_loop, problem, diff, final, ct_final),
        ts=_ct_ts(loop, p_loop, problem, diff, outputs, ct_outputs),
    )  # fmt: skip
    ct_t0 = None
    if p_init.t:
        ct_t0 = -pair(a, problem.f(init.t, init.y, diff)).astype(init.t.dtype)
    grad_init = dataclasses.replace(none(init), y=a, t=ct_t0)
    return grad_loop, grad_init, none(inputs[2])


def _checked(loop: IntegrationLoop, final: LoopState, stats: BackwardStats, a_g):
    """`a_g`, raising (with `throw`) if the backward solve failed after a successful forward
    one, and NaN wherever either failed. A failed forward solve has NaN derivatives already
    (and raised, with `throw`): its backward solve fails too, and says nothing more."""
    forward_ok = loop.final_status(final) == Status.successful
    if loop.throw:
        a_g = eqx.error_if(a_g, forward_ok & ~stats.succeeded, _BACKWARD_FAILED)
    failed = ~(forward_ok & stats.succeeded)
    return jax.tree.map(lambda x: jnp.where(failed, jnp.nan, x), a_g)


def _ct_t_end(p_loop, problem: Problem, diff, final: LoopState, ct_final):
    """`dL/dt1 = <dL/dy(t1), f(t1, y(t1))>` (plus the cotangent of the final time itself)."""
    if not p_loop.t_end:
        return None
    ct_y1 = zeros_for_none(ct_final.y, final.y)
    ct = pair(ct_y1, problem.f(final.t, final.y, diff)).astype(final.t.dtype)
    return ct if ct_final.t is None else ct + ct_final.t


def _ct_ts(loop: IntegrationLoop, p_loop, problem: Problem, diff, outputs: Outputs, ct: Outputs):
    """`dL/dts_i = <dL/dy(ts_i), f(ts_i, y(ts_i))>` for the save times (0 for unreached ones)."""
    if loop.ts is None or not p_loop.ts or not has_ct(ct.ts):
        return None
    ct_ys = zeros_for_none(ct.ts, outputs.ts)
    rate = lambda t, y, c: pair(c, problem.f(t, y, diff))
    values = jax.vmap(rate)(loop.ts, outputs.ts, ct_ys).astype(loop.ts.dtype)
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
                "num_forward_resolves": stats.num_resolves.item(),
                "succeeded": stats.succeeded.item(),
            }
        )

    jax.debug.callback(on_host, stats)
