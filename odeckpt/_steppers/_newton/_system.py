"""The nonlinear systems that the implicit steppers solve, and the vector field they are
written in: the state raveled into one flat real vector (each complex number as its real and
imaginary parts: see `odeckpt._real_coordinates`), with its Jacobian (`jax.jacfwd`, or the
user's `jac`)."""

import abc
import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._autodiff import closure_convert, replicated
from ..._real_coordinates import RealCoordinates
from ..._types import Args, Scalar, VectorField, Y


def no_grad(tree):
    """`tree` with every inexact array wrapped in `stop_gradient`."""
    return jax.tree.map(lambda x: jax.lax.stop_gradient(x) if eqx.is_inexact_array(x) else x, tree)


class FlatField(eqx.Module):
    """A vector field on pytrees as one on flat real vectors: `fn(t, z, args)` with `z` the
    state in its real coordinates (`RealCoordinates`: raveled, each complex number as its real
    and imaginary parts). `fn` is closure-converted, so arrays that `f` closes over are leaves
    here (and get derivatives like `args`)."""

    fn: Callable
    coordinates: RealCoordinates
    mass: Array | np.ndarray | None = None
    """The constant mass matrix `M` of `M y' = f` over these coordinates (`None`: the ODE
    `y' = f`): the stage equations and the matrices of Newton's iteration take it."""

    @classmethod
    def make(
        cls, f: VectorField, t0: Scalar, y0: Y, args: Args, mass: Array | np.ndarray | None = None
    ) -> tuple["FlatField", Array]:
        """The flat field of `f` (with the mass matrix `mass`, if any) and the flat `y0`. The
        non-array leaves of `args` are closed over: closure conversion compares them with
        `==`, which a NaN never passes."""
        coordinates, y0_flat = RealCoordinates.make(y0)
        arrays, static = eqx.partition(args, eqx.is_array)

        def fn(t, z, arrays):
            return coordinates.ravel(f(t, coordinates.unravel(z), eqx.combine(arrays, static)))

        converted = closure_convert(fn, t0, y0_flat, arrays)
        return cls(converted, coordinates, mass), y0_flat

    def __call__(self, t: Scalar, z: Array, args: Args) -> Array:
        return self.fn(t, z, eqx.filter(args, eqx.is_array))

    def for_step(self, h: Scalar) -> "FlatField":
        """This field for a step of length `h`: a zero-length step (a finished lane's, stepping
        on masked under `vmap`) takes `I` for a singular `M`, so that its equations `Z = 0`
        keep one finite solution and finite derivatives, as an ODE's zero-length step does."""
        if self.mass is None:
            return self
        mass = jnp.asarray(self.mass)
        identity = jnp.eye(mass.shape[0], dtype=mass.dtype)
        return dataclasses.replace(self, mass=jnp.where(h == 0, identity, mass))

    def mass_times(self, v: Array) -> Array:
        """`M v` over the last axis of `v` (`v` itself without a mass matrix)."""
        return v if self.mass is None else v @ jnp.asarray(self.mass, v.dtype).T

    def shifted(self, jacobian: Array, shift) -> Array:
        """`M - shift J` (`I - shift J` without a mass matrix), in the dtype of `shift J`."""
        product = jnp.asarray(shift) * jacobian
        if self.mass is None:
            return jnp.eye(jacobian.shape[0], dtype=product.dtype) - product
        return jnp.asarray(self.mass, product.dtype) - product

    def ravel(self, tree: Y) -> Array:
        """`tree`, structured like the state, in the field's coordinates."""
        return self.coordinates.ravel(tree)

    def unravel(self, z: Array) -> Y:
        """The state whose coordinates are `z`."""
        return self.coordinates.unravel(z)


