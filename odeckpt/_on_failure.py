"""What a failed solve's outputs do: raise (`throw=True`), turn to NaN (`EQX_ON_ERROR=nan`), and
carry NaN derivatives whatever `throw` says, so that no gradient of a failed solve is finite.

A solve whose status is known when `solve` returns (outside `jit` and `vmap`, under `jax.grad`
too) raises in Python from `solve`, so that the traceback ends at the call that failed. Inside a
traced program the status is known only at run time: the error comes through `_errors`, and its
message names the line of the call, because JAX reuses traces and the traceback equinox records at
trace time can be another call's (see docs/failures.md).
"""

import dataclasses
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp

from ._errors import raising
from ._failure_message import Failure, Stop, call_site
from ._solution import Solution
from ._status import Status
from ._types import BoolScalar, Scalar


class Solved(eqx.Module):
    """What the compiled solve returns: its `solution`, and the time `t_stop` where it stopped
    (for the message of a failure)."""

    solution: Solution
    t_stop: Scalar


def raised(solved: Solved, failure: Failure, throw: bool) -> Solution:
    """The solution, raising with the `failure`'s message if `throw` and the solve failed: in
    Python, saying where the solve stopped, when its status is known; otherwise at run time
    through `raise_if_failed`, naming the call (the failed outputs are NaN instead under
    `EQX_ON_ERROR=nan`)."""
    sol = solved.solution
    status = sol.status
    if not throw:
        return sol
    if not status.is_traced() and status.shape == () and raising():
        if status.name == "successful":
            return sol
        where = (solved.t_stop, sol.t0, sol.t1, sol.stats.num_steps, sol.stats.num_rejected_steps)
        stop = None
        if not any(isinstance(x, jax.core.Tracer) for x in where):
            # (Under `jax.grad` in `t0` or `t1` the times are traced where the status is not.)
            t, t0, t1, steps, rejected = where
            stop = Stop(float(t), float(t0), float(t1), int(steps), int(rejected))
        raise eqx.EquinoxRuntimeError(failure.message(status.name, stop))
    messages = failure.messages(call_site())
    ts, ys, dense = raise_if_failed(status, (sol.ts, sol.ys, sol.dense), messages=messages)
    return dataclasses.replace(sol, ts=ts, ys=ys, dense=dense)


def raise_if_failed(
    status: Status,
    tree,
    note: Mapping[str, str] | None = None,
    *,
    messages: Mapping[str, str] | None = None,
):
    """`tree` unchanged; raises at run time (through `Status.error_if`, so as `_errors` decides:
    a host callback, or after the call under `odeckpt.jit`) if the solve failed. Under
    `EQX_ON_ERROR=nan` its inexact leaves are NaN instead. `messages` replaces the messages of
    the outcomes it names, and `note` appends text to them.

    The check runs on a floating scalar and reaches `tree` through an exact `x - 0`, instead of
    passing `tree` through the check's `lax.cond`: equinox's checks (under `EQX_ON_ERROR=nan`
    or `breakpoint`, and on TPUs) pass their token through one, and XLA places a `cond` that
    holds a host callback on one device, where it would gather a sharded state (see
    docs/scaling.md). A floating scalar (never an integer) carries the NaN of
    `EQX_ON_ERROR=nan` to every leaf."""
    failed = status != Status.successful
    messages, note = messages or {}, note or {}
    messages = {
        name: messages.get(name, Status.outcome(name).message) + note.get(name, "")
        for name in Status.names()
    }
    inexact = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    if not inexact:
        return status.error_if(tree, failed, messages=messages)
    real = jnp.result_type(*[jnp.finfo(x.dtype).dtype for x in inexact])
    zero = status.error_if(jnp.zeros((), real), failed, messages=messages)

    def leaf(x):
        if not eqx.is_inexact_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            return x - jax.lax.complex(zero, zero).astype(x.dtype)
        return x - zero.astype(x.dtype)

    return jax.tree.map(leaf, tree)


@jax.custom_jvp
def _nan_tangents_if(failed: BoolScalar, x: jax.Array, inputs: list) -> jax.Array:
    del failed, inputs
    return x


@_nan_tangents_if.defjvp
def _nan_tangents_if_jvp(primals, tangents):
    failed, x, _ = primals
    _, dx, d_inputs = tangents
    # Linear in the tangents, so reverse mode transposes it: a NaN cotangent for a failed solve.
    scale = jnp.where(failed, jnp.nan, 1).astype(dx.dtype)
    dx = dx * scale
    if d_inputs:
        # An output that does not depend on the inputs in the discrete solve (the time where a
        # failed solve stopped) still gets NaN derivatives in them: a NaN times their tangents.
        poison = jnp.where(failed, jnp.nan, 0).astype(jnp.finfo(dx.dtype).dtype)
        total = sum(jnp.sum(jnp.real(d)) for d in d_inputs)
        dx = dx + (poison * total).astype(dx.dtype)
    return x, dx


def nan_derivatives_if(failed: BoolScalar, tree, inputs=None):
    """`tree` unchanged, with every derivative through its inexact leaves NaN where `failed`
    (per lane under `vmap`; exact elsewhere), also in the inexact leaves of `inputs` (the
    solve's inputs) where the discrete solve does not depend on them."""
    leaves = [x for x in jax.tree.leaves(inputs) if eqx.is_inexact_array(x)]
    return jax.tree.map(
        lambda x: _nan_tangents_if(failed, x, leaves) if eqx.is_inexact_array(x) else x, tree
    )
