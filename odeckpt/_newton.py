"""Newton's method for the implicit stages of a stepper, in the lineax shape: `prepare` sets up
the linear solver once per attempted step (evaluates or reuses the Jacobian, factorises), then
`solve` uses it for every iteration of every stage.

The stage equations are `z = base + hg * fn(t, z, args)` in flat real coordinates (the state
raveled into one vector, each complex number as its real and imaginary parts: see
`odeckpt._real_coordinates`). Their solution is differentiated by the implicit function theorem,
never through the iterations: the derivative of `z` is one linear solve with the exact matrix
`I - hg df/dz` at the converged `z`, in a form JAX can transpose (`jax.lax.custom_linear_solve`
on one LU factorisation), so that forward mode (`jax.jvp`) and reverse mode (`jax.vjp`, whose
transpose reuses the same factorisation) both work.

**References:** E. Hairer & G. Wanner, *Solving Ordinary Differential Equations II*, 2nd ed.
(1996), Sec. IV.8 (simplified Newton iterations, their stopping and divergence criteria, and
when to re-evaluate the Jacobian); D. A. Knoll & D. E. Keyes, "Jacobian-free Newton-Krylov
methods: a survey", *J. Comput. Phys.* 193 (2004), 357-397.
"""

import abc
import dataclasses
from collections.abc import Callable

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


class Jacobian(eqx.Module):
    """`df/dy` as an `(m, m)` matrix in real coordinates (`m` = the real state's size, or twice
    the complex components' count plus the real ones'): `jax.jacfwd` of the field, or the
    user's `jac(t, y, args)` (which receives the state in its original structure). For a state
    with complex leaves the user may return either that real matrix (exact for any field) or
    the complex `(n, n)` matrix `df_i/dy_j` over its `n` components (exact for holomorphic
    fields)."""

    jac: Callable | None = eqx.field(static=True)

    def __call__(self, field: FlatField, t: Scalar, z: Array, args: Args) -> Array:
        if self.jac is None:
            return jax.jacfwd(field, argnums=1)(t, z, args)
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


class Stage(eqx.Module):
    """One implicit stage: find `z` with `z = base + hg * field(t, z, args)`."""

    field: FlatField
    t: Scalar
    hg: Scalar
    base: Array
    args: Args

    def residual(self, z: Array) -> Array:
        return z - self.base - jnp.asarray(self.hg, z.dtype) * self.field(self.t, z, self.args)


class Iteration(eqx.Module):
    """The outcome of one stage's Newton iteration."""

    converged: BoolScalar
    rate: Scalar
    """Largest contraction factor `||dz_k|| / ||dz_{k-1}||` observed (0 after one iteration)."""
    eta: Scalar
    """Hairer and Wanner's `eta = theta / (1 - theta)`, which starts the next stage's test."""
    num_iterations: IntScalar
    """Iterations taken, each one evaluation of the vector field."""
    nonfinite: BoolScalar
    """The iteration stopped at a NaN or inf increment (the vector field returned one)."""


