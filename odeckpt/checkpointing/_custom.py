"""The differentiable wrapper: a `custom_jvp` whose tangent is a `linear_call`.

Forward mode evaluates a forward-mode loop; reverse mode transposes the `linear_call`, which runs
the regime's reverse sweep on residuals computed by the primal pass (snapshots, or the VJP
residuals of every step).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _tree
from ._linear import linear_call
from ._loop import Loop, forward, reverse
from ._vmap import any_lane
from .schedules import Plan, offline_schedule, online_schedule


def _float0_fill(part, struct):
    """`part` (inexact leaves, `None` elsewhere) completed with float0/zero leaves of `struct`."""

    def leaf(p, s):
        if p is not None or s is None:
            return p
        if jnp.issubdtype(s.dtype, jnp.inexact):
            return jnp.zeros(s.shape, s.dtype)
        return np.zeros(s.shape, jax.dtypes.float0)

    return jtu.tree_map(leaf, part, struct, is_leaf=lambda x: x is None)


def _inexact_part(tree):
    return _tree.split_inexact(tree)[0]


def run(loop: Loop, plan: Plan, params, init, xs, buffers):
    """Run `loop` from `init`, returning `(state, buffers)`, differentiable as `plan` says."""
    primal = lambda *args: forward(loop, *args, None)[:2]
    if plan.regime == "residuals":
        fwd, bwd = _residuals(loop)
    else:
        fwd, bwd = _snapshots(loop, plan)

    @jax.custom_jvp
    def _run(params, init, xs, buffers):
        return primal(params, init, xs, buffers)

    @_run.defjvp
    def _run_jvp(primals, tangents):
        out, saved = fwd(*primals)
        structs = jax.eval_shape(lambda: (primals, out))
        lin_leaves, lin_def = jtu.tree_flatten(_inexact_part(tangents))
        res_leaves, res_def = jtu.tree_flatten((primals, saved))
        out_def = jtu.tree_structure(_inexact_part(out))

        def tangent(res_leaves, lin_leaves):
            primals, _ = jtu.tree_unflatten(res_def, res_leaves)
            t = _float0_fill(jtu.tree_unflatten(lin_def, lin_leaves), structs[0])
            return jtu.tree_leaves(_inexact_part(jax.jvp(primal, primals, t)[1]))

        def transpose(res_leaves, ct_leaves):
            primals, saved = jtu.tree_unflatten(res_def, res_leaves)
            ct = jtu.tree_unflatten(out_def, ct_leaves)
            return jtu.tree_leaves(bwd(primals, saved, ct, structs[1]))

        out_t = linear_call(tangent, transpose, res_leaves, lin_leaves)
        return out, _float0_fill(jtu.tree_unflatten(out_def, out_t), structs[1])

    return _run(params, init, xs, buffers)


def _snapshots(loop: Loop, plan: Plan) -> tuple[Callable, Callable]:
    """Snapshots of the state, replayed by the reverse sweep (states or binomial regimes)."""
    c = plan.checkpoints
    schedule = (online_schedule if plan.online else offline_schedule)(loop.steps, c)

    def fwd(params, init, xs, buffers):
        state, buffers, saved = forward(loop, params, init, xs, buffers, schedule)
        return (state, buffers), saved

    def bwd(primals, saved, ct, out_structs):
        del out_structs
        params, _, xs, _ = primals
        ct_state, ct_buffers = ct
        return reverse(loop, params, xs, saved, ct_state, ct_buffers, c)

    return fwd, bwd


def _residuals(loop: Loop) -> tuple[Callable, Callable]:
    """The VJP residuals of every step: `jax.vjp` of a masked `lax.scan` (while loops only).

    Scans use `lax.scan` directly (see `checkpointed_scan`).
    """

    def fwd(params, init, xs, buffers):
        del xs
        return jax.vjp(lambda p, i, b: _masked_scan(loop, p, i, b), params, init, buffers)

    def bwd(primals, vjp_fn, ct, out_structs):
        del primals
        ct_p, ct_i, ct_b = vjp_fn(_float0_fill(ct, out_structs))
        return _inexact_part(ct_p), _inexact_part(ct_i), None, _inexact_part(ct_b)

    return fwd, bwd


def _masked_scan(loop: Loop, params, init, buffers):
    """`lax.scan` over all `max_steps`; past the stop, a cheap skip keyed on `any_lane`."""

    def body(carry, _):
        i, state, buffers, pred = carry

        def advance(state, buffers):
            new, idx, values = loop.step(params, state, None, i)
            return new, _tree.write(buffers, idx, values)

        state, buffers = lax.cond(any_lane(pred), advance, lambda s, b: (s, b), state, buffers)
        return (i + 1, state, buffers, loop.cond(params, state)), None

    carry = (jnp.array(0, jnp.int32), init, buffers, loop.cond(params, init))
    (_, state, buffers, _), _ = lax.scan(body, carry, None, length=loop.steps)
    return state, buffers


def convert(fn, *example_args):
    """Closure-convert `fn`: `(arrays, static)` so the arrays can cross the custom JVP."""
    converted = eqx.filter_closure_convert(fn, *example_args)
    return eqx.partition(converted, eqx.is_array)
