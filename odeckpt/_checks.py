"""Checks on pytrees of arrays and on settings, and the small array helpers they share."""

import functools

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

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


def known_values(name: str, value) -> np.ndarray | None:
    """Every number in the pytree `value`, flattened, if all are known at trace time; `None` if
    any is traced. Raises (naming the fix) on strings and bools, which are never settings."""
    if isinstance(value, float | int) and not isinstance(value, bool):
        return np.array([value], dtype=float)  # the common case, without flattening a pytree
    leaves = jax.tree.leaves(value)
    for leaf in leaves:
        if isinstance(leaf, str | bool):
            raise TypeError(
                f"{_spelled(name, repr(leaf))} must be a number. Fix: pass e.g. "
                f"{_spelled(name, '1e-6')} (a float or an array, not a string or a bool)."
            )
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return None
    if not leaves:
        return np.empty(0)
    try:
        return np.concatenate([np.ravel(np.asarray(leaf, dtype=float)) for leaf in leaves])
    except (TypeError, ValueError):
        raise TypeError(
            f"{_spelled(name, repr(value))} must hold real numbers. Fix: pass e.g. "
            f"{_spelled(name, '1e-6')}."
        ) from None


def _spelled(name: str, value: str) -> str:
    """`name` given `value`, as the user writes it: `rtol=1e-6`, or `PIDController(pcoeff=0.3)`
    for a name of the form `PIDController(pcoeff)`."""
    if name.endswith(")"):
        return f"{name[:-1]}={value})"
    return f"{name}={value}"


def tightest(tolerance):
    """The smallest value of a tolerance given per leaf (itself if it is one number): the one
    tolerance for solves whose state is not shaped like the user's (Newton's flattened
    coordinates, backsolve's augmented state)."""
    leaves = jax.tree.leaves(tolerance)
    if len(leaves) == 1 and jnp.ndim(leaves[0]) == 0:
        return leaves[0]
    return functools.reduce(jnp.minimum, [jnp.min(jnp.asarray(leaf)) for leaf in leaves])


def count(name: str, value, example: str) -> int:
    """`value` as a Python int, raising (naming the fix) unless it is a positive integer
    (Python or NumPy; not a bool). `name` says where it was given."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(
            f"{name} must be a positive int (an int >= 1), got {value!r}. Fix: {example}."
        )
    return int(value)


def python_int(value):
    """A NumPy integer as a Python int (a static field must hold a hashable Python value);
    anything else as it is, for the checks to judge."""
    return int(value) if isinstance(value, np.integer) else value


def leading_mask(mask: Array, y: Array) -> Array:
    """`mask`, of the shape of `y`'s leading axes, reshaped to broadcast against `y`."""
    return mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim))
