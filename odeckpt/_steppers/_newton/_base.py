"""The contract of a Newton method for the implicit stages of a stepper (`AbstractNewton`), in
the lineax shape: `prepare` sets up the linear solver once per attempted step (evaluates or
reuses the Jacobian, factorises), then `solve` uses it for every iteration of every stage.

The stage equations are `z = base + hg * fn(t, z, args)` in flat real coordinates (see
`_system`), or any other `AbstractSystem` (Radau IIA solves its three stages as one system,
with the real and the complex factorisation that `prepare` makes on request). Their solution is
differentiated by the implicit function theorem, never through the iterations: the derivative
of `z` is one linear solve with the exact matrix `d residual / dz` (for a stage,
`I - hg df/dz`, with `df/dz` from `jax.jacfwd` of `f` even where Newton's iteration used a
user's `jac`, which may be approximate) at the converged `z`, in a form JAX can transpose
(`jax.lax.custom_linear_solve` on one LU factorisation), so that forward mode (`jax.jvp`) and
reverse mode (`jax.vjp`, whose transpose reuses the same factorisation) both work.

**References:** E. Hairer & G. Wanner, *Solving Ordinary Differential Equations II*, 2nd ed.
(1996), Sec. IV.8 (simplified Newton iterations, their stopping and divergence criteria).
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..._checks import known_values
from ..._real_coordinates import RealCoordinates
from ..._types import Args, BoolScalar, IntScalar, Scalar, ScalarLike, Y
from ...checkpointing import lockstep_while_loop
from ._system import AbstractSystem, FlatField, Jacobian, no_grad

DEFAULT_RTOL, DEFAULT_ATOL = 1e-6, 1e-8
"""Newton tolerances of a stepper used outside `odeckpt.solve` (which passes its own)."""


class Iteration(eqx.Module):
    """The outcome of one stage's Newton iteration."""

    converged: BoolScalar
    rate: Scalar
    """Largest contraction factor `||dz_k|| / ||dz_{k-1}||` observed (0 after one iteration)."""
    eta: Scalar
    """Hairer and Wanner's `eta = theta / (1 - theta)` of the largest contraction factor
    observed (after a single iteration, the estimate it started from), which starts the next
    stage's test."""
    num_iterations: IntScalar
    """Iterations taken, each one evaluation of the vector field."""
    nonfinite: BoolScalar
    """The iteration stopped at a NaN or inf increment (the vector field returned one)."""


class Prepared(eqx.Module):
    """A linear solver set up for one attempted step, and what setting it up cost.

    `solve(r)` solves `(I - hg J) x = r`; `solve_complex(r)` solves `(I - hg_complex J) x = r`
    for a complex `r` (`None` unless `prepare` was given `hg_complex`).
    """

    solve: Callable[[Array], Array]
    cache: Y
    num_jacobian_evals: IntScalar
    num_lu_factorisations: IntScalar
    solve_complex: Callable[[Array], Array] | None = None
    factors: Y = None
    """The factors behind `solve` (a `ShiftedLU`; `None` for a matrix-free method)."""


class _NewtonCarry(NamedTuple):
    """The carry of `AbstractNewton._iterate`: the iterate `z`, the iterations taken, the norm
    of the last increment, `eta`, the largest contraction factor so far, and whether the
    iteration has converged or diverged."""

    z: Array
    num_iterations: IntScalar
    last_size: Scalar
    eta: Scalar
    rate: Scalar
    converged: BoolScalar
    diverged: BoolScalar


