"""Differential-algebraic equations `M y' = f(t, y, args)` with a constant, possibly singular,
mass matrix `M`, in the flat real coordinates the implicit steppers solve in: the matrix and
the algebraic structure it defines, consistent initial values, and the slope of the solution.

With `r` the rank deficiency of `M`, `P` (`m x r`, orthonormal columns) spans its null space:
the algebraic directions of the state, along which `M y'` says nothing; `Q` (`m x r`) spans the
null space of `M^T`: the combinations of equations without derivatives, the constraints
`Q^T f(t, y, args) = 0`. The DAE is of index 1 where `Q^T (df/dy) P` is invertible (the
constraints determine the algebraic part of the state); then the initial values are made
consistent by Newton's method on `z -> Q^T f(t0, y0 + P z)`, and the slope of the solution
solves `(M + Q Q^T J) y' = f - Q Q^T f_t` (the differentiated constraints complete `M y' = f`).

**References:** E. Hairer & G. Wanner, *Solving ODEs II*, 2nd ed. (1996), Sec. VI.1 (index-1
problems, the mass-matrix form) and VI.6; K. E. Brenan, S. L. Campbell & L. R. Petzold,
*Numerical Solution of Initial-Value Problems in DAEs* (1996), Sec. 5.3 (consistent initial
values); P. N. Brown, A. C. Hindmarsh & L. R. Petzold, "Consistent initial condition
calculation for differential-algebraic systems", *SIAM J. Sci. Comput.* 19 (1998), 1495-1512.
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
from jaxtyping import Array

from .._types import Args, BoolScalar, IntScalar, Scalar, Y
from ..checkpointing import lockstep_while_loop
from ._base import AbstractStepper
from ._newton import AbstractSystem, FlatField, Newton, implicit_solution, lu_solver, no_grad

_MAX_ITERS = 10
"""Newton iterations for consistent initial values: quadratic convergence from a guess within
the basin takes a handful."""
_CONVERGED = 1e-3
"""A Newton increment below this fraction of the tolerances ends the iteration (the next is
about its square)."""


class FlatMass(eqx.Module):
    """A constant mass matrix over the flat real coordinates of the state, with its algebraic
    structure and how to treat initial values.

    **Fields:**

    - `matrix`: `M`, `(m, m)`.
    - `algebraic`: `P`, `(m, r)`, an orthonormal basis of the null space of `M`.
    - `constraints`: `Q`, `(m, r)`, an orthonormal basis of the null space of `M^T`.
    - `rtol`, `atol`: the tolerances the constraints are solved or checked to.
    - `initial`: `"solve"` (Newton on the algebraic part of the initial values) or `"check"`
        (leave them, failing where they are inconsistent beyond the tolerances).
    """

    matrix: Array | np.ndarray
    algebraic: Array | np.ndarray
    constraints: Array | np.ndarray
    rtol: Scalar | float
    atol: Scalar | float
    initial: str = eqx.field(static=True)

    @property
    def num_algebraic(self) -> int:
        return self.algebraic.shape[1]

    def without_constraints(self, v: Array) -> Array:
        """`v`, a vector of equations' values, with the algebraic equations' part removed:
        `(I - Q Q^T) v`."""
        q = jnp.asarray(self.constraints, v.dtype)
        return v - q @ (q.T @ v)


class Consistency(eqx.Module):
    """Initial values made consistent with the constraints, and what went wrong doing so.

    **Fields:** `y` (flat); `inconsistent`: the constraints could not be solved (or, checked,
    do not hold) to the tolerances; `singular`: their Jacobian in the algebraic variables,
    `Q^T J P`, is singular (the DAE is not of index 1 there); `num_iterations`: the Newton
    iterations taken, each one evaluation of `f` and one Jacobian of the constraints."""

    y: Array
    inconsistent: BoolScalar
    singular: BoolScalar
    num_iterations: IntScalar | int = 0


class Constraints(AbstractSystem):
    """The constraints at `(t, y + P z)` as a system in the algebraic coordinates `z`:
    `Q^T f(t, y + P z, args) = 0`. Differentiated by the implicit function theorem, its
    solution moves with `(t, y, args)` so that the initial values stay consistent."""

    field: FlatField
    t: Scalar
    y: Array
    args: Args
    algebraic: Array
    constraints: Array

    def state(self, z: Array) -> Array:
        return self.y + self.algebraic @ z

    def residual(self, z: Array) -> Array:
        return self.constraints.T @ self.field(self.t, self.state(z), self.args)

    def matrix(self, z: Array) -> Array:
        return jax.jacfwd(self.residual)(z)

    def num_components(self) -> int:
        return self.algebraic.shape[1]

    def modulus(self, z: Array) -> Array:
        return jnp.abs(z)


class _Carry(NamedTuple):
    z: Array
    num_iterations: IntScalar
    converged: BoolScalar
    singular: BoolScalar


def consistent(mass: FlatMass, field: FlatField, t: Scalar, y: Array, args: Args) -> Consistency:
    """`y` with its algebraic part solved from the constraints by Newton's method (with
    `mass.initial == "check"`: `y` itself, inconsistent if one Newton increment from it
    exceeds the tolerances), differentiable by the implicit function theorem: its tangents
    satisfy the differentiated constraints."""
    r = mass.num_algebraic
    if r == 0:
        false = jnp.zeros((), bool)
        return Consistency(y, false, false)
    algebraic = jnp.asarray(mass.algebraic, y.dtype)
    constraints = jnp.asarray(mass.constraints, y.dtype)
    system = Constraints(field, t, y, args, algebraic, constraints)
    scale = no_grad(mass.atol + mass.rtol * field.coordinates.modulus(y))
    size = lambda dz: jnp.sqrt(jnp.mean(((algebraic @ dz) / scale) ** 2))
    frozen = no_grad(system)
    eps = jnp.finfo(y.dtype).eps

    def increment(z: Array) -> tuple[Array, BoolScalar]:
        lu, pivots = jsl.lu_factor(frozen.matrix(z))
        pivot = jnp.abs(jnp.diag(lu))
        dz = -jsl.lu_solve((lu, pivots), frozen.residual(z))
        singular = (jnp.min(pivot) <= r * eps * jnp.max(pivot)) | ~jnp.all(jnp.isfinite(dz))
        return dz, singular

    iterations = 1 if mass.initial == "check" else _MAX_ITERS

    def cond(carry: _Carry) -> BoolScalar:
        return ~carry.converged & ~carry.singular & (carry.num_iterations < iterations)

    def body(carry: _Carry) -> _Carry:
        dz, singular = increment(carry.z)
        dz_size = size(dz)
        threshold = 1.0 if mass.initial == "check" else _CONVERGED
        rounding = dz_size <= size(10 * eps * jnp.abs(carry.z))
        converged = ~singular & ((dz_size <= threshold) | rounding)
        moved = carry.z if mass.initial == "check" else carry.z + dz
        return _Carry(moved, carry.num_iterations + 1, converged, singular)

    zero = jnp.zeros((r,), y.dtype)
    false = jnp.zeros((), bool)
    final = lockstep_while_loop(cond, body, _Carry(zero, jnp.zeros((), jnp.int32), false, false))
    z = jnp.where(final.converged, final.z, 0)
    z = implicit_solution(system, jax.lax.stop_gradient(z), Newton())
    return Consistency(system.state(z), ~final.converged, final.singular, final.num_iterations)


def consistent_slope(mass: FlatMass, field: FlatField, t: Scalar, y: Array, args: Args) -> Array:
    """`y'` of the solution through a consistent `(t, y)`: `M y' = f` completed by the
    differentiated constraints, `(M + Q Q^T J) y' = f - Q Q^T f_t` (differentiable)."""
    value, f_t = jax.jvp(lambda s: field(s, y, args), (t,), (jnp.ones_like(t),))
    jacobian = jax.jacfwd(field, argnums=1)(t, y, args)
    matrix = jnp.asarray(mass.matrix, y.dtype)
    q = jnp.asarray(mass.constraints, y.dtype)
    completed = matrix + q @ (q.T @ jacobian)
    return lu_solver(completed)(value - q @ (q.T @ f_t))


class AbstractMassMatrix(AbstractStepper):
    """A stepper that solves `M y' = f(t, y, args)` given the mass matrix (`mass`, set by
    `odeckpt.solve(mass_matrix=...)`; `None` for an ODE): consistent initial values and the
    solution's slope, as `AbstractStepper` asks for them."""

    mass: eqx.AbstractVar[FlatMass | None]

    @property
    def has_mass_matrix(self) -> bool:
        return self.mass is not None

    def field_of(self, f: Callable, t0: Scalar, y0: Y, args: Args) -> tuple[FlatField, Array]:
        """The flat field of `f` with this stepper's mass matrix, and the flat `y0`."""
        return FlatField.make(f, t0, y0, args, None if self.mass is None else self.mass.matrix)

    def consistent(self, f, t, y, args):
        if self.mass is None:
            return super().consistent(f, t, y, args)
        field, flat = self.field_of(f, t, y, args)
        made = consistent(self.mass, field, t, flat, args)
        return field.unravel(made.y), made

    def slope(self, f, t, y, args, state=None):
        if self.mass is None:
            return super().slope(f, t, y, args, state)
        field, flat = self.field_of(f, t, y, args)
        return field.unravel(consistent_slope(self.mass, field, t, flat, args))