class Prepared(eqx.Module):
    """A linear solver set up for one attempted step, and what setting it up cost."""

    solve: Callable[[Array], Array]
    cache: Y
    num_jacobian_evals: IntScalar
    num_lu_factorisations: IntScalar


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
    newton: odeckpt.AbstractNewton = odeckpt.NewtonKrylov()  # or odeckpt.Newton()
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Kvaerno5(newton=newton))
    ```
    """

    rtol: eqx.AbstractVar[float | None]
    atol: eqx.AbstractVar[float | None]
    kappa: eqx.AbstractVar[float]
    max_iters: eqx.AbstractVar[int]

    @abc.abstractmethod
    def init_cache(self, y0: Array, t0: Scalar) -> Y:
        """What the stepper state keeps between steps for this method (e.g. the Jacobian)."""

    @abc.abstractmethod
    def prepare(
        self, jacobian: Jacobian, field: FlatField, t0: Scalar, y0: Array, args: Args, hg, cache
    ) -> Prepared:
        """Set up the linear solves of one attempted step from `(t0, y0)` with `h * gamma = hg`."""

    @abc.abstractmethod
    def next_caches(self, cache: Y, failed: BoolScalar, rate: Scalar) -> tuple[Y, Y]:
        """The caches to carry if the step is accepted and if it is rejected."""

    @abc.abstractmethod
    def tangent(self, jacobian: Jacobian, stage: Stage, z: Array, rhs: Array) -> Array:
        """`(I - hg df/dz(z))^{-1} rhs`, transposable and linear in `rhs`."""

    def with_tolerances(self, rtol: float, atol: float) -> "AbstractNewton":
        """This method with unset tolerances taken from `rtol` and `atol`."""
        return dataclasses.replace(
            self,
            rtol=rtol if self.rtol is None else self.rtol,
            atol=atol if self.atol is None else self.atol,
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
        jacobian: Jacobian,
        stage: Stage,
        guess: Array,
        prepared: Prepared,
        scale: Array,
        eta: Scalar,
        skip: BoolScalar | bool = False,
    ) -> tuple[Array, Iteration]:
        """The stage value (differentiable by the implicit function theorem) and how the
        iteration went. A failed iteration returns `guess`; with `skip` (an earlier stage of
        the step failed, so the step will be retried) no iteration is taken and it fails."""
        guess = jax.lax.stop_gradient(guess)
        z, info = self._iterate(no_grad(stage), guess, prepared, scale, eta, skip)
        z = jnp.where(info.converged, z, jax.lax.stop_gradient(guess))
        # The method's settings (tolerances, which may be traced arrays) are not differentiated.
        value = _stage_value(
            stage, jax.lax.stop_gradient(z), newton=no_grad(self), jacobian=jacobian
        )
        return value, info

    def _iterate(self, stage, guess, prepared, scale, eta0, skip) -> tuple[Array, Iteration]:
        eps = jnp.finfo(scale.dtype).eps
        eta0 = jnp.maximum(jax.lax.stop_gradient(eta0), eps) ** 0.8
        coordinates = stage.field.coordinates
        # Root mean square over the state's components (a complex number counts once).
        count = coordinates.num_components
        norm = lambda d: jnp.sqrt(jnp.sum(jnp.abs(d / scale) ** 2) / count)

        def cond(carry):
            _, k, _, _, _, done, diverged = carry
            return ~done & ~diverged & (k < self.max_iters)

        def body(carry):
            z, k, previous, eta, rate, _, _ = carry
            dz = prepared.solve(-stage.residual(z))
            size = norm(dz)
            first = k == 0
            theta = jnp.where(first, 0.0, size / jnp.where(previous > 0, previous, 1.0))
            eta = jnp.where(first, eta0, theta / jnp.where(theta < 1, 1 - theta, 1.0))
            # An increment at the rounding level of z is converged, whatever the tolerance asks
            # (e.g. atol below float32 precision); its contraction rate is noise.
            rounding = size <= norm(10 * eps * coordinates.modulus(z))
            done = (eta * size <= self.kappa) | rounding
            remaining = self.max_iters - 1 - k
            too_slow = theta**remaining / jnp.where(theta < 1, 1 - theta, 1.0) * size > self.kappa
            diverged = ~done & ((~first & ((theta >= 1) | too_slow)) | ~jnp.isfinite(size))
            return z + dz, k + 1, size, eta, jnp.maximum(rate, theta), done, diverged

        zero = jnp.zeros((), scale.dtype)
        skip = jnp.asarray(skip)
        carry = (guess, jnp.zeros((), jnp.int32), zero, eta0, zero, jnp.zeros_like(skip), skip)
        z, k, size, eta, rate, done, _ = jax.lax.while_loop(cond, body, carry)
        nonfinite = ~done & ~jnp.isfinite(size)
        return z, Iteration(
            converged=done, rate=rate, eta=eta, num_iterations=k, nonfinite=nonfinite
        )


@eqx.filter_custom_jvp
def _stage_value(stage: Stage, z: Array, *, newton: AbstractNewton, jacobian: Jacobian) -> Array:
    """`z`, the converged solution of `stage`, with the derivative of the exact solution."""
    del stage, newton, jacobian
    return z


@_stage_value.def_jvp
def _stage_value_jvp(primals, tangents, *, newton: AbstractNewton, jacobian: Jacobian):
    # Implicit function theorem: G(z, p) = 0 gives dz = -(dG/dz)^{-1} (dG/dp dp).
    stage, z = primals
    d_stage, _ = tangents
    _, rhs = eqx.filter_jvp(lambda s: s.residual(z), (stage,), (d_stage,))
    return z, -newton.tangent(jacobian, stage, z, rhs)


class JacobianCache(eqx.Module):
    """What `Newton` keeps between steps: the Jacobian, the LU factors of `I - hg J` and when
    to re-evaluate."""

    jacobian: Array
    lu: Array
    pivots: Array
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

    def __check_init__(self):
        _check_common(self)
        if not 0 < self.reuse_rate < 1:
            raise ValueError(f"Newton(reuse_rate={self.reuse_rate}) must be in (0, 1).")

    def init_cache(self, y0, t0):
        n = y0.shape[0]
        return JacobianCache(
            jacobian=jnp.zeros((n, n), y0.dtype),
            lu=jnp.zeros((n, n), y0.dtype),
            pivots=jnp.zeros((n,), jnp.int32),
            hg=jnp.full((), jnp.nan, t0.dtype),
            refresh=jnp.array(True),
            current=jnp.array(False),
        )

    def prepare(self, jacobian, field, t0, y0, args, hg, cache):
        # The iteration only has to converge: nothing here is differentiated.
        t0, y0, args, field, hg, cache = no_grad((t0, y0, args, field, hg, cache))
        evaluate = cache.refresh
        matrix = jax.lax.cond(
            evaluate, lambda: jacobian(field, t0, y0, args), lambda: cache.jacobian
        )
        refactor = evaluate | (hg != cache.hg)
        identity = jnp.eye(y0.shape[0], dtype=y0.dtype)
        lu, pivots = jax.lax.cond(
            refactor,
            lambda: _lu_factor(identity - jnp.asarray(hg, y0.dtype) * matrix),
            lambda: (cache.lu, cache.pivots),
        )
        cache = JacobianCache(matrix, lu, pivots, hg, cache.refresh, cache.current | evaluate)
        return Prepared(
            solve=lambda r: jsl.lu_solve((lu, pivots), r),
            cache=cache,
            num_jacobian_evals=evaluate.astype(jnp.int32),
            num_lu_factorisations=refactor.astype(jnp.int32),
        )

    def next_caches(self, cache, failed, rate):
        slow = failed | (rate > self.reuse_rate)
        accepted = dataclasses.replace(cache, refresh=slow, current=jnp.array(False))
        rejected = dataclasses.replace(cache, refresh=slow & ~cache.current)
        return accepted, rejected

    def tangent(self, jacobian, stage, z, rhs):
        hg = jnp.asarray(stage.hg, z.dtype)
        matrix = jnp.eye(z.shape[0], dtype=z.dtype) - hg * jacobian(
            stage.field, stage.t, z, stage.args
        )
        return lu_solver(matrix)(rhs)


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


def _lu_factor(matrix: Array) -> tuple[Array, Array]:
    lu, pivots = jsl.lu_factor(matrix)
    return lu, pivots.astype(jnp.int32)


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

    def init_cache(self, y0, t0):
        return None

    def _gmres(self, rtol: float) -> lx.GMRES:
        return lx.GMRES(rtol=rtol, atol=0.0, restart=self.restart, max_steps=self.max_krylov_steps)

    def prepare(self, jacobian, field, t0, y0, args, hg, cache):
        del jacobian, cache
        t0, y0, args, field, hg = no_grad((t0, y0, args, field, hg))
        _, jvp = jax.linearize(lambda y: field(t0, y, args), y0)
        hg = jnp.asarray(hg, y0.dtype)
        operator = lx.FunctionLinearOperator(
            lambda v: v - hg * jvp(v), jax.ShapeDtypeStruct(y0.shape, y0.dtype)
        )
        solver = self._gmres(self.krylov_rtol)
        return Prepared(
            solve=lambda r: lx.linear_solve(operator, r, solver, throw=False).value,
            cache=None,
            num_jacobian_evals=jnp.ones((), jnp.int32),
            num_lu_factorisations=jnp.zeros((), jnp.int32),
        )

    def next_caches(self, cache, failed, rate):
        return None, None

    def tangent(self, jacobian, stage, z, rhs):
        structure = jax.ShapeDtypeStruct(z.shape, z.dtype)
        gmres = self._gmres(self.tangent_rtol)

        def solve(matvec, b):
            # A zero right-hand side (a symbolic-zero cotangent, a masked step) would make
            # GMRES break down: its solution is zero.
            zero = jnp.all(b == 0)
            operator = lx.FunctionLinearOperator(matvec, structure)
            x = lx.linear_solve(operator, jnp.where(zero, 1, b), gmres, throw=False).value
            return jnp.where(zero, 0, x)

        matvec = lambda v: jax.jvp(stage.residual, (z,), (v,))[1]
        # custom_linear_solve transposes by solving with the transposed operator (vjp of the
        # residual), so reverse mode needs no differentiation through GMRES itself.
        return jax.lax.custom_linear_solve(matvec, rhs, solve, transpose_solve=solve)


def _check_common(newton: AbstractNewton) -> None:
    name = type(newton).__name__
    for field in ("rtol", "atol"):
        value = known_values(f"{name}({field})", getattr(newton, field))  # None if traced
        if value is not None and not np.all(value > 0):
            raise ValueError(f"{name}({field}={getattr(newton, field)}) must be positive or None.")
    if not 0 < newton.kappa < 1:
        raise ValueError(f"{name}(kappa={newton.kappa}) must be in (0, 1); e.g. 1e-2.")
    if not isinstance(newton.max_iters, int) or newton.max_iters < 1:
        raise ValueError(f"{name}(max_iters={newton.max_iters!r}) must be a positive int.")
