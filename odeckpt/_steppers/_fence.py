"""A fusion fence: makes XLA materialise a stage's state before the vector field reads it.

Passing a stage `z_i` through a `lax.cond` that XLA cannot fold away stops XLA from fusing the
stage combination into the fusion that evaluates `f(z_i)`, so `f` reads a buffer. Steppers
fence only leaves of at least `FENCE_MIN_SIZE` elements, and not under `vmap`. Why, and what
it saves: `docs/architecture.md`, "The fusion fence".
"""

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from .._autodiff import cond, sharded_by_type
from .._types import Scalar, Y

FENCE_MIN_SIZE = 1024


def _cond_identity(keep: jax.Array, x: jax.Array) -> jax.Array:
    # The two branches must differ or XLA merges them; the second rewrites an element with
    # itself, so both return `x` bit for bit whichever runs.
    flat = x.reshape(-1)
    out = cond(keep, lambda v: v, lambda v: v.at[0].set(v[0]), flat)
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

    **Returns:** `y`, bit for bit. (Not fenced: a leaf sharded by its type over `Explicit` mesh
    axes, whose element the fence rewrites would be a slice of a sharded axis, which JAX's
    sharding rules refuse.)
    """
    t = jax.lax.stop_gradient(jnp.asarray(t))
    keep = t == t

    def leaf(x):
        if jnp.size(x) < FENCE_MIN_SIZE or sharded_by_type(x):
            return x
        return _fence(keep, x)

    return jax.tree.map(leaf, y)
