"""A fusion fence: makes XLA materialise a stage's state before the vector field reads it.

XLA fuses a Runge-Kutta step's stage combinations `z_i = y0 + h sum_j a_ij k_j` into the
fusion that evaluates `f(z_i)`. When `f` shifts its input (`jnp.roll`, stencils, `concatenate`,
gathers) the fused loop computes `z_i` once per shifted read, and XLA:CPU emits the nested
concatenations as scalar, unvectorised code: on a 2**16-point diffusion problem a Tsit5 step
took 2.0 ms instead of 0.33 ms (`benchmarks/bench_gradients.py`, problem (c)). A `lax.cond`
is a boundary no fusion crosses, so passing `z_i` through one that XLA cannot fold away makes
`f` read a buffer. `jax.lax.optimization_barrier` does not do this on CPU: XLA:CPU expands it
before fusion.

The fence costs one predicate test and, for a small state, more than it saves (a 2-dim
Lotka-Volterra step goes from 0.04 to 0.3 us), so steppers fence only leaves of at least
`FENCE_MIN_SIZE` elements. Under `vmap` the batched layout already splits the fusions and
the fence is skipped.
"""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from .._types import Scalar, Y

FENCE_MIN_SIZE = 1024


def _cond_identity(keep: jax.Array, x: jax.Array) -> jax.Array:
    # The two branches must differ or XLA merges them; the second rewrites an element with
    # itself, so both return `x` bit for bit whichever runs.
    flat = x.reshape(-1)
    out = jax.lax.cond(keep, lambda v: v, lambda v: v.at[0].set(v[0]), flat)
    return out.reshape(x.shape)


@custom_vmap
def _fence_primal(keep: jax.Array, x: jax.Array) -> jax.Array:
    return _cond_identity(keep, x)


@_fence_primal.def_vmap
def _fence_primal_batched(axis_size, in_batched, keep, x):
    del axis_size, keep
    return x, in_batched[1]


@jax.custom_jvp
def _fence(keep: jax.Array, x: jax.Array) -> jax.Array:
    return _fence_primal(keep, x)


@_fence.defjvp
def _fence_jvp(primals, tangents):
    keep, x = primals
    _, dx = tangents
    # The tangent is fenced too, so the transposed step (the reverse sweep) keeps the same
    # fusion boundaries; a `cond` with linear branches transposes.
    return _fence(keep, x), _cond_identity(keep, dx)


def fence(t: Scalar, y: Y) -> Y:
    """`y` unchanged, with every large leaf materialised before its next use.

    **Arguments:**

    - `t`: the stage time, a traced scalar: the predicate `t == t` is true (a NaN time has
        failed the step already) but XLA cannot prove it, so it keeps the `cond`.
    - `y`: the stage state, any pytree.

    **Returns:** `y`, bit for bit.
    """
    t = jax.lax.stop_gradient(jnp.asarray(t))
    keep = t == t

    def leaf(x):
        if jnp.size(x) < FENCE_MIN_SIZE:
            return x
        return _fence(keep, x)

    return jax.tree.map(leaf, y)
