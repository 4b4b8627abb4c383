"""Newton's method for the implicit stages of a stepper, in the lineax shape: `prepare` sets up
the linear solver once per attempted step (evaluates or reuses the Jacobian, factorises), then
`solve` uses it for every iteration of every stage.

The stage equations are `z = base + hg * fn(t, z, args)` in flat real coordinates (the state
raveled into one vector, each complex number as its real and imaginary parts: see
`odeckpt._real_coordinates`), or any other `AbstractSystem` (Radau IIA solves its three
stages as one system, with the real and the complex factorisation that `prepare` makes on
request). Their solution is differentiated by the implicit function theorem, never through the
iterations: the derivative of `z` is one linear solve with the exact matrix `d residual / dz`
(for a stage, `I - hg df/dz`, with `df/dz` from `jax.jacfwd` of `f` even where Newton's
iteration used a user's `jac`, which may be approximate) at the converged `z`, in a form JAX
can transpose (`jax.lax.custom_linear_solve` on one LU factorisation), so that forward mode
(`jax.jvp`) and reverse mode (`jax.vjp`, whose transpose reuses the same factorisation) both
work.

**References:** E. Hairer & G. Wanner, *Solving Ordinary Differential Equations II*, 2nd ed.
(1996), Sec. IV.8 (simplified Newton iterations, their stopping and divergence criteria, and
when to re-evaluate the Jacobian); D. A. Knoll & D. E. Keyes, "Jacobian-free Newton-Krylov
methods: a survey", *J. Comput. Phys.* 193 (2004), 357-397.
"""

import abc
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import lineax as lx
import numpy as np
from jaxtyping import Array

from ._checks import known_values
from ._real_coordinates import RealCoordinates
from ._types import Args, BoolScalar, IntScalar, Scalar, VectorField, Y

_DEFAULT_RTOL, _DEFAULT_ATOL = 1e-6, 1e-8
"""Newton tolerances of a stepper used outside `odeckpt.solve` (which passes its own)."""


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

    @classmethod
    def make(cls, f: VectorField, t0: Scalar, y0: Y, args: Args) -> tuple["FlatField", Array]:
        """The flat field of `f` and the flat `y0`. The non-array leaves of `args` are closed
        over: closure conversion compares them with `==`, which a NaN never passes."""
        coordinates, y0_flat = RealCoordinates.make(y0)
        arrays, static = eqx.partition(args, eqx.is_array)

        def fn(t, z, arrays):
            return coordinates.ravel(f(t, coordinates.unravel(z), eqx.combine(arrays, static)))

        return cls(eqx.filter_closure_convert(fn, t0, y0_flat, arrays), coordinates), y0_flat

    def __call__(self, t: Scalar, z: Array, args: Args) -> Array:
        return self.fn(t, z, eqx.filter(args, eqx.is_array))

    def ravel(self, tree: Y) -> Array:
        """`tree`, structured like the state, in the field's coordinates."""
        return self.coordinates.ravel(tree)

    def unravel(self, z: Array) -> Y:
        """The state whose coordinates are `z`."""
        return self.coordinates.unravel(z)


def exact_jacobian(field: FlatField, t: Scalar, z: Array, args: Args) -> Array:
    """`df/dz` of `field` at `(t, z)`, by `jax.jacfwd`."""
    return jax.jacfwd(field, argnums=1)(t, z, args)


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
        out = jnp.asarray(self.jac(t, field.unravel(z), args))
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
    """One implicit stage: find `z` with `z = base + hg * field(t, z, args)`."""

    field: FlatField
    t: Scalar
    hg: Scalar
    base: Array
    args: Args

    def residual(self, z: Array) -> Array:
        return z - self.base - jnp.asarray(self.hg, z.dtype) * self.field(self.t, z, self.args)

    def matrix(self, z: Array) -> Array:
        hg = jnp.asarray(self.hg, z.dtype)
        identity = jnp.eye(z.shape[0], dtype=z.dtype)
        return identity - hg * exact_jacobian(self.field, self.t, z, self.args)

    def num_components(self) -> int:
        return self.field.coordinates.num_components

    def modulus(self, z: Array) -> Array:
        return self.field.coordinates.modulus(z)


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

    def with_tolerances(self, rtol: float, atol: float, replace: bool = False) -> "AbstractNewton":
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
        rtol = _DEFAULT_RTOL if self.rtol is None else self.rtol
        atol = _DEFAULT_ATOL if self.atol is None else self.atol
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
        final = jax.lax.while_loop(cond, body, carry)
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


