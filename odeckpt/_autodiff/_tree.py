"""Small pytree helpers shared by the loops."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ._varying import filled, on_mesh


def is_inexact(x) -> bool:
    """Whether `x` is an array (or a typed scalar literal) of floating or complex dtype, or a
    Python `float` or `complex`.

    Python scalars count: inside a custom JVP rule, the primal of a value traced by `jax.jvp`
    or `jax.jacfwd` from a Python float (a loop body closing over the differentiated input) is
    that float itself, and its tangent must be kept.
    """
    if isinstance(x, float | complex):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def split_inexact(tree):
    """`(inexact, rest)`: the floating/complex array leaves and everything else."""
    return eqx.partition(tree, is_inexact)


_SMALL = 64
"""Leaves of at most this many elements are raveled together; larger ones (a large state, one
a user may have sharded) stay whole."""


class Raveled(eqx.Module):
    """A pytree of arrays with its small leaves raveled into one vector per dtype (`parts`),
    and how to rebuild it.

    A snapshot kept this way is a few arrays, not one per leaf: the loops store, push and
    restore it with a few fused writes and slices, where XLA compiles one kernel per leaf.
    """

    parts: tuple[jax.Array, ...]
    treedef: Any = eqx.field(static=True)
    layout: tuple[tuple[tuple[int, ...], int, int | None], ...] = eqx.field(static=True)
    """Each leaf's `(shape, part, offset)`; offset `None`: the leaf is the whole part."""

    def unravel(self):
        def leaf(shape, part, offset):
            if offset is None:
                return self.parts[part]
            size = math.prod(shape)
            return lax.slice_in_dim(self.parts[part], offset, offset + size).reshape(shape)

        return jtu.tree_unflatten(self.treedef, [leaf(*entry) for entry in self.layout])


def ravel(tree) -> Raveled:
    """`tree` as a `Raveled`: its small leaves concatenated, one vector per dtype."""
    leaves, treedef = jtu.tree_flatten(on_mesh(tree))
    parts, groups, layout = [], {}, []
    for leaf in leaves:
        shape = tuple(jnp.shape(leaf))
        if math.prod(shape) > _SMALL:
            layout.append((shape, len(parts), None))
            parts.append(leaf)
            continue
        dtype = jnp.result_type(leaf)
        if dtype not in groups:
            groups[dtype] = (len(parts), [])
            parts.append(None)
        part, members = groups[dtype]
        layout.append((shape, part, sum(x.size for x in members)))
        members.append(jnp.ravel(leaf))
    for part, members in groups.values():
        parts[part] = members[0] if len(members) == 1 else jnp.concatenate(members)
    return Raveled(tuple(parts), treedef, tuple(layout))


def index(tree, i):
    """Leaf-wise `leaf[i]` along the leading axis (`i` traced)."""
    return jtu.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def update(tree, value, i):
    """Leaf-wise `tree[i] = value` along the leading axis (`i` traced)."""
    return jtu.tree_map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def stack_zeros(tree, length):
    """Zeros of shape `[length, *leaf.shape]` for each leaf (sharded like it: `filled`)."""
    return jtu.tree_map(lambda a: filled(a, 0, length), tree)


def add(a, b):
    """`a + b` leaf-wise, where `None` stands for zero."""
    return jtu.tree_map(lambda x, y: x if y is None else (y if x is None else x + y), a, b,
                        is_leaf=lambda x: x is None)  # fmt: skip


def zeros_like(tree):
    return jtu.tree_map(jnp.zeros_like, tree)


def nbytes(tree) -> int:
    """Bytes of the array leaves of `tree` (arrays or `jax.ShapeDtypeStruct`s)."""
    leaves = jtu.tree_leaves(tree)
    return int(sum(math.prod(jnp.shape(x)) * jnp.dtype(x.dtype).itemsize for x in leaves))


def where(pred, new, old):
    """Leaf-wise `jnp.where(pred, new, old)` (per lane under `vmap`)."""
    return jtu.tree_map(lambda n, o: jnp.where(pred, n, o), new, old)