def exact_jacobian(field: FlatField, t: Scalar, z: Array, args: Args) -> Array:
    """`df/dz` of `field` at `(t, z)`, by `jax.jacfwd`; replicated where `z` is sharded by its
    type over `Explicit` mesh axes (its LU factors need the whole matrix: `replicated`)."""
    return replicated(jax.jacfwd(field, argnums=1)(t, z, args))


class Jacobian(eqx.Module):
    """`df/dy` as an `(m, m)` matrix in real coordinates (`m` = the real state's size, or twice
    the complex components' count plus the real ones'): `jax.jacfwd` of the field, or the
    user's `jac(t, y, args)` (which receives the state in its original structure). For a state
    with complex leaves the user may return either that real matrix (exact for any field) or
    the complex `(n, n)` matrix `df_i/dy_j` over its `n` components (exact for holomorphic
    fields).

    The matrix of Newton's iteration (and of a Rosenbrock step's formula): a user's `jac` may
    be approximate or stale, so the derivatives of converged stages never use it
    (`AbstractSystem.matrix` takes `exact_jacobian`)."""

    jac: Callable | None = eqx.field(static=True)

    def __call__(self, field: FlatField, t: Scalar, z: Array, args: Args) -> Array:
        if self.jac is None:
            return exact_jacobian(field, t, z, args)
        out = replicated(jnp.asarray(self.jac(t, field.unravel(z), args)))
        coordinates = field.coordinates
        m, n = z.shape[0], coordinates.num_components
        if out.shape == (m, m):
            return out.astype(z.dtype)
        if coordinates.has_complex and out.shape == (n, n):
            return coordinates.real_matrix(out).astype(z.dtype)
        expected = f"({n}, {n})" if m == n else f"({n}, {n}) (complex) or ({m}, {m}) (real)"
        raise ValueError(
            f"The user Jacobian `jac(t, y, args)` returned shape {out.shape}, but the state "
            f"has {n} components, so it must return {expected}: J[i, j] = d f_i / d y_j "
            "over the state raveled by `jax.flatten_util.ravel_pytree` (for the real form, "
            "over its real coordinates: each complex number as its real part followed by its "
            "imaginary part). Fix: return that matrix, or drop `jac=` to use `jax.jacfwd`."
        )


class AbstractSystem(eqx.Module):
    """A nonlinear system `residual(z) = 0` that a Newton method solves: one implicit stage of
    an ESDIRK or BDF step (`Stage`), or all the stages of a collocation step at once (Radau
    IIA). Its solution is differentiated by the implicit function theorem."""

    @abc.abstractmethod
    def residual(self, z: Array) -> Array:
        """The residual at `z`; zero at the solution."""

    @abc.abstractmethod
    def matrix(self, z: Array) -> Array:
        """The exact derivative `d residual / dz` at `z`, as a dense matrix (from
        `exact_jacobian`, never a user's `jac`: the implicit function theorem needs the
        derivative itself)."""

    @abc.abstractmethod
    def num_components(self) -> int:
        """How many components the root mean square of an increment averages over."""

    @abc.abstractmethod
    def modulus(self, z: Array) -> Array:
        """For each entry of `z`, the size of the state value it stands for (the rounding
        level of an increment is relative to it)."""


class Stage(AbstractSystem):
    """One implicit stage: find `z` with `z = base + hg * field(t, z, args)` (with a mass
    matrix, `M (z - base) = hg * field(t, z, args)`)."""

    field: FlatField
    t: Scalar
    hg: Scalar
    base: Array
    args: Args

    def residual(self, z: Array) -> Array:
        hg = jnp.asarray(self.hg, z.dtype)
        return self.field.mass_times(z - self.base) - hg * self.field(self.t, z, self.args)

    def matrix(self, z: Array) -> Array:
        hg = jnp.asarray(self.hg, z.dtype)
        return self.field.shifted(exact_jacobian(self.field, self.t, z, self.args), hg)

    def num_components(self) -> int:
        return self.field.coordinates.num_components

    def modulus(self, z: Array) -> Array:
        return self.field.coordinates.modulus(z)
