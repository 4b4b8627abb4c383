"""Checks on pytrees of arrays."""

import functools

import jax
import jax.numpy as jnp

from ._types import BoolScalar, Y


def all_finite(y: Y) -> BoolScalar:
    """Whether every component of every leaf of `y` is finite (neither NaN nor inf)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(y)]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))