def agree(a, b, cotangent) -> jax.Array:
    """Whether two pytrees of one structure hold the same values up to rounding where a
    `cotangent` (of their inexact leaves) is not zero, per lane under `vmap`: leaves that are
    not inexact exactly; inexact ones element by element, to `sqrt(eps)` of the element plus
    `64 eps` of the largest finite magnitude in the tree (an element at its rounding-noise
    floor, an error estimate of `1e-17`, may differ), with equal infinities and NaN in both
    alike. An element whose cotangent is zero (a value that only steers decisions, such as
    an iteration's convergence rate) may differ: no derivative flows through it."""
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    inexact = [(x, y) for x, y in zip(la, lb, strict=True) if is_inexact(x)]
    same = [jnp.all(x == y) for x, y in zip(la, lb, strict=True) if not is_inexact(x)]
    if inexact:
        finite = lambda x: jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0), initial=0.0)
        largest = jnp.max(jnp.stack([jnp.maximum(finite(x), finite(y)) for x, y in inexact]))
        for (x, y), ct in zip(inexact, jtu.tree_leaves(cotangent), strict=True):
            eps = float(jnp.finfo(x.dtype).eps)
            bound = eps**0.5 * jnp.maximum(jnp.abs(x), jnp.abs(y)) + 64 * eps * largest
            alike = (x == y) | (jnp.isnan(x) & jnp.isnan(y)) | (jnp.abs(x - y) <= bound)
            same.append(jnp.all(alike | (ct == 0)))
    return jnp.all(jnp.stack(same)) if same else jnp.array(True)


def write(buffers, idx, values):
    """`buffer[idx[j]] = values[j]`; indices outside `[0, m)` are dropped. With a tuple `idx`,
    `buffers` and `values` are lists of groups, one index array each."""
    if isinstance(idx, tuple):
        return [write(*group) for group in zip(buffers, idx, values, strict=True)]
    return jtu.tree_map(
        lambda b, v: b.at[idx].set(v.astype(b.dtype), mode="drop", unique_indices=True),
        buffers,
        values,
    )


def take(ct_buffers, idx):
    """`(rows, rest)`: the cotangents at `idx` (zero outside `[0, m)`), and the buffers with
    those slots zeroed (out-of-range indices dropped). With a tuple `idx`, `ct_buffers` is a
    list of groups, one index array each.

    The zeros written are computed from the rows read (`+0` whatever the row holds, NaN
    included), so XLA reads the slots before it clears them and updates the buffer in place
    instead of copying it.
    """
    if isinstance(idx, tuple):
        pairs = [take(*group) for group in zip(ct_buffers, idx, strict=True)]
        return [rows for rows, _ in pairs], [rest for _, rest in pairs]

    def leaf(b):
        rows = b.at[idx].get(mode="fill", fill_value=0)
        zeros = jnp.where(jnp.isfinite(rows), jnp.abs(rows) * 0, 0).astype(b.dtype)
        return rows, b.at[idx].set(zeros, mode="drop")

    leaves, treedef = jtu.tree_flatten(ct_buffers)
    pairs = [leaf(b) for b in leaves]
    rows = jtu.tree_unflatten(treedef, [r for r, _ in pairs])
    return rows, jtu.tree_unflatten(treedef, [rest for _, rest in pairs])


def check_same_structure(what, expected, got, fix):
    """Raise a `TypeError` naming `fix` if `got` differs from `expected` (structure/shape/dtype)."""
    e_leaves, e_def = jtu.tree_flatten(expected)
    g_leaves, g_def = jtu.tree_flatten(got)
    if e_def != g_def:
        raise TypeError(f"{what} changed the pytree structure from {e_def} to {g_def}; {fix}")
    for e, g in zip(e_leaves, g_leaves, strict=True):
        es, gs = (jnp.shape(e), jnp.result_type(e)), (jnp.shape(g), jnp.result_type(g))
        if es != gs:
            raise TypeError(f"{what} changed a leaf from shape/dtype {es} to {gs}; {fix}")


def strong(tree):
    """Leaves as arrays with concrete (non-weak) dtypes, so loop carries keep their types."""
    return jtu.tree_map(lambda x: jnp.array(x, dtype=jnp.result_type(x)), tree)
