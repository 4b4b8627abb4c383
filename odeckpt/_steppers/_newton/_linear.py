"""Dense LU linear solvers, in the lineax shape: factorise once, solve many. `ShiftedLU`
holds the factors of `I - s J` that Newton's iterations (and their reuse across steps) solve
with; `lu_solver` solves with a matrix in a form JAX can differentiate and transpose (the
derivatives of implicit stages, the stages of a Rosenbrock step)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jaxtyping import Array

from ..._autodiff import like, replicated
from ..._types import BoolScalar, Scalar


class ShiftedLU(eqx.Module):
    """The LU factors of `I - s J` (or `M - s J`, with a mass matrix `M`) for one shift `s`,
    real or complex (a complex `s` makes a complex factorisation of the real Jacobian `J`)."""

    lu: Array
    pivots: Array

    @classmethod
    def factor(cls, jacobian: Array, shift: Scalar, mass: Array | None = None) -> "ShiftedLU":
        complex_shift = jnp.iscomplexobj(shift)
        dtype = jnp.result_type(jacobian.dtype, jnp.complex64) if complex_shift else jacobian.dtype
        base = jnp.eye(jacobian.shape[0], dtype=dtype) if mass is None else mass.astype(dtype)
        lu, pivots = jsl.lu_factor(base - jnp.asarray(shift, dtype) * jacobian)
        return cls(lu, pivots.astype(jnp.int32))

    @classmethod
    def empty(cls, n: int, dtype) -> "ShiftedLU":
        return cls(jnp.zeros((n, n), dtype), jnp.zeros((n,), jnp.int32))

    def solve(self, rhs: Array) -> Array:
        """`(I - s J)^{-1} rhs` (`(M - s J)^{-1} rhs`)."""
        return lu_solve((self.lu, self.pivots), rhs.astype(self.lu.dtype))


def lu_solve(factors: tuple[Array, Array], rhs: Array, trans: int = 0) -> Array:
    """`jax.scipy.linalg.lu_solve(factors, rhs, trans)`, sharded like `rhs`: where the type of
    `rhs` shards it over `Explicit` mesh axes, solved on the whole (`replicated`) vector,
    whose solution each device then keeps its block of (`like`)."""
    return like(jsl.lu_solve(factors, replicated(rhs), trans=trans), rhs)


def same_step_size(h: Scalar, reference: Scalar) -> BoolScalar:
    """Whether `h` is `reference` up to the rounding of the times that make it (`t1 - t0` with
    `t1 = t0 + dt` is `dt` only to `eps |t1|`), so that factors of `I - h gamma J` and
    histories spaced by `reference` still serve. False when `reference` is NaN."""
    return jnp.abs(h - reference) <= _SAME_STEP * jnp.abs(reference)


_SAME_STEP = 1e-8
"""Relative difference of step sizes below which they count as the same (see `same_step_size`):
the rounding of `t0 + dt` relative to `dt` up to `|t| / dt` of about 1e7."""


class LUSolver(eqx.Module):
    """Solves with `matrix` from one LU factorisation: linear and differentiable in the
    right-hand side and in `matrix`, and transposable, the transposed solve (reverse mode)
    reusing the factors. Never raises: NaN or inf in, NaN or inf out. (`custom_linear_solve`
    on `jax.scipy` factors: lighter to trace and compile than a lineax solve, whose transpose
    raises on non-finite input.)"""

    matrix: Array
    factors: tuple[Array, Array]

    def __call__(self, rhs: Array) -> Array:
        return jax.lax.custom_linear_solve(
            # (over `Explicit` mesh axes, on the whole vector, sharded back like it: `lu_solve`)
            lambda v: like(self.matrix @ replicated(v), v),
            rhs,
            lambda _, b: lu_solve(self.factors, b),
            transpose_solve=lambda _, b: lu_solve(self.factors, b, trans=1),
        )


def lu_solver(matrix: Array) -> LUSolver:
    """An `LUSolver` for `matrix`, factorised once."""
    return LUSolver(matrix, jsl.lu_factor(jax.lax.stop_gradient(matrix)))