class ShiftedLU(eqx.Module):
    """The LU factors of `I - s J` for one shift `s`, real or complex (a complex `s` makes a
    complex factorisation of the real Jacobian `J`)."""

    lu: Array
    pivots: Array

    @classmethod
    def factor(cls, jacobian: Array, shift: Scalar) -> "ShiftedLU":
        complex_shift = jnp.iscomplexobj(shift)
        dtype = jnp.result_type(jacobian.dtype, jnp.complex64) if complex_shift else jacobian.dtype
        identity = jnp.eye(jacobian.shape[0], dtype=dtype)
        lu, pivots = jsl.lu_factor(identity - jnp.asarray(shift, dtype) * jacobian)
        return cls(lu, pivots.astype(jnp.int32))

    @classmethod
    def empty(cls, n: int, dtype) -> "ShiftedLU":
        return cls(jnp.zeros((n, n), dtype), jnp.zeros((n,), jnp.int32))

    def solve(self, rhs: Array) -> Array:
        """`(I - s J)^{-1} rhs`."""
        return jsl.lu_solve((self.lu, self.pivots), rhs.astype(self.lu.dtype))


def same_step_size(h: Scalar, reference: Scalar) -> BoolScalar:
    """Whether `h` is `reference` up to the rounding of the times that make it (`t1 - t0` with
    `t1 = t0 + dt` is `dt` only to `eps |t1|`), so that factors of `I - h gamma J` and
    histories spaced by `reference` still serve. False when `reference` is NaN."""
    return jnp.abs(h - reference) <= _SAME_STEP * jnp.abs(reference)


_SAME_STEP = 1e-8
"""Relative difference of step sizes below which they count as the same (see `same_step_size`):
the rounding of `t0 + dt` relative to `dt` up to `|t| / dt` of about 1e7."""


class JacobianCache(eqx.Module):
    """What `Newton` keeps between steps: the Jacobian, the LU factors of `I - hg J` (and of
    `I - hg_complex J` when a stepper asks for them) and when to re-evaluate."""

    jacobian: Array
    lu: ShiftedLU
    lu_complex: ShiftedLU | None
    hg: Scalar
    refresh: BoolScalar
    """Evaluate the Jacobian at the start of the next attempt."""
    current: BoolScalar
    """The Jacobian was evaluated at the current point (no step accepted since)."""


