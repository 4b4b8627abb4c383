"""A linear map with a custom transpose, batchable: forward mode and reverse mode from one rule.

`linear_call(fun, fun_t, residuals, linear)` is `fun(residuals, linear)`, linear in `linear`,
whose transpose is `fun_t`; unlike `jax.custom_derivatives.linear_call` it batches. Under
`vmap` both functions are vmapped over the same named axis (collectives such as `lax.pmean` work
in the transpose too), and outputs that `vmap` leaves unbatched stay unbatched. Differentiated
again with respect to its residuals (second order), it adds the product-rule term. Built on
JAX's public extension API (`jax.extend.core.Primitive`,
`jax.interpreters.batching.fancy_primitive_batchers` for the axis name).
"""

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from ._varying import filled, sharding_of, varying_as

linear_p = Primitive("odeckpt_checkpointed_linear")
linear_p.multiple_results = True


def linear_call(
    fun: Callable[[list, list], list],
    fun_t: Callable[[list, list], list],
    residuals: Sequence[jax.Array],
    linear: Sequence[jax.Array],
    out_avals: Sequence[jax.ShapeDtypeStruct] | None = None,
) -> list[jax.Array]:
    """`fun(residuals, linear)`, linear in `linear`, whose transpose is `fun_t(residuals, ct)`.

    Both take and return flat lists of arrays. `out_avals`, the shapes and dtypes of `fun`'s
    outputs, saves tracing `fun` to find them (under `jax.grad`, `fun` is never traced).
    """
    residuals, linear = list(residuals), list(linear)
    if out_avals is None:
        out_avals = cast(list[jax.ShapeDtypeStruct], jax.eval_shape(fun, residuals, linear))
    lin_avals = [
        jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding_of(x))
        for x in linear
    ]
    return linear_p.bind(
        *residuals, *linear, fun=fun, fun_t=fun_t, n_res=len(residuals),
        out_avals=tuple(_shaped(a) for a in out_avals),
        lin_avals=tuple(_shaped(a) for a in lin_avals),
    )  # fmt: skip


def forward_only(tree: Any, error: Exception) -> Any:
    """`tree` unchanged, differentiable in forward mode only: reverse mode raises `error`.

    Its inexact leaves pass through an identity whose transpose raises, so that `jax.jvp`,
    `jax.jacfwd` (also under `vmap`) see the identity and `jax.grad`, `jax.vjp` and
    `jax.jacrev` fail with `error` when they transpose it, at trace time. Use it on the
    results of a computation whose reverse mode would be wrong or unaffordable, with an
    `error` that names what to use instead. (`jax.custom_derivatives.linear_call` has no
    batching rule, so `jax.jacfwd` of it fails.)

    **Arguments:**

    - `tree`: any pytree; leaves that are not inexact arrays pass through as they are.
    - `error`: the exception reverse mode raises (a fresh traceback each time).

    **Returns:** `tree`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
    >>> from odeckpt._autodiff import forward_only
    >>> f = lambda x: forward_only(jnp.sin(x), TypeError("forward mode only: use jax.jvp"))
    >>> float(jax.jacfwd(f)(0.0))
    1.0
    >>> try:
    ...     jax.grad(f)(0.0)
    ... except TypeError as e:
    ...     print(e)
    forward mode only: use jax.jvp

    ```
    """

    def raise_error(residuals, cotangents):
        del residuals, cotangents
        raise error.with_traceback(None)

    leaves, treedef = jtu.tree_flatten(tree)
    inexact = [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    guarded = linear_call(lambda _, x: x, raise_error, [], [leaves[i] for i in inexact])
    for i, x in zip(inexact, guarded, strict=True):
        leaves[i] = x
    return jtu.tree_unflatten(treedef, leaves)


def _shaped(x):
    """The abstract value of `x`'s shape and dtype, sharded as its type is over `Explicit`
    mesh axes in scope (`sharding_of`)."""
    return jax.core.ShapedArray(tuple(x.shape), x.dtype, sharding=sharding_of(x))


def _impl(*args, fun, fun_t, n_res, out_avals, lin_avals):
    del fun_t, out_avals, lin_avals
    return fun(list(args[:n_res]), list(args[n_res:]))


def _abstract_eval(*args, fun, fun_t, n_res, out_avals, lin_avals):
    del fun, fun_t, n_res, lin_avals
    # Inside `jax.shard_map` the outputs vary over the mesh axes the inputs vary over.
    manual = [a.manual_axis_type for a in args if hasattr(a, "manual_axis_type")]
    widest = max(manual, key=lambda m: len(m.varying), default=None)
    if widest is None or not widest.varying:
        return list(out_avals)
    replicated = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P())
    return [a.update(sharding=replicated).update_manual_axis_type(widest) for a in out_avals]


def _transpose(cts, *args, fun, fun_t, n_res, out_avals, lin_avals):
    del fun, lin_avals
    residuals = args[:n_res]
    if any(ad.is_undefined_primal(r) for r in residuals):
        raise NotImplementedError("internal error: checkpointed loop residuals are not primal")
    cts = [filled(a) if type(ct) is ad.Zero else ct for ct, a in zip(cts, out_avals, strict=True)]
    linear = args[n_res:]
    cts = fun_t(list(residuals), cts)
    # Inside `jax.shard_map` each cotangent varies over the mesh axes its input varies over.
    cts = [
        varying_as(ct, x.aval) if ad.is_undefined_primal(x) and ct is not None else ct
        for ct, x in zip(cts, linear, strict=True)
    ]
    return [None] * n_res + cts


