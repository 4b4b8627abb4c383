"""The differentiable wrapper around the engine: one custom VJP per regime."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _tree
from ._loop import Loop, forward, reverse
from ._vmap import any_lane
from .schedules import Plan, offline_schedule, online_schedule


def _zero_cotangent(struct):
    def leaf(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.zeros(x.shape, x.dtype)
        return np.zeros(x.shape, jax.dtypes.float0)

    return jtu.tree_map(leaf, struct)


def _fill(ct, struct):
    """Cotangents for every leaf of `struct`: `ct` where given, zeros (or float0) elsewhere."""
    zeros = _zero_cotangent(struct)
    if ct is None:
        return zeros
    return jtu.tree_map(lambda z, c: z if c is None else c, zeros, ct, is_leaf=lambda x: x is None)


def run(loop: Loop, plan: Plan, params, init, xs, buffers):
    """Run `loop` from `init` and return `(state, buffers)`, differentiable as `plan` says."""
    if plan.regime == "residuals":
        return _run_residuals(loop, params, init, xs, buffers)
    c = plan.checkpoints
    if plan.online:
        schedule = online_schedule(loop.steps, c)
    else:
        schedule = offline_schedule(loop.steps, c)
    structs = jax.eval_shape(lambda: (params, init, xs, buffers))

    @jax.custom_vjp
    def _run(params, init, xs, buffers):
        state, buffers, _ = forward(loop, params, init, xs, buffers, None)
        return state, buffers

    def _fwd(params, init, xs, buffers):
        state, buffers, res = forward(loop, params, init, xs, buffers, schedule)
        return (state, buffers), (params, xs, res)

    def _bwd(saved, cts):
        params, xs, res = saved
        ct_state, ct_buffers = cts
        ct_state = _tree.split_inexact(ct_state)[0]
        ct_buffers = _tree.split_inexact(ct_buffers)[0]
        out = reverse(loop, params, xs, res, ct_state, ct_buffers, c)
        return tuple(_fill(ct, s) for ct, s in zip(out, structs, strict=True))

    _run.defvjp(_fwd, _bwd)
    return _run(params, init, xs, buffers)


def _run_residuals(loop: Loop, params, init, xs, buffers):
    """Store the VJP residuals of every step: `jax.vjp` of a masked `lax.scan`.

    Scans take `lax.scan` directly (see `checkpointed_scan`); this serves while loops, whose
    primal still stops early.
    """
    del xs

    @jax.custom_vjp
    def _run(params, init, buffers):
        state, buffers, _ = forward(loop, params, init, None, buffers, None)
        return state, buffers

    def _fwd(params, init, buffers):
        out, vjp_fn = jax.vjp(lambda *a: _scan(loop, *a[:2], None, a[2]), params, init, buffers)
        return out, vjp_fn

    def _bwd(vjp_fn, cts):
        return vjp_fn(cts)

    _run.defvjp(_fwd, _bwd)
    return _run(params, init, buffers)


def _scan(loop: Loop, params, init, xs, buffers):
    """`lax.scan` over all `max_steps`; past the stop, a cheap skip keyed on `any_lane`."""
    del xs

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
    """Closure-convert `fn`: `(arrays, static)` so the arrays can cross the custom VJP."""
    converted = eqx.filter_closure_convert(fn, *example_args)
    return eqx.partition(converted, eqx.is_array)
