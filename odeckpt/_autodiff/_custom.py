"""One differentiation rule for the engine's loops: a `jax.custom_jvp` whose tangent is a linear
map (`_linear.linear_call`) with the reverse sweep as its transpose."""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _tree
from ._linear import NoForwardMode, linear_call
from ._varying import closure_convert, filled, varying_like


class Sweeps(NamedTuple):
    """How a call made `differentiable` is reversed.

    - `forward(inputs) -> (out, saved)`: the primal run, also returning `saved`, a pytree of
        arrays for the reverse sweep.
    - `reverse(inputs, saved, ct_out, want) -> cts`: the cotangents of `inputs`, a tuple of
        its type holding per entry its inexact leaves (`None` elsewhere) or `None`, from
        `ct_out`, the cotangent of `out` (float0 zeros on its leaves that are not inexact).
        `want`, of the type of `inputs`, says per entry whether any of its leaves has a
        tangent: the cotangents of the others are never read.
    - `tangent(inputs, saved, t_inputs) -> t_out` (optional): the tangent of `out` along
        `t_inputs` (a tangent of `inputs`, zero on the leaves nobody differentiates), linear in
        `t_inputs`, with the structure of `out` (any value on its leaves that are not inexact);
        `None`: the JVP of `primal`. For a call whose forward mode is not the JVP of the
        primal computation (forward sensitivities with their own error control).

    **Example:** the sweeps of `sin`, which saves `cos(x)` for the reverse sweep (used with
    `differentiable`, whose example runs them).

    ```python
    >>> import jax.numpy as jnp
    >>> from typing import NamedTuple
    >>> from odeckpt._autodiff import Sweeps
    >>> class Args(NamedTuple):
    ...     x: jnp.ndarray
    >>> sweeps = Sweeps(forward=lambda args: (jnp.sin(args.x), jnp.cos(args.x)),
    ...                 reverse=lambda args, cos_x, ct, want: Args(cos_x * ct))
    >>> out, saved = sweeps.forward(Args(jnp.array(0.0)))
    >>> float(sweeps.reverse(Args(0.0), saved, 2.0, Args(True)).x)
    2.0

    ```
    """

    forward: Callable[[Any], tuple[Any, Any]]
    reverse: Callable[[Any, Any, Any, Any], Any]
    tangent: Callable[[Any, Any, Any], Any] | None = None


def differentiable(
    primal: Callable,
    sweeps: Callable[[], Sweeps],
    inputs: NamedTuple,
    *,
    forward_error: str | None = None,
    second_order_error: str | None = None,
):
    """`primal(inputs)`, differentiable in forward and reverse mode by one rule.

    A `jax.custom_jvp` whose tangent is a linear map with a custom transpose: `jax.jvp`
    evaluates the JVP of `primal` (no storage), `jax.grad` transposes it into
    `sweeps().reverse` on what `sweeps().forward` saved, and `vmap` vmaps both. Leaves of
    `inputs` that nobody differentiates (symbolic zeros, and leaves that are not inexact) get
    no tangent and no cotangent.

    **Arguments:**

    - `primal`: the function, of a NamedTuple of pytrees.
    - `sweeps`: makes the `Sweeps`; called only when the call is differentiated.
    - `inputs`: the NamedTuple `primal` is called with.
    - `forward_error`: with a message, the call is differentiable in reverse mode only:
        forward mode (`jax.jvp`, `jax.jacfwd`) raises a `TypeError` with this message when
        the tangent is evaluated (at compile time under `jax.jit`).
    - `second_order_error`: with a message, the tangent and the reverse sweep are
        differentiable once more in forward mode only (`jax.hessian`, `jax.jacfwd(jax.jacrev
        (f))`, `jax.jacfwd(jax.jacfwd(f))`): reverse mode over either (`jax.jacrev(jax.jacfwd
        (f))`, `jax.grad(jax.grad(f))`) raises a `TypeError` with this message when it is
        traced. For sweeps that JAX cannot transpose (those that run a `lax.while_loop`),
        whose reverse mode would otherwise fail inside JAX without naming a fix.

    **Returns:** `primal(inputs)`.

    **Example:**

    ```python
    >>> import jax
    >>> from typing import NamedTuple
    >>> from odeckpt._autodiff import Sweeps, differentiable
    >>> class Args(NamedTuple):
    ...     x: jax.Array
    >>> cube = lambda args: args.x**3
    >>> sweeps = lambda: Sweeps(lambda args: (cube(args), args.x),
    ...                         lambda args, x, ct, want: Args(3 * x**2 * ct))
    >>> f = lambda x: differentiable(cube, sweeps, Args(x))
    >>> float(jax.grad(f)(2.0)), float(jax.jvp(f, (2.0,), (1.0,))[1])
    (12.0, 12.0)

    ```
    """

    @jax.custom_jvp
    def call(inputs):
        return primal(inputs)

    def jvp(primals, tangents):
        (inputs,), (tangents,) = primals, tangents
        # Inputs nobody differentiates (a constant `xs`, closed-over constants) get no
        # tangent, so the transpose builds no cotangent for them.
        is_zero = lambda t: isinstance(t, SymbolicZero)
        tangents = jtu.tree_map(lambda t: None if is_zero(t) else t, tangents, is_leaf=is_zero)
        forward, reverse, custom_tangent = sweeps()
        out, saved = forward(inputs)
        out_struct = jax.eval_shape(lambda: out)
        linear = [
            t is not None and _tree.is_inexact(p)
            for t, p in zip(_leaves(tangents), _leaves(inputs), strict=True)
        ]
        want = _per_entry(inputs, linear)
        res_leaves, res_def = jtu.tree_flatten((inputs, saved))
        in_def = jtu.tree_structure(inputs, is_leaf=_none)
        out_def = jtu.tree_structure(_inexact_part(out))

        def tangent(res_leaves, lin_leaves):
            if forward_error is not None:
                raise NoForwardMode(forward_error)
            inputs, saved = jtu.tree_unflatten(res_def, res_leaves)
            it = iter(lin_leaves)
            t = [
                next(it) if keep else _zero(p)
                for p, keep in zip(_leaves(inputs), linear, strict=True)
            ]
            t_inputs = jtu.tree_unflatten(in_def, t)
            if custom_tangent is None:
                t_out = jax.jvp(primal, (inputs,), (t_inputs,))[1]
            else:
                t_out = custom_tangent(inputs, saved, t_inputs)
            return jtu.tree_leaves(_inexact_part(t_out))

        def transpose(res_leaves, ct_leaves):
            inputs, saved = jtu.tree_unflatten(res_def, res_leaves)
            ct_out = _completed(jtu.tree_unflatten(out_def, ct_leaves), out_struct)
            cts = reverse(inputs, saved, ct_out, want)
            flat = [x for c, p in zip(cts, inputs, strict=True) for x in _aligned(c, p)]
            leaves = zip(flat, _leaves(inputs), linear, strict=True)
            return [_zero(p) if c is None else c for c, p, keep in leaves if keep]

        if second_order_error is not None:
            error = TypeError(second_order_error)
            tangent = _forward_only_derivative(tangent, error)
            transpose = _forward_only_derivative(transpose, error)
        lin_leaves = [t for t, keep in zip(_leaves(tangents), linear, strict=True) if keep]
        # The tangents of the inexact outputs have the outputs' shapes and dtypes.
        out_avals = jtu.tree_leaves(_inexact_part(out_struct))
        out_t = linear_call(tangent, transpose, res_leaves, lin_leaves, out_avals)
        return out, varying_like(_completed(jtu.tree_unflatten(out_def, out_t), out_struct), out)

    call.defjvp(jvp, symbolic_zeros=True)
    return call(inputs)


