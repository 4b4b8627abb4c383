"""Checks on pytrees of arrays."""

import functools

import jax
import jax.numpy as jnp

from ._types import BoolScalar, Y


def all_finite(y: Y) -> BoolScalar:
    """Whether every component of every leaf of `y` is finite (neither NaN nor inf)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(y)]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def with_nonfinite(error: Y, *trees: Y) -> Y:
    """`error`, NaN wherever a component of one of `trees` (of `error`'s structure) is NaN or
    inf, and otherwise unchanged bit for bit (`error + 0 * x`). A norm of the result is finite
    exactly when `error` and every tree are: one reduction checks them all."""
    return jax.tree.map(lambda e, *xs: e + sum(0 * x for x in xs), error, *trees)
