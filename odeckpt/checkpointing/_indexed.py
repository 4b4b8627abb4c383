"""`indexed_scan`: a scan whose step `i` takes its parameters from `params[i]`, one of `k`
separate pytrees of one structure, rematerialised in the backward pass.

Stacking the parameters of `k` layers into `[k, ...]` arrays for `lax.scan` copies them, and the
scan's gradient is then a stacked `[k, ...]` array split into the per-layer gradients: two extra
copies of the parameters (12 blocks of 2 MiB: 52 MiB plain chain, 68 MiB stacked). Here the scan
selects layer `i`'s parameters with `lax.switch` (one layer's copy at a time), and the reverse
pass writes each layer's gradient into its own accumulator, one `lax.cond` per layer, which XLA
updates in place and hands out as the gradient itself (24 MiB). The reverse pass stores every
step's input and recomputes one step at a time, in a loop, so the saving does not depend on the
compiler's scheduling (XLA:CPU reorders the recomputation of straight-line `jax.checkpoint`s).

Differentiable in both modes, as the engine is: a `custom_jvp` whose tangent is a `linear_call`
(forward mode: `jax.jvp` of the scan; reverse mode: the loop above), also under `vmap`.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from . import _tree
from ._linear import linear_call


def _none(x) -> bool:
    return x is None


def _leaves(tree) -> list:
    """Leaves with `None` kept as a leaf, aligned with the leaves of a partitioned tree."""
    return jtu.tree_leaves(tree, is_leaf=_none)


def _zero(x):
    """A zero tangent (or cotangent) for a leaf like `x`: float0 for non-inexact leaves."""
    if _tree.is_inexact(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def select(params: tuple, i):
    """`params[i]` for a traced `i`: a copy of one entry, never a stack of all of them."""
    return lax.switch(i, [lambda p=p: p for p in params])


def store(entries: tuple, value, i) -> tuple:
    """`entries` with `entries[i]` replaced by `value`, for a traced `i`. One `lax.cond` per
    entry: XLA updates each entry's buffer in place (a `lax.switch` over the whole tuple
    copies every entry)."""
    keep = lambda e: e
    return tuple(lax.cond(i == j, lambda e: value, keep, e) for j, e in enumerate(entries))


def _forward(step: Callable, consts, params: tuple, init, xs, save: bool):
    """`lax.scan` of `step(consts, params[i], carry, xs[i]) -> (carry, y)`; returns
    `((carry, ys), inputs)`, `inputs` the stacked carry entering each step (`None` unless
    `save`)."""

    def body(carry, inputs):
        i, x = inputs
        new, y = step(consts, select(params, i), carry, x)
        return new, (y, carry if save else None)

    out, (ys, inputs) = lax.scan(body, init, (jnp.arange(len(params)), xs))
    return (out, ys), inputs


def _reverse(step: Callable, primals: tuple, inputs, ct_out, want: tuple[bool, bool, bool]):
    """The cotangents of `primals = (consts, params, init, xs)` (inexact parts, `None`
    elsewhere) from those of `(carry, ys)`: step `i` is recomputed from its stored input and
    differentiated, from the last to the first. `want`: whether the cotangents of `consts`,
    `params` and `xs` are needed."""
    consts, params, _, xs = primals
    want_consts, want_params, want_xs = want
    ct_carry, ct_ys = ct_out
    k = len(params)
    k_f, k_rest = _tree.split_inexact(consts)
    ct_k = _tree.zeros_like(k_f) if want_consts else None
    acc = tuple(_tree.zeros_like(_tree.split_inexact(p)[0]) for p in params)
    acc = acc if want_params else None
    ct_xs = _tree.zeros_like(_tree.split_inexact(xs)[0]) if want_xs else None

    def body(r, carry):
        g, ct_k, acc, ct_xs = carry
        i = k - 1 - r
        p_f, p_rest = _tree.split_inexact(select(params, i))
        c_f, c_rest = _tree.split_inexact(_tree.index(inputs, i))
        x_f, x_rest = _tree.split_inexact(_tree.index(xs, i))

        def f(kk, p, c, x):
            kk = kk if want_consts else k_f
            p = p if want_params else p_f
            x = x if want_xs else x_f
            new, y = step(eqx.combine(kk, k_rest), eqx.combine(p, p_rest),
                          eqx.combine(c, c_rest), eqx.combine(x, x_rest))  # fmt: skip
            return _tree.split_inexact(new)[0], _tree.split_inexact(y)[0]

        diff = (k_f if want_consts else None, p_f if want_params else None, c_f,
                x_f if want_xs else None)  # fmt: skip
        ct_ki, ct_p, g, ct_x = jax.vjp(f, *diff)[1]((g, _tree.index(ct_ys, i)))
        ct_k = _tree.add(ct_k, ct_ki) if want_consts else None
        acc = store(acc, ct_p, i) if want_params else None
        ct_xs = _tree.update(ct_xs, ct_x, i) if want_xs else None
        return g, ct_k, acc, ct_xs

    g, ct_k, acc, ct_xs = lax.fori_loop(0, k, body, (ct_carry, ct_k, acc, ct_xs))
    return ct_k, acc, g, ct_xs


def indexed_scan(step: Callable, params: tuple, init, xs, policy: Callable | None = None):
    """`lax.scan` over `i < k = len(params)` of `step(params[i], carry, xs[i]) -> (carry, y)`,
    each step rematerialised in the backward pass; returns `(carry, ys)`.

    `params` are `k` pytrees of one structure (the parameters of `k` layers, kept apart: their
    gradients come back in the same `k` pytrees); `xs` are per-step inputs stacked along a
    leading axis `k` (keys, state), or `None`. The reverse pass stores the `k` carries entering
    the steps and recomputes one step at a time. With a `jax.checkpoint` `policy`, the values
    it names are stored as well (a `lax.scan` over `jax.checkpoint(step, policy=policy)`).
    """
    if policy is not None:

        def body(carry, inputs):
            i, x = inputs
            return step(select(params, i), carry, x)

        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        return lax.scan(body, init, (jnp.arange(len(params)), xs))
    # Values the step closes over (a layer holding a traced array in a closure) cross the
    # custom JVP as `consts`, an input shared by every step.
    init = _tree.strong(init)
    converted = eqx.filter_closure_convert(step, params[0], init, _tree.index(xs, 0))
    consts, static = eqx.partition(converted, eqx.is_array)
    closed = lambda consts, p, carry, x: eqx.combine(consts, static)(p, carry, x)
    primal = lambda *primals: _forward(closed, *primals, save=False)[0]

    @jax.custom_jvp
    def scan(consts, params, init, xs):
        return primal(consts, params, init, xs)

    def scan_jvp(primals, tangents):
        out, inputs = _forward(closed, *primals, save=True)
        zero = lambda t: isinstance(t, SymbolicZero)
        p_leaves = _leaves(primals)
        t_leaves = jtu.tree_leaves(tangents, is_leaf=lambda t: zero(t) or t is None)
        linear = [
            p is not None and _tree.is_inexact(p) and not zero(t)
            for p, t in zip(p_leaves, t_leaves, strict=True)
        ]
        groups = [len(_leaves(part)) for part in primals]
        bounds = np.cumsum([0, *groups])
        want = tuple(any(linear[bounds[j] : bounds[j + 1]]) for j in (0, 1, 3))
        res_leaves, res_def = jtu.tree_flatten((primals, inputs))
        out_f, _ = _tree.split_inexact(out)
        out_def = jtu.tree_structure(out_f, is_leaf=_none)
        p_def = jtu.tree_structure(primals, is_leaf=_none)

        def tangent(res_leaves, lin_leaves):
            primals, _ = jtu.tree_unflatten(res_def, res_leaves)
            it = iter(lin_leaves)
            pairs = zip(_leaves(primals), linear, strict=True)
            t = [next(it) if keep else _zero_or_none(p) for p, keep in pairs]
            t_out = jax.jvp(primal, primals, jtu.tree_unflatten(p_def, t))[1]
            return jtu.tree_leaves(_tree.split_inexact(t_out)[0])

        def transpose(res_leaves, ct_leaves):
            primals, inputs = jtu.tree_unflatten(res_def, res_leaves)
            ct_out = jtu.tree_unflatten(out_def, _fill(_leaves(out_f), ct_leaves))
            cts = _reverse(closed, primals, inputs, ct_out, want)
            flat = [x for c, p in zip(cts, primals, strict=True) for x in _aligned(c, p)]
            return [
                _zero(p) if c is None else c
                for c, p, keep in zip(flat, _leaves(primals), linear, strict=True)
                if keep
            ]

        lin_leaves = [t for t, keep in zip(t_leaves, linear, strict=True) if keep]
        out_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jtu.tree_leaves(out_f)]
        out_t = linear_call(tangent, transpose, res_leaves, lin_leaves, out_avals)
        out_t = jtu.tree_unflatten(out_def, _fill(_leaves(out_f), out_t))
        return out, _complete(out_t, out)

    scan.defjvp(scan_jvp, symbolic_zeros=True)
    return scan(consts, params, init, xs)


def _zero_or_none(p):
    return None if p is None else _zero(p)


def _fill(pattern: list, values: list) -> list:
    """`values` put in the non-`None` places of `pattern`."""
    it = iter(values)
    return [None if p is None else next(it) for p in pattern]


def _aligned(part, primal) -> list:
    """The leaves of `part` (a partition of `primal`, or `None`) aligned with `_leaves(primal)`."""
    return [None] * len(_leaves(primal)) if part is None else _leaves(part)


def _complete(part, full: Any):
    """`part` (inexact leaves, `None` elsewhere) completed with float0 zeros for `full`."""
    return jtu.tree_map(
        lambda p, x: _zero_or_none(x) if p is None else p, part, full, is_leaf=_none
    )