def _jvp(primals, tangents, *, fun, fun_t, n_res, out_avals, lin_avals):
    params = dict(fun=fun, fun_t=fun_t, n_res=n_res, out_avals=out_avals, lin_avals=lin_avals)
    residuals, linear = list(primals[:n_res]), list(primals[n_res:])
    out = linear_p.bind(*primals, **params)
    lin_t = [
        filled(a) if type(t) is ad.Zero else t
        for t, a in zip(tangents[n_res:], lin_avals, strict=True)
    ]
    out_t = linear_p.bind(*residuals, *lin_t, **params)
    res_t = tangents[:n_res]
    if all(type(t) is ad.Zero for t in res_t):
        return out, out_t
    # Second order (forward over forward, reverse over forward): `fun` is linear in `linear`
    # only, so the product rule adds its derivative along the residuals, plain JAX code
    # (`jvp_fn` differentiated once more, without checkpointing) that JAX handles itself.
    res_t = [ad.instantiate_zeros(t) for t in res_t]
    along = jax.jvp(lambda r: fun(r, linear), (residuals,), (res_t,))[1]
    return out, [a + b for a, b in zip(out_t, along, strict=True)]


def _batch(axis, args, dims, *, fun, fun_t, n_res, out_avals, lin_avals):
    """`vmap` of the primitive: `fun` and `fun_t` vmapped over the same named axis (so that
    collectives such as `lax.pmean` inside the loop find it in the reverse sweep too), with
    unbatched inputs and outputs kept unbatched."""
    params = dict(n_res=n_res)
    if all(d is None for d in dims):
        out = linear_p.bind(*args, fun=fun, fun_t=fun_t, out_avals=out_avals,
                            lin_avals=lin_avals, **params)  # fmt: skip
        return out, [None] * len(out)
    vmap = partial(
        jax.vmap, axis_name=axis.name, axis_size=axis.size, spmd_axis_name=axis.spmd_name
    )
    res_dims = list(dims[:n_res])
    lin_args = zip(args[n_res:], dims[n_res:], strict=True)
    linear = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in lin_args]
    lin_dims = [None if d is None else 0 for d in dims[n_res:]]
    in_axes = (res_dims, lin_dims)
    out_dims = _out_dims(fun, vmap, in_axes, args[:n_res], linear, len(out_avals))
    fun_b = vmap(fun, in_axes=in_axes, out_axes=out_dims)
    vmapped_t = vmap(fun_t, in_axes=(res_dims, out_dims))

    def fun_t_b(residuals, cts):
        # An unbatched output is one value that every lane computes alike: each lane takes
        # `1/size` of its cotangent. An unbatched linear input is used by every lane: its
        # cotangent sums over them.
        cts = [ct if d == 0 else ct / axis.size for ct, d in zip(cts, out_dims, strict=True)]
        cts = vmapped_t(residuals, cts)
        return [ct if d == 0 else jnp.sum(ct, axis=0) for ct, d in zip(cts, lin_dims, strict=True)]

    batched = lambda a, d: a if d is None else jax.core.ShapedArray((axis.size, *a.shape), a.dtype)
    out = linear_p.bind(
        *args[:n_res], *linear, fun=fun_b, fun_t=fun_t_b,
        out_avals=tuple(map(batched, out_avals, out_dims)),
        lin_avals=tuple(map(batched, lin_avals, lin_dims)), **params,
    )  # fmt: skip
    return out, out_dims


def _out_dims(fun: Callable, vmap: Callable, in_axes, residuals, linear, n_out: int) -> list:
    """Which outputs of `vmap(fun, in_axes)` are batched (`0`) or not (`None`, e.g. after a
    `lax.psum` over the axis): traced once on shapes, each output passed through a
    `custom_vmap` identity that notes whether `vmap` hands it a batched value."""
    batched = [False] * n_out

    def noted(i: int, x):
        @custom_vmap
        def note(x):
            return x

        @note.def_vmap
        def _rule(axis_size, in_batched, x):
            del axis_size
            batched[i] = bool(in_batched[0])
            return x, in_batched[0]

        return note(x)

    # Traced on shapes, which vary over no manual axis of `jax.shard_map`: each input is cast
    # to vary as the value it stands for does.
    avals = [jax.typeof(x) for x in residuals], [jax.typeof(x) for x in linear]
    typed = lambda xs, avals: [varying_as(x, aval) for x, aval in zip(xs, avals, strict=True)]
    outputs = lambda residuals, linear: fun(typed(residuals, avals[0]), typed(linear, avals[1]))
    marked = lambda *inputs: [noted(i, x) for i, x in enumerate(outputs(*inputs))]
    structs = lambda xs: [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in xs]
    try:
        jax.eval_shape(vmap(marked, in_axes=in_axes), structs(residuals), structs(linear))
    except NoForwardMode:
        # A map without a forward mode cannot be traced: take every output as batched (its
        # transpose, the only part ever evaluated, then sees batched cotangents).
        return [0] * n_out
    return [0 if b else None for b in batched]


class NoForwardMode(TypeError):
    """What the forward mode of a map differentiable in reverse mode only raises (see
    `_custom.differentiable`)."""


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))
ad.primitive_transposes[linear_p] = _transpose
ad.primitive_jvps[linear_p] = _jvp
batching.fancy_primitive_batchers[linear_p] = _batch
