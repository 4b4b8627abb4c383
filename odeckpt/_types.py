"""Type aliases shared across odeckpt (jaxtyping)."""

from collections.abc import Callable
from typing import Any, TypeAlias

from jaxtyping import Array, ArrayLike, Bool, Float, Int, PyTree

Y: TypeAlias = PyTree[Array]
"""The state: any pytree of floating (or complex) arrays."""
Args: TypeAlias = PyTree[Any]
Scalar: TypeAlias = Float[Array, ""]
ScalarLike: TypeAlias = float | Float[ArrayLike, ""]
IntScalar: TypeAlias = Int[Array, ""]
BoolScalar: TypeAlias = Bool[Array, ""]
VectorField: TypeAlias = Callable[[Scalar, Y, Args], Y]
"""`f(t, y, args) -> dy/dt`, with the same pytree structure, shapes and dtypes as `y`."""
Tolerance: TypeAlias = float | Float[ArrayLike, "..."] | PyTree[float | Float[ArrayLike, "..."]]
"""`rtol` or `atol`: one number, or a pytree like the state of numbers or arrays of each leaf's
shape (a tolerance per component)."""
