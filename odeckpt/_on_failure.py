"""What a failed solve's outputs do: raise (`throw=True`), turn to NaN (`EQX_ON_ERROR=nan`), and
carry NaN derivatives whatever `throw` says, so that no gradient of a failed solve is finite."""

import equinox as eqx
import jax
import jax.numpy as jnp

from ._status import Status
from ._types import BoolScalar


def raise_if_failed(status: Status, tree, note: dict[str, str] | None = None):
    """`tree` unchanged; raises at run time (through `Status.error_if`, so as `_errors` decides:
    a host callback, or after the call under `odeckpt.jit`) if the solve failed. Under
    `EQX_ON_ERROR=nan` its inexact leaves are NaN instead. `note` appends text to the messages
    of the outcomes it names (see `Status.error_if`).

    The check runs on a floating scalar and reaches `tree` through an exact `x - 0`, instead of
    passing `tree` through the check's `lax.cond`: XLA places a `cond` holding a host callback
    on one device, which would gather a sharded state there (see docs/scaling.md). A floating
    scalar (never an integer) carries the NaN of `EQX_ON_ERROR=nan` to every leaf.
    """
    failed = status != Status.successful
    inexact = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    if not inexact:
        return status.error_if(tree, failed, note=note)
    real = jnp.result_type(*[jnp.finfo(x.dtype).dtype for x in inexact])
    zero = status.error_if(jnp.zeros((), real), failed, note=note)

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
