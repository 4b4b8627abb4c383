"""A linear map with a custom transpose, batchable: forward mode and reverse mode from one rule.

`checkpointed_scan` and `bounded_while_loop` are `jax.custom_jvp` functions whose tangent is
`linear_call(jvp_fn, vjp_fn, residuals, tangents)`. Under `jax.jvp` the primitive evaluates
`jvp_fn` (a forward-mode loop, no storage). Under `jax.grad` JAX transposes it, which calls
`vjp_fn`: the checkpointed reverse sweep over the snapshots in `residuals`. Under `vmap` both
functions are vmapped. Built on JAX's public extension API (`jax.extend.core.Primitive`).
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

linear_p = Primitive("odeckpt_checkpointed_linear")
linear_p.multiple_results = True


def linear_call(
    fun: Callable[[list, list], list],
    fun_t: Callable[[list, list], list],
    residuals: Sequence[jax.Array],
    linear: Sequence[jax.Array],
) -> list[jax.Array]:
    """`fun(residuals, linear)`, linear in `linear`, whose transpose is `fun_t(residuals, ct)`.

    Both take and return flat lists of arrays.
    """
    residuals, linear = list(residuals), list(linear)
    out_avals = jax.eval_shape(fun, residuals, linear)
    lin_avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in linear]
    return linear_p.bind(
        *residuals, *linear, fun=fun, fun_t=fun_t, n_res=len(residuals),
        out_avals=tuple(_shaped(a) for a in out_avals),
        lin_avals=tuple(_shaped(a) for a in lin_avals),
    )  # fmt: skip


def _shaped(x):
    return jax.core.ShapedArray(tuple(x.shape), x.dtype)


def _impl(*args, fun, fun_t, n_res, out_avals, lin_avals):
    del fun_t, out_avals, lin_avals
    return fun(list(args[:n_res]), list(args[n_res:]))


def _abstract_eval(*args, fun, fun_t, n_res, out_avals, lin_avals):
    del args, fun, fun_t, n_res, lin_avals
    return list(out_avals)


def _transpose(cts, *args, fun, fun_t, n_res, out_avals, lin_avals):
    del fun, lin_avals
    residuals = args[:n_res]
    if any(ad.is_undefined_primal(r) for r in residuals):
        raise NotImplementedError("internal error: checkpointed loop residuals are not primal")
    cts = [
        jnp.zeros(a.shape, a.dtype) if type(ct) is ad.Zero else ct
        for ct, a in zip(cts, out_avals, strict=True)
    ]
    return [None] * n_res + list(fun_t(list(residuals), cts))


def _jvp(primals, tangents, *, fun, fun_t, n_res, out_avals, lin_avals):
    if any(type(t) is not ad.Zero for t in tangents[:n_res]):
        raise NotImplementedError(
            "second-order forward-over-reverse (or forward-over-forward) differentiation "
            "through checkpointed_scan / bounded_while_loop is not supported; differentiate "
            "once, or use lax.scan for the inner derivative"
        )
    params = dict(fun=fun, fun_t=fun_t, n_res=n_res, out_avals=out_avals, lin_avals=lin_avals)
    out = linear_p.bind(*primals, **params)
    lin_t = [
        jnp.zeros(a.shape, a.dtype) if type(t) is ad.Zero else t
        for t, a in zip(tangents[n_res:], lin_avals, strict=True)
    ]
    return out, linear_p.bind(*primals[:n_res], *lin_t, **params)


def _batch(args, dims, *, fun, fun_t, n_res, out_avals, lin_avals):
    size = next(jnp.shape(a)[d] for a, d in zip(args, dims, strict=True) if d is not None)
    residuals, res_dims = list(args[:n_res]), list(dims[:n_res])
    linear = [
        jnp.broadcast_to(x, (size, *jnp.shape(x))) if d is None else jnp.moveaxis(x, d, 0)
        for x, d in zip(args[n_res:], dims[n_res:], strict=True)
    ]
    fun_b = jax.vmap(fun, in_axes=(res_dims, 0))
    fun_t_b = jax.vmap(fun_t, in_axes=(res_dims, 0))
    batched = lambda avals: tuple(jax.core.ShapedArray((size, *a.shape), a.dtype) for a in avals)
    out = linear_p.bind(
        *residuals, *linear, fun=fun_b, fun_t=fun_t_b, n_res=n_res,
        out_avals=batched(out_avals), lin_avals=batched(lin_avals),
    )  # fmt: skip
    return out, [0] * len(out)


linear_p.def_impl(_impl)
linear_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(linear_p, mlir.lower_fun(_impl, multiple_results=True))
ad.primitive_transposes[linear_p] = _transpose
ad.primitive_jvps[linear_p] = _jvp
batching.primitive_batchers[linear_p] = _batch