class AbstractNewton(eqx.Module):
    """A Newton method for the implicit stages of `odeckpt` steppers.

    Iterates `z <- z + dz` with `(I - hg J) dz = -(z - base - hg f(t, z))` and stops with Hairer
    and Wanner's test `eta_k ||dz_k|| <= kappa`, in the root-mean-square norm scaled by
    `atol + rtol |y0|` (Sec. IV.8, eqs. (8.10)-(8.13)). The iteration is abandoned as divergent
    when a contraction factor `theta_k >= 1`, or when `theta_k` predicts that `max_iters`
    iterations will not reach the tolerance; the stepper then reports the step as failed, and the
    solve retries it with half the step size.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    newton: odeckpt.AbstractNewton = odeckpt.NewtonKrylov()  # or odeckpt.Newton()
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Kvaerno5(newton=newton))
    ```
    """

    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    kappa: eqx.AbstractVar[float]
    max_iters: eqx.AbstractVar[int]

    @abc.abstractmethod
    def init_cache(self, y0: Array, t0: Scalar, with_complex: bool = False) -> Y:
        """What the stepper state keeps between steps for this method (e.g. the Jacobian);
        `with_complex` if `prepare` will be given `hg_complex`."""

    @abc.abstractmethod
    def prepare(
        self,
        jacobian: Jacobian,
        field: FlatField,
        t0: Scalar,
        y0: Array,
        args: Args,
        hg,
        cache,
        hg_complex=None,
    ) -> Prepared:
        """Set up the linear solves of one attempted step from `(t0, y0)`: with `I - hg J`
        (`hg = h * gamma`) and, given the complex `hg_complex` (a fixed multiple of `hg`, as for
        Radau IIA's complex pair of eigenvalues), with `I - hg_complex J`."""

    @abc.abstractmethod
    def next_caches(self, cache: Y, failed: BoolScalar, rate: Scalar) -> tuple[Y, Y]:
        """The caches to carry if the step is accepted and if it is rejected."""

    @abc.abstractmethod
    def reuses_factors(self, cache: Y) -> BoolScalar:
        """Whether the next attempt, at the same step size, would reuse the factorisations in
        `cache` (a stepper may then keep its step size to save them)."""

    @abc.abstractmethod
    def tangent(self, system: AbstractSystem, z: Array, rhs: Array, factors) -> Array:
        """`(d residual / dz (z))^{-1} rhs` (for a `Stage`: `(I - hg df/dz(z))^{-1} rhs`),
        linear in `rhs` (and transposable, except where a method says otherwise); `factors`
        are the attempt's `Prepared.factors` (of a matrix that may be approximate)."""

    def refreshed(self, cache: Y) -> Y:
        """`cache`, asking for a Jacobian at the next attempt (unchanged for a method that
        keeps none)."""
        return cache

    def with_tolerances(
        self, rtol: ScalarLike, atol: ScalarLike, replace: bool = False
    ) -> "AbstractNewton":
        """This method with unset tolerances (with `replace`, all) taken from `rtol` and
        `atol`."""
        return dataclasses.replace(
            self,
            rtol=rtol if replace or self.rtol is None else self.rtol,
            atol=atol if replace or self.atol is None else self.atol,
        )

    def scale(self, coordinates: RealCoordinates, y0: Array) -> Array:
        """The weights `atol + rtol |y0|` of the norm of the Newton increments (`|y0|` of each
        component: a complex number's modulus for both its coordinates)."""
        rtol = DEFAULT_RTOL if self.rtol is None else self.rtol
        atol = DEFAULT_ATOL if self.atol is None else self.atol
        # Not differentiated (the tolerances may be traced arrays the loop differentiates).
        return jax.lax.stop_gradient(atol + rtol * coordinates.modulus(y0))

    def solve(
        self,
        stage: AbstractSystem,
        guess: Array,
        prepared: Prepared,
        scale: Array,
        eta: Scalar,
        skip: BoolScalar | bool = False,
    ) -> tuple[Array, Iteration]:
        """The solution of `stage` (differentiable by the implicit function theorem) and how
        the iteration went. A failed iteration returns `guess`; with `skip` (an earlier stage
        of the step failed, so the step will be retried) no iteration is taken and it fails.
        `scale` weighs the entries of the increments, `prepared.solve` maps a residual to an
        increment."""
        guess = jax.lax.stop_gradient(guess)
        z, info = self._iterate(no_grad(stage), guess, prepared, scale, eta, skip)
        z = jnp.where(info.converged, z, jax.lax.stop_gradient(guess))
        z = jax.lax.stop_gradient(z)
        factors = no_grad(prepared.factors)
        # The method's settings (tolerances, which may be traced arrays) are not differentiated.
        value = _stage_value(stage, z, factors, newton=no_grad(self))
        return value, info

    def _iterate(self, stage, guess, prepared, scale, eta0, skip) -> tuple[Array, Iteration]:
        eps = jnp.finfo(scale.dtype).eps
        eta0 = jnp.maximum(jax.lax.stop_gradient(eta0), eps) ** 0.8
        # Root mean square over the state's components (a complex number counts once).
        count = max(stage.num_components(), 1)  # a state without components: norm 0
        norm = lambda d: jnp.sqrt(jnp.sum(jnp.abs(d / scale) ** 2) / count)

        def cond(carry: _NewtonCarry) -> BoolScalar:
            running = ~carry.converged & ~carry.diverged
            return running & (carry.num_iterations < self.max_iters)

        def body(carry: _NewtonCarry) -> _NewtonCarry:
            z, k, previous = carry.z, carry.num_iterations, carry.last_size
            dz = prepared.solve(-stage.residual(z))
            size = norm(dz)
            first = k == 0
            theta = jnp.where(first, 0.0, size / jnp.where(previous > 0, previous, 1.0))
            eta = jnp.where(first, eta0, theta / jnp.where(theta < 1, 1 - theta, 1.0))
            # An increment at the rounding level of z is converged, whatever the tolerance asks
            # (e.g. atol below float32 precision); its contraction rate is noise.
            rounding = size <= norm(10 * eps * stage.modulus(z))
            converged = (eta * size <= self.kappa) | rounding
            remaining = self.max_iters - 1 - k
            too_slow = theta**remaining / jnp.where(theta < 1, 1 - theta, 1.0) * size > self.kappa
            diverged = ~converged & ((~first & ((theta >= 1) | too_slow)) | ~jnp.isfinite(size))
            return _NewtonCarry(
                z + dz, k + 1, size, eta, jnp.maximum(carry.rate, theta), converged, diverged
            )

        zero = jnp.zeros((), scale.dtype)
        skip = jnp.asarray(skip)
        # A skipped iteration starts as diverged: it takes no iteration and fails.
        carry = _NewtonCarry(
            z=guess, num_iterations=jnp.zeros((), jnp.int32), last_size=zero, eta=eta0,
            rate=zero, converged=jnp.zeros_like(skip), diverged=skip,
        )  # fmt: skip
        final = lockstep_while_loop(cond, body, carry)
        nonfinite = ~final.converged & ~jnp.isfinite(final.last_size)
        # The next test starts from the slowest contraction seen, not the last: where the
        # iterate became exact (linear stages, or components that others drive but that drive
        # none, as an adjoint's parameter integral) the last factor is rounding noise, and the
        # next stage, trusting it, would stop after one iteration short of the tolerance.
        slowest = final.rate / jnp.where(final.rate < 1, 1 - final.rate, 1.0)
        eta = jnp.where(final.num_iterations > 1, jnp.maximum(final.eta, slowest), final.eta)
        return final.z, Iteration(
            converged=final.converged, rate=final.rate, eta=eta,
            num_iterations=final.num_iterations, nonfinite=nonfinite,
        )  # fmt: skip


