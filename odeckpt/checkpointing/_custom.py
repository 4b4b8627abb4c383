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
from jax.custom_derivatives import SymbolicZero

from . import _offload, _tree
from ._linear import linear_call
from ._loop import Loop, forward, reverse
from ._vmap import any_lane
from .schedules import Plan, offline_schedule, online_schedule


def _float0_fill(part, struct):
    """`part` (inexact leaves, `None` elsewhere) completed with float0/zero leaves of `struct`."""

    return jtu.tree_map(lambda p, s: _zero(s) if p is None else p, part, struct, is_leaf=_none)


def _inexact_part(tree):
    return _tree.split_inexact(tree)[0]


def _none(x) -> bool:
    return x is None


def _leaves(tree) -> list:
    """Leaves with `None` kept as a leaf, aligned with the leaves of the full structure."""
    return jtu.tree_leaves(tree, is_leaf=_none)


def _aligned(part, struct) -> list:
    """`part`'s leaves (or `None`s) aligned with `_leaves(struct)`."""
    return [None] * len(_leaves(struct)) if part is None else _leaves(part)


def _zero(s):
    if s is None:
        return None
    if jnp.issubdtype(s.dtype, jnp.inexact):
        return jnp.zeros(s.shape, s.dtype)
    return np.zeros(s.shape, jax.dtypes.float0)


def run(loop: Loop, plan: Plan | Callable[[], Plan], params, init, xs, buffers):
    """Run `loop` from `init`, returning `(state, buffers)`, differentiable as `plan` says
    (`plan` may be a function making it, called only when the loop is differentiated)."""
    primal = lambda *args: forward(loop, *args, None)[:2]

    def fwd_bwd() -> tuple[Callable, Callable]:
        the_plan = plan if isinstance(plan, Plan) else plan()
        if the_plan.regime == "residuals":
            return _residuals(loop)
        return _snapshots(loop, the_plan)

    @jax.custom_jvp
    def _run(params, init, xs, buffers):
        return primal(params, init, xs, buffers)

    def _run_jvp(primals, tangents):
        # Symbolic zeros: inputs nobody differentiates (a constant `xs`, closed-over constants)
        # get no tangent, so the transpose builds no cotangent buffer for them.
        is_zero = lambda t: isinstance(t, SymbolicZero)
        tangents = jtu.tree_map(lambda t: None if is_zero(t) else t, tangents, is_leaf=is_zero)
        fwd, bwd = fwd_bwd()
        out, saved = fwd(*primals)
        structs = jax.eval_shape(lambda: (primals, out))
        selected = [
            t is not None and _tree.is_inexact(p)
            for t, p in zip(_leaves(tangents), _leaves(primals), strict=True)
        ]
        lin_leaves = [t for t, keep in zip(_leaves(tangents), selected, strict=True) if keep]
        res_leaves, res_def = jtu.tree_flatten((primals, saved))
        out_def = jtu.tree_structure(_inexact_part(out))
        want = tuple(len(jtu.tree_leaves(_inexact_part(tangents[j]))) > 0 for j in (0, 2))

        def tangent(res_leaves, lin_leaves):
            primals, _ = jtu.tree_unflatten(res_def, res_leaves)
            it = iter(lin_leaves)
            t = [next(it) if keep else None for keep in selected]
            t = jtu.tree_unflatten(jtu.tree_structure(structs[0], is_leaf=_none), t)
            t = _float0_fill(t, structs[0])
            return jtu.tree_leaves(_inexact_part(jax.jvp(primal, primals, t)[1]))

        def transpose(res_leaves, ct_leaves):
            primals, saved = jtu.tree_unflatten(res_def, res_leaves)
            ct = jtu.tree_unflatten(out_def, ct_leaves)
            cts = bwd(primals, saved, ct, structs[1], want)
            flat = [_aligned(c, p) for c, p in zip(cts, structs[0], strict=True)]
            flat = [x for part in flat for x in part]
            zeros = [_zero(p) for p in _leaves(structs[0])]
            return [
                z if c is None else c
                for c, z, keep in zip(flat, zeros, selected, strict=True)
                if keep
            ]

        # The tangents of the inexact outputs have the outputs' shapes and dtypes.
        out_avals = jtu.tree_leaves(_inexact_part(structs[1]))
        out_t = linear_call(tangent, transpose, res_leaves, lin_leaves, out_avals)
        return out, _float0_fill(jtu.tree_unflatten(out_def, out_t), structs[1])

    _run.defjvp(_run_jvp, symbolic_zeros=True)
    return _run(params, init, xs, buffers)


def _snapshots(loop: Loop, plan: Plan) -> tuple[Callable, Callable]:
    """Snapshots of the state, replayed by the reverse sweep (states or binomial regimes)."""
    if plan.offload is not None:
        return _offloaded(loop, plan)
    c = plan.checkpoints
    schedule = (online_schedule if plan.online else offline_schedule)(loop.steps, c)
    # With a slot for every step the forward sweep stores every state: nothing to split.
    binomials = schedule.binomials if c < loop.steps else None

    def fwd(params, init, xs, buffers):
        state, buffers, saved = forward(loop, params, init, xs, buffers, schedule)
        return (state, buffers), saved

    def bwd(primals, saved, ct, out_structs, want):
        del out_structs
        params, _, xs, _ = primals
        ct_state, ct_buffers = ct
        return reverse(loop, params, xs, saved, ct_state, ct_buffers, c, binomials, want)

    return fwd, bwd


def _offloaded(loop: Loop, plan: Plan) -> tuple[Callable, Callable]:
    """Snapshots every `plan.segment` steps in host memory, Revolve on the device between."""
    segment, c = plan.segment, plan.checkpoints

    def fwd(params, init, xs, buffers):
        slots = plan.host_checkpoints
        state, buffers, saved = _offload.forward(loop, params, init, xs, buffers, segment, slots)
        return (state, buffers), saved

    def bwd(primals, saved, ct, out_structs, want):
        del out_structs
        params, _, xs, _ = primals
        ct_state, ct_buffers = ct
        return _offload.reverse(loop, params, xs, saved, ct_state, ct_buffers, segment, c, want)

    return fwd, bwd


def _residuals(loop: Loop) -> tuple[Callable, Callable]:
    """The VJP residuals of every step: `jax.vjp` of a masked `lax.scan` (while loops only).

    Scans use `lax.scan` directly (see `checkpointed_scan`).
    """

    def fwd(params, init, xs, buffers):
        del xs
        return jax.vjp(lambda p, i, b: _masked_scan(loop, p, i, b), params, init, buffers)

    def bwd(primals, vjp_fn, ct, out_structs, want):
        del primals, want
        ct_p, ct_i, ct_b = vjp_fn(_float0_fill(ct, out_structs))
        return _inexact_part(ct_p), _inexact_part(ct_i), None, _inexact_part(ct_b)

    return fwd, bwd


def _masked_scan(loop: Loop, params, init, buffers):
    """`lax.scan` over all `max_steps`; past the stop, a cheap skip keyed on `any_lane`."""

    def body(carry, _):
        i, state, buffers, pred = carry

        def advance(state, buffers):
            new, idx, values, _ = loop.step(params, state, None, i)
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