class Newton(AbstractNewton):
    """Simplified ("chord") Newton with a dense Jacobian, reused across stages and steps.

    The Jacobian (`jax.jacfwd` of the vector field, or the stepper's `jac=`) is evaluated only
    when the previous step's iteration converged slowly (largest contraction factor above
    `reuse_rate`) or failed; `I - hg J` is factorised (LU) only when the Jacobian or the step
    size changed. The Jacobian and its LU factors live in the stepper state, so they persist
    across steps (and a checkpointing adjoint stores them in every snapshot: `2 n^2` numbers for
    an `n`-dimensional state). Good up to a few thousand components; beyond, see
    `NewtonKrylov`.

    **Arguments:**

    - `rtol`, `atol`: the norm of the Newton increments is scaled by `atol + rtol |y|`; `None`
        takes the tolerances of the solve.
    - `kappa`: stop when the estimated remaining error is below `kappa` times the tolerance.
    - `max_iters`: most iterations per stage before the step counts as failed.
    - `reuse_rate`: re-evaluate the Jacobian after a step whose iterations contracted more
        slowly than this factor per iteration (Hairer & Wanner's RADAU5 uses 0.001, and 0.1
        when the Jacobian is expensive; see `docs/architecture.md` for why a lax value costs
        more than it saves).
    - `tangent_solve`: how a stage's derivative (implicit function theorem) is solved:
        `"exact"` with `jax.jacfwd` of the vector field at the stage (never the stepper's
        `jac=`, which may be approximate) and its LU factors (transposable: reverse mode);
        `"staggered"` by iterating with the step's LU factors and exact Jacobian-vector
        products until the increments are below the tolerances (the staggered corrector of
        forward sensitivity analysis: no extra Jacobian or factorisation; forward mode
        only). `odeckpt.ForwardSensitivity` selects `"staggered"`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    solver = odeckpt.Kvaerno5(newton=odeckpt.Newton(kappa=1e-2, reuse_rate=0.1))
    sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, 1.0), args=1e3,
                        solver=solver)
    ```

    **References:** Hairer & Wanner, *Solving ODEs II*, Sec. IV.8.
    """

    rtol: float | None = None
    atol: float | None = None
    kappa: float = 1e-2
    max_iters: int = eqx.field(default=10, static=True)
    reuse_rate: float = 0.05
    tangent_solve: str = eqx.field(default="exact", static=True)

    def __check_init__(self):
        _check_common(self)
        if not 0 < self.reuse_rate < 1:
            raise ValueError(f"Newton(reuse_rate={self.reuse_rate}) must be in (0, 1).")
        if self.tangent_solve not in ("exact", "staggered"):
            raise ValueError(
                f"Newton(tangent_solve={self.tangent_solve!r}) must be 'exact' or 'staggered'."
            )

    def init_cache(self, y0, t0, with_complex=False):
        n = y0.shape[0]
        complex_dtype = jnp.result_type(y0.dtype, jnp.complex64)
        return JacobianCache(
            jacobian=jnp.zeros((n, n), y0.dtype),
            lu=ShiftedLU.empty(n, y0.dtype),
            lu_complex=ShiftedLU.empty(n, complex_dtype) if with_complex else None,
            hg=jnp.full((), jnp.nan, t0.dtype),
            refresh=jnp.array(True),
            current=jnp.array(False),
        )

    def prepare(self, jacobian, field, t0, y0, args, hg, cache, hg_complex=None):
        # The iteration only has to converge: nothing here is differentiated.
        t0, y0, args, field, hg, hg_complex, cache = no_grad(
            (t0, y0, args, field, hg, hg_complex, cache)
        )
        evaluate = cache.refresh
        matrix = jax.lax.cond(
            evaluate, lambda: jacobian(field, t0, y0, args), lambda: cache.jacobian
        )
        refactor = evaluate | ~same_step_size(hg, cache.hg)
        shifts = (hg,) if hg_complex is None else (hg, hg_complex)
        old = (cache.lu,) if hg_complex is None else (cache.lu, cache.lu_complex)
        factors = jax.lax.cond(
            refactor,
            lambda: tuple(ShiftedLU.factor(matrix, jnp.asarray(s)) for s in shifts),
            lambda: old,
        )
        # Keep the step size the factors belong to: a step within rounding of it reuses them.
        hg = jnp.where(refactor, hg, cache.hg)
        lu_complex = factors[1] if hg_complex is not None else None
        cache = JacobianCache(
            matrix, factors[0], lu_complex, hg, cache.refresh, cache.current | evaluate
        )
        return Prepared(
            solve=factors[0].solve,
            cache=cache,
            num_jacobian_evals=evaluate.astype(jnp.int32),
            num_lu_factorisations=len(shifts) * refactor.astype(jnp.int32),
            solve_complex=None if lu_complex is None else lu_complex.solve,
            factors=factors[0],
        )

    def refreshed(self, cache):
        return dataclasses.replace(cache, refresh=jnp.array(True))

    def next_caches(self, cache, failed, rate):
        slow = failed | (rate > self.reuse_rate)
        accepted = dataclasses.replace(cache, refresh=slow, current=jnp.array(False))
        rejected = dataclasses.replace(cache, refresh=slow & ~cache.current)
        return accepted, rejected

    def reuses_factors(self, cache):
        return ~cache.refresh

    def tangent(self, system, z, rhs, factors):
        if self.tangent_solve == "staggered" and isinstance(system, Stage):
            return self._staggered(system, z, rhs, factors)
        return lu_solver(system.matrix(z))(rhs)

    def _staggered(self, stage: Stage, z: Array, rhs: Array, factors) -> Array:
        """`(I - hg J(z))^{-1} rhs` by the iteration `x <- x + M^{-1} (rhs - (I - hg J(z)) x)`
        with `M` the step's factors of `I - hg J` (`J` possibly from an earlier point), the
        products `J(z) x` exact (Jacobian-vector products); stopped as Newton's iteration is,
        in the norm scaled by `atol + rtol |x|`. NaN if it diverges or does not converge in
        `max_iters` iterations, so that the step is rejected and retried shorter.

        **References:** CVODES documentation, "Forward sensitivity analysis", the staggered
        corrector method; M. Feehery, J. Tolsma & P. Barton, *Appl. Numer. Math.* 25 (1997).
        """
        solve = factors.solve
        matvec = lambda v: jax.jvp(stage.residual, (z,), (v,))[1]
        coordinates = stage.field.coordinates
        rtol = _DEFAULT_RTOL if self.rtol is None else self.rtol
        atol = _DEFAULT_ATOL if self.atol is None else self.atol
        eps = jnp.finfo(z.dtype).eps
        count = max(coordinates.num_components, 1)  # a state without components: norm 0

        def norm(d, x):
            weight = atol + rtol * coordinates.modulus(x)
            return jnp.sqrt(jnp.sum(jnp.abs(d / weight) ** 2) / count)

        def cond(carry):
            _, k, _, done, failed = carry
            return ~done & ~failed & (k < self.max_iters)

        def body(carry):
            x, k, previous, _, _ = carry
            dx = solve(rhs - matvec(x))
            x = x + dx
            size = norm(dx, x)
            theta = size / jnp.where(previous > 0, previous, 1.0)
            rounding = size <= norm(10 * eps * coordinates.modulus(x), x)
            done = ((theta < 1) & (theta / (1 - theta) * size <= 1e-3 * self.kappa)) | rounding
            failed = ~done & ((theta >= 1) | ~jnp.isfinite(size))
            return x, k + 1, size, done, failed

        x0 = solve(rhs)
        zero = jnp.zeros((), z.dtype)
        carry = (x0, jnp.zeros((), jnp.int32), norm(x0, x0), jnp.array(False), ~jnp.isfinite(zero))
        x, _, _, done, _ = jax.lax.while_loop(cond, body, carry)
        return jnp.where(done, x, jnp.nan)


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
            lambda v: self.matrix @ v,
            rhs,
            lambda _, b: jsl.lu_solve(self.factors, b),
            transpose_solve=lambda _, b: jsl.lu_solve(self.factors, b, trans=1),
        )