def _forward_only_derivative(fun: Callable[[list, list], list], error: Exception) -> Callable:
    """`fun(residuals, linear)`, whose own derivative is a linear map that forward mode
    evaluates and whose transpose raises `error`."""

    @jax.custom_jvp
    def guarded(residuals, linear):
        return fun(residuals, linear)

    @guarded.defjvp
    def _jvp(primals, tangents):
        flat, treedef = jtu.tree_flatten(primals)
        inexact = [_tree.is_inexact(x) for x in flat]
        moving = [t for t, keep in zip(jtu.tree_leaves(tangents), inexact, strict=True) if keep]

        def derivative(flat, moving):
            it = iter(moving)
            t = [next(it) if keep else _zero(x) for x, keep in zip(flat, inexact, strict=True)]
            return jax.jvp(fun, *(jtu.tree_unflatten(treedef, x) for x in (flat, t)))[1]

        def raise_error(_, cotangents):
            del cotangents
            raise error.with_traceback(None)

        return fun(*primals), linear_call(derivative, raise_error, flat, moving)

    return guarded


def convert(fn, *example_args):
    """Closure-convert `fn`: `(arrays, static)` so the arrays can cross the custom JVP."""
    converted = closure_convert(fn, *example_args)
    return eqx.partition(converted, eqx.is_array)


def _none(x) -> bool:
    return x is None


def _leaves(tree) -> list:
    """Leaves with `None` kept as a leaf, aligned with the leaves of a partition of `tree`."""
    return jtu.tree_leaves(tree, is_leaf=_none)


def _inexact_part(tree):
    return _tree.split_inexact(tree)[0]


def _per_entry(inputs: NamedTuple, flags: list) -> NamedTuple:
    """Whether any of each entry's leaves is flagged, as a tuple of the type of `inputs`."""
    bounds = np.cumsum([0, *(len(_leaves(entry)) for entry in inputs)])
    return inputs._make(any(flags[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _aligned(part, full) -> list:
    """The leaves of `part` (a partition of `full`, or `None`) aligned with `_leaves(full)`."""
    return [None] * len(_leaves(full)) if part is None else _leaves(part)


def _zero(x):
    """A zero tangent (or cotangent) for a leaf like `x` (an array, a Python scalar or a
    `jax.ShapeDtypeStruct`): float0 for leaves that are not inexact, `None` for `None`."""
    if x is None:
        return None
    if _tree.is_inexact(x):
        return filled(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _completed(part, full):
    """`part` (inexact leaves, `None` elsewhere) completed with the zero leaves of `full`."""
    return jtu.tree_map(lambda p, x: _zero(x) if p is None else p, part, full, is_leaf=_none)
