"""`indexed_scan`: a scan whose step `i` takes its parameters from `params[i]`, one of `k`
separate pytrees of one structure, rematerialised in the backward pass (see "The indexed scan"
in `docs/checkpointing.md`).
"""

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

from .._autodiff import Sweeps, _tree, cond, convert, differentiable, scan, switch


class _Operands(NamedTuple):
    """What an indexed scan is differentiated with respect to: the arrays its step closes over
    (`consts`), the `k` parameter pytrees, the initial carry and the per-step inputs. Also their
    cotangents, and (as bools) which of them are wanted."""

    consts: Any
    params: Any
    init: Any
    xs: Any


def select(params: tuple, i):
    """`params[i]` for a traced `i`: a copy of one entry, never a stack of all of them."""
    return switch(i, [lambda p=p: p for p in params])


def store(entries: tuple, value, i) -> tuple:
    """`entries` with `entries[i]` replaced by `value`, for a traced `i`. One `lax.cond` per
    entry: XLA updates each entry's buffer in place (a `lax.switch` over the whole tuple
    copies every entry)."""
    keep = lambda e: e
    return tuple(cond(i == j, lambda e: value, keep, e) for j, e in enumerate(entries))


def _forward(step: Callable, operands: _Operands, save: bool):
    """`lax.scan` of `step(consts, params[i], carry, xs[i]) -> (carry, y)`; returns
    `((carry, ys), inputs)`, `inputs` the stacked carry entering each step (`None` unless
    `save`)."""
    consts, params, init, xs = operands

    def body(carry, inputs):
        i, x = inputs
        new, y = step(consts, select(params, i), carry, x)
        return new, (y, carry if save else None)

    out, (ys, inputs) = scan(body, init, (jnp.arange(len(params)), xs))
    return (out, ys), inputs


def _reverse(step: Callable, operands: _Operands, inputs, ct_out, want: _Operands) -> _Operands:
    """The cotangents of `operands` (inexact parts, `None` elsewhere) from those of
    `(carry, ys)`: step `i` is recomputed from its stored input and differentiated, from the
    last to the first."""
    consts, params, _, xs = operands
    ct_carry, ct_ys = _tree.split_inexact(ct_out)[0]
    k = len(params)
    k_f, k_rest = _tree.split_inexact(consts)
    ct_k = _tree.zeros_like(k_f) if want.consts else None
    acc = tuple(_tree.zeros_like(_tree.split_inexact(p)[0]) for p in params)
    acc = acc if want.params else None
    ct_xs = _tree.zeros_like(_tree.split_inexact(xs)[0]) if want.xs else None

    def body(r, cts: _Operands) -> _Operands:
        i = k - 1 - r
        p_f, p_rest = _tree.split_inexact(select(params, i))
        c_f, c_rest = _tree.split_inexact(_tree.index(inputs, i))
        x_f, x_rest = _tree.split_inexact(_tree.index(xs, i))

        def f(kk, p, c, x):
            kk = kk if want.consts else k_f
            p = p if want.params else p_f
            x = x if want.xs else x_f
            new, y = step(eqx.combine(kk, k_rest), eqx.combine(p, p_rest),
                          eqx.combine(c, c_rest), eqx.combine(x, x_rest))  # fmt: skip
            return _tree.split_inexact(new)[0], _tree.split_inexact(y)[0]

        diff = (k_f if want.consts else None, p_f if want.params else None, c_f,
                x_f if want.xs else None)  # fmt: skip
        ct_k, ct_p, ct_c, ct_x = jax.vjp(f, *diff)[1]((cts.init, _tree.index(ct_ys, i)))
        return _Operands(
            consts=_tree.add(cts.consts, ct_k) if want.consts else None,
            params=store(cts.params, ct_p, i) if want.params else None,
            init=ct_c,
            xs=_tree.update(cts.xs, ct_x, i) if want.xs else None,
        )

    return lax.fori_loop(0, k, body, _Operands(ct_k, acc, ct_carry, ct_xs))


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
        return scan(body, init, (jnp.arange(len(params)), xs))
    # Values the step closes over (a layer holding a traced array in a closure) cross the
    # custom JVP as `consts`, an input shared by every step.
    init = _tree.strong(init)
    consts, static = convert(step, params[0], init, _tree.index(xs, 0))
    closed = lambda consts, p, carry, x: eqx.combine(consts, static)(p, carry, x)
    primal = lambda operands: _forward(closed, operands, save=False)[0]
    sweeps = lambda: Sweeps(partial(_forward, closed, save=True), partial(_reverse, closed))
    return differentiable(primal, sweeps, _Operands(consts, params, init, xs))