def lu_solver(matrix: Array) -> LUSolver:
    """An `LUSolver` for `matrix`, factorised once."""
    return LUSolver(matrix, jsl.lu_factor(jax.lax.stop_gradient(matrix)))


class NewtonKrylov(AbstractNewton):
    """Matrix-free Newton-Krylov: each Newton system is solved by GMRES (lineax) with
    Jacobian-vector products of the vector field linearised once per attempted step, so the
    Jacobian is never formed or stored. For large systems (discretised PDEs) whose Jacobian
    does not fit in memory or is expensive to factorise. Unpreconditioned: GMRES needs more
    iterations as `h * stiffness` grows.

    **Arguments:**

    - `rtol`, `atol`, `kappa`, `max_iters`: as for `Newton`.
    - `krylov_rtol`: relative tolerance of each GMRES solve inside the Newton iteration.
    - `tangent_rtol`: relative tolerance of the GMRES solves of the derivative (implicit
        function theorem); derivatives are accurate to about this.
    - `restart`, `max_krylov_steps`: GMRES restart length and most iterations.

    Counts one Jacobian evaluation (a linearisation) and no LU factorisation per step.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def heat(t, u, args):
        return 100.0 * (jnp.roll(u, 1) - 2 * u + jnp.roll(u, -1))

    solver = odeckpt.Kvaerno3(newton=odeckpt.NewtonKrylov())
    sol = odeckpt.solve(heat, jnp.sin(jnp.linspace(0, 6.28, 200)), (0.0, 0.1), solver=solver)
    ```

    **References:** Knoll & Keyes (2004); Y. Saad & M. H. Schultz, "GMRES", *SIAM J. Sci. Stat.
    Comput.* 7(3) (1986).
    """

    rtol: float | None = None
    atol: float | None = None
    kappa: float = 1e-2
    max_iters: int = eqx.field(default=10, static=True)
    krylov_rtol: float = 1e-4
    tangent_rtol: float = 1e-10
    restart: int = eqx.field(default=20, static=True)
    max_krylov_steps: int = eqx.field(default=200, static=True)

    def __check_init__(self):
        _check_common(self)
        for name in ("krylov_rtol", "tangent_rtol"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"NewtonKrylov({name}={getattr(self, name)}) must be in (0, 1).")

    def init_cache(self, y0, t0, with_complex=False):
        return None

    def _gmres(self, rtol: float) -> lx.GMRES:
        return lx.GMRES(rtol=rtol, atol=0.0, restart=self.restart, max_steps=self.max_krylov_steps)

    def prepare(self, jacobian, field, t0, y0, args, hg, cache, hg_complex=None):
        del jacobian, cache
        t0, y0, args, field, hg, hg_complex = no_grad((t0, y0, args, field, hg, hg_complex))
        _, jvp = jax.linearize(lambda y: field(t0, y, args), y0)
        hg = jnp.asarray(hg, y0.dtype)
        operator = lx.FunctionLinearOperator(
            lambda v: v - hg * jvp(v), jax.ShapeDtypeStruct(y0.shape, y0.dtype)
        )
        solver = self._gmres(self.krylov_rtol)
        solve = lambda op, r: lx.linear_solve(op, r, solver, throw=False).value
        solve_complex = None
        if hg_complex is not None:
            # (I - s J)(x + iy) as a real operator on (x, y): J is real.
            s = jnp.asarray(hg_complex)
            sr, si = jnp.real(s).astype(y0.dtype), jnp.imag(s).astype(y0.dtype)

            def pair(v):
                x, y = jvp(v[0]), jvp(v[1])
                return jnp.stack([v[0] - sr * x + si * y, v[1] - sr * y - si * x])

            pairs = lx.FunctionLinearOperator(pair, jax.ShapeDtypeStruct((2, *y0.shape), y0.dtype))
            solve_complex = lambda r: jax.lax.complex(
                *solve(pairs, jnp.stack([jnp.real(r), jnp.imag(r)]))
            )
        return Prepared(
            solve=lambda r: solve(operator, r),
            cache=None,
            num_jacobian_evals=jnp.ones((), jnp.int32),
            num_lu_factorisations=jnp.zeros((), jnp.int32),
            solve_complex=solve_complex,
        )

    def next_caches(self, cache, failed, rate):
        return None, None

    def reuses_factors(self, cache):
        return jnp.array(False)

    def tangent(self, system, z, rhs, factors):
        del factors
        structure = jax.ShapeDtypeStruct(z.shape, z.dtype)
        gmres = self._gmres(self.tangent_rtol)

        def solve(matvec, b):
            # A zero right-hand side (a symbolic-zero cotangent, a masked step) would make
            # GMRES break down: its solution is zero.
            zero = jnp.all(b == 0)
            operator = lx.FunctionLinearOperator(matvec, structure)
            x = lx.linear_solve(operator, jnp.where(zero, 1, b), gmres, throw=False).value
            return jnp.where(zero, 0, x)

        matvec = lambda v: jax.jvp(system.residual, (z,), (v,))[1]
        # custom_linear_solve transposes by solving with the transposed operator (vjp of the
        # residual), so reverse mode needs no differentiation through GMRES itself.
        return jax.lax.custom_linear_solve(matvec, rhs, solve, transpose_solve=solve)


def _check_common(newton: AbstractNewton) -> None:
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