def implicit_solution(system: AbstractSystem, z: Array, newton: AbstractNewton) -> Array:
    """`z`, a converged solution of `system` found without derivatives, with the derivative of
    the exact solution (the implicit function theorem, solved by `newton.tangent` with the
    exact matrix of `system`)."""
    return _stage_value(system, z, None, newton=newton)


@eqx.filter_custom_jvp
def _stage_value(stage: AbstractSystem, z: Array, factors, *, newton: AbstractNewton) -> Array:
    """`z`, the converged solution of `stage`, with the derivative of the exact solution."""
    del stage, factors, newton
    return z


@_stage_value.def_jvp
def _stage_value_jvp(primals, tangents, *, newton: AbstractNewton):
    # Implicit function theorem: G(z, p) = 0 gives dz = -(dG/dz)^{-1} (dG/dp dp).
    stage, z, factors = primals
    d_stage, _, _ = tangents
    # `z` arrives without derivatives (the iteration is not differentiated); taken through
    # `_stage_value` again, it carries those of an enclosing differentiation, so that the
    # tangent below, a function of `z`, has the right derivatives too (second derivatives).
    z = _stage_value(stage, z, factors, newton=newton)
    _, rhs = eqx.filter_jvp(lambda s: s.residual(z), (stage,), (d_stage,))
    return z, -newton.tangent(stage, z, rhs, factors)


def check_settings(newton: AbstractNewton) -> None:
    """Raise, naming the fix, if the settings every Newton method has are out of range."""
    name = type(newton).__name__
    for field in ("rtol", "atol"):
        value = known_values(f"{name}({field})", getattr(newton, field))  # None if traced
        if value is not None and not np.all(value > 0):
            raise ValueError(f"{name}({field}={getattr(newton, field)}) must be positive or None.")
    kappa = known_values(f"{name}(kappa)", newton.kappa)  # None if traced (set by a stepper)
    if kappa is not None and not np.all((0 < kappa) & (kappa < 1)):
        raise ValueError(f"{name}(kappa={newton.kappa}) must be in (0, 1); e.g. 1e-2.")
    if not isinstance(newton.max_iters, int) or newton.max_iters < 1:
        raise ValueError(f"{name}(max_iters={newton.max_iters!r}) must be a positive int.")
