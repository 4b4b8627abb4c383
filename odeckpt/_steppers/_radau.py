"""Radau IIA of order 5, implemented as in Hairer and Wanner's RADAU5: the three implicit stages
solved together by a simplified Newton iteration on the transformed system, an error estimate
with the stiff filter, the collocation polynomial as dense output, and a predictive step-size
controller."""

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._autodiff import cond, filled, like, on_auto_axes, replicated
from .._real_coordinates import RealCoordinates
from .._types import Args, BoolScalar, IntScalar, Scalar, VectorField, Y
from ._base import Step
from ._esdirk import ImplicitState
from ._implicit import AbstractProposer, check_jac, check_tolerances, per_step
from ._mass import AbstractMassMatrix, FlatMass
from ._newton import (
    AbstractNewton,
    AbstractSystem,
    FlatField,
    Iteration,
    Jacobian,
    Newton,
    Prepared,
    exact_jacobian,
    no_grad,
)
from ._radau_tableau import RADAU_IIA_5, CollocationTableau

_SAFETY = 0.9
_MIN_FACTOR, _MAX_FACTOR = 0.2, 8.0
"""Bounds on the ratio of consecutive step sizes (RADAU5's defaults)."""
_KEEP_STEP = 1.2
"""A proposed ratio in `[1, 1.2]` keeps the step size, so that the factorisations serve on."""


class RadauState(eqx.Module):
    """What `Radau5` carries between steps.

    **Fields:**

    - `implicit`: `f(t, y, args)` at the current point (from the last step's stages), the
        Newton method's cache (for `Newton`: the Jacobian and the real and complex LU factors)
        and its convergence estimate.
    - `collocation`: the last accepted step's collocation polynomial, `(3, m)` coefficients of
        `theta^1..theta^3` in real coordinates; continued past its step, it gives the next
        step's starting values.
    - `h`, `error`: the last accepted step's size (0 before the first) and error norm (at
        least 1e-2), for the predictive controller.
    - `retry`: the next attempt starts from this point again after a rejection, or is the
        first step (its error estimate is then refined when it fails).
    """

    implicit: ImplicitState
    collocation: Array
    h: Scalar
    error: Scalar
    retry: BoolScalar


class Collocation(AbstractSystem):
    """The stage increments `Z = (Z_1, Z_2, Z_3)` of one step, stacked: `M Z_i = h sum_j a_ij
    f(ts_j, y0 + Z_j)` (`M = I` for an ODE). (The stage matrix `a` is a field, not a constant
    made inside the residual: the Newton iteration's loop would otherwise take it as a
    constant that a checkpointing adjoint differentiates, which a while loop cannot be.)"""

    field: FlatField
    ts: Array
    h: Scalar
    y0: Array
    args: Args
    a: Array

    def _values(self, z: Array) -> Array:
        return self.y0[None] + like(z.reshape(3, -1), self.y0)

    def residual(self, z: Array) -> Array:
        derivatives = jax.vmap(self.field, in_axes=(0, 0, None))(
            self.ts, self._values(z), self.args
        )
        h = jnp.asarray(self.h, z.dtype)
        return _flat(self.field.mass_times(z.reshape(3, -1)) - h * (self.a @ derivatives))

    def matrix(self, z: Array) -> Array:
        at = lambda t, y: exact_jacobian(self.field, t, y, self.args)
        jacobians = jax.vmap(at)(self.ts, self._values(z))
        blocks = jnp.einsum("ij,jrc->irjc", self.a, jacobians)
        size = z.shape[0]
        h = jnp.asarray(self.h, z.dtype)
        mass = jnp.eye(size // 3, dtype=z.dtype) if self.field.mass is None else self.field.mass
        identity = jnp.kron(jnp.eye(3, dtype=z.dtype), jnp.asarray(mass, z.dtype))
        # (JAX's sharding rule of a reshape merging two pairs of axes has no case for it)
        return identity - h * on_auto_axes(lambda b: b.reshape(size, size), blocks)

    def num_components(self) -> int:
        return 3 * self.field.coordinates.num_components

    def modulus(self, z: Array) -> Array:
        return _flat(jax.vmap(self.field.coordinates.modulus)(self._values(z)))


class Stages(eqx.Module):
    """One step's stage equations, their solution (the increments `(3, n)`, differentiable by
    the implicit function theorem), how the Newton iteration went, and the factorisations it
    used (which the error estimate uses too)."""

    system: Collocation
    increments: Array
    iteration: Iteration
    prepared: Prepared


class Estimate(eqx.Module):
    """A step's error estimate (flat), its error norm, and the evaluations of `f` it took."""

    y_error: Array
    norm: Scalar
    num_fn_evals: IntScalar


class Radau5(AbstractMassMatrix, AbstractProposer):
    """Radau IIA of order 5: three implicit stages (a collocation method), L-stable and
    stiffly accurate, with an embedded third-order error estimate and the cubic collocation
    polynomial as dense output. The method of Hairer and Wanner's RADAU5 and of scipy's
    `Radau`, and the method of choice for stiff problems at tight tolerances.

    Each step solves the `3n` stage equations by a simplified Newton iteration whose matrix
    `I - h A (x) J` decouples, after a change of basis by the eigenvectors of `A`, into one real
    system `I - h gamma J` and one complex one: one real and one complex LU factorisation of
    `n x n` matrices per Jacobian and step size. The Jacobian (from `jac` or `jax.jacfwd`) is
    reused across steps while the iterations contract fast (`Newton(reuse_rate=...)`), and a
    proposed step size within `[1, 1.2]` times the last one keeps the last, so that its
    factorisations serve on. The error estimate is filtered by `(I - h gamma J)^{-1}` (bounded
    on stiff components) and, after a rejection or at the first step, refined with one more
    evaluation of `f`. Step sizes come from Gustafsson's predictive controller (which uses
    the last two accepted steps and their errors) and from the Newton iterations taken
    (`Step.dt_factor`; the controller's bounds apply). The Newton iteration starts from the
    last step's collocation polynomial continued. Its error, held at the tolerance, falls
    faster than the tolerance (its estimate is of order 3), so the steps are held to
    `rtol' = 1e-8 (rtol / 1e-8) ** 0.85` (`tolerance_exponent`, `tolerance_reference`):
    `rtol` itself at `1e-8`, tighter above, so that the error falls by about a decade per
    decade of `rtol` (Hairer's RADAU5 uses `0.1 rtol ** (2/3)` to the same end).

    Each stage derivative is `f` at the stage; `Stats.num_fn_evals` counts three evaluations
    of `f` per Newton iteration. The stages are differentiated together by the implicit
    function theorem (one solve with the exact `3n x 3n` matrix of the stage equations),
    never through the iterations. Snapshots of a checkpointing adjoint hold the stepper state:
    for `Newton`, the Jacobian and its real and complex LU factors (`4 n^2` real numbers) plus
    `f` and the collocation polynomial (`4 n`); for `NewtonKrylov`, `4 n`.

    **Arguments:**

    - `newton`: `odeckpt.Newton()` (the default) or `odeckpt.NewtonKrylov()` (GMRES on the
        real system and on the complex one as a real system of twice the size).
    - `jac`: optional `jac(t, y, args)`, as for `odeckpt.Kvaerno3`.
    - `rtol`, `atol`: the tolerances of the step-size proposal; `None` (the default) takes
        those of the solve.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def van_der_pol(t, y, eps):
        return jnp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / eps])

    sol = odeckpt.solve(van_der_pol, jnp.array([2.0, 0.0]), (0.0, 2.0), args=1e-6,
                        solver=odeckpt.Radau5(), rtol=1e-8, atol=1e-8)
    ```

    **References:** Hairer & Wanner, *Solving ODEs II*, 2nd ed. (1996), Sec. IV.5 and IV.8;
    K. Gustafsson, "Control-theoretic techniques for stepsize selection in implicit Runge-Kutta
    methods", *ACM TOMS* 20 (1994), 496-517.
    """

    newton: AbstractNewton = Newton(reuse_rate=1e-3)
    jac: Callable | None = None
    rtol: float | None = None
    atol: float | None = None
    mass: FlatMass | None = None

    tableau: ClassVar[CollocationTableau] = RADAU_IIA_5
    name: ClassVar[str] = "radau"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = 3
    multistep: ClassVar[bool] = False
    fn_evals_per_step: ClassVar[int] = 3
    dense_degree: ClassVar[int] = 3
    # Its error falls faster than the steps' tolerance (an order-3 estimate of an order-5
    # method); held to `1e-8 (rtol / 1e-8) ** 0.85` it falls about as `rtol` (docs/guide.md).
    tolerance_exponent: ClassVar[float] = 0.85
    tolerance_reference: ClassVar[float] = 1e-8

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)
        check_tolerances(self)

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> RadauState:
        """**Returns:** the state at the initial point: `f(t0, y0, args)`, an empty Newton
        cache (a Jacobian is evaluated at the first step) and no previous step."""
        t0 = jnp.asarray(t0)
        _, y0_flat = RealCoordinates.make(y0)
        return RadauState(
            implicit=ImplicitState.initial(self.newton, f, t0, y0, args, with_complex=True),
            collocation=filled(y0_flat, 0, rows=3),
            h=jnp.zeros((), t0.dtype),
            error=jnp.ones((), t0.dtype),
            retry=jnp.array(True),
        )

    def step(
        self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: RadauState
    ) -> Step:
        """Attempt one step from `(t0, y0)` to `t1` (`t1 < t0` integrates backwards).

        **Returns:** a `Step` with `y1 = y0 + Z_3`, the filtered error estimate, the
        collocation polynomial as dense output (degree 3), the states to carry on acceptance
        and on rejection, whether the Newton iteration failed, the proposed ratio of step sizes
        (`dt_factor`), and the Jacobian evaluations, LU factorisations (the real and the
        complex one count one each) and evaluations of `f` done.
        """
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        field, y0_flat = self.field_of(f, t0, y0, args)
        field = field.for_step(t1 - t0)
        solved = self._stages(field, t0, t1, y0_flat, args, state)
        tableau, dtype, h, z = self.tableau, y0_flat.dtype, t1 - t0, solved.increments
        y1 = field.unravel(y0_flat + z[-1])
        estimate = self._estimate(solved, t0, y0, y1, state)
        error = estimate.norm.astype(state.error.dtype)
        info = solved.iteration
        failed = ~info.converged
        on_accept, on_reject = self.newton.next_caches(solved.prepared.cache, failed, info.rate)
        # f(t1, y1) from the stages (the collocation equations), as ESDIRK steppers take theirs.
        f1 = field.unravel(
            per_step(field.mass_times(jnp.asarray(tableau.derivative, dtype) @ z), h)
        )
        accepted = RadauState(
            implicit=ImplicitState(f1, on_accept, info.eta),
            collocation=jnp.asarray(tableau.dense, dtype) @ z, h=h,
            error=jnp.maximum(error, 1e-2), retry=jnp.array(False),
        )  # fmt: skip
        keep = self.newton.reuses_factors(on_accept)
        return Step(
            y1=y1,
            y_error=field.unravel(estimate.y_error),
            dense=jax.vmap(field.unravel)(jnp.concatenate([y0_flat[None], accepted.collocation])),
            state=accepted,
            state_on_reject=dataclasses.replace(
                state,
                implicit=state.implicit.rejected(on_reject, failed, info.eta),
                retry=jnp.array(True),
            ),
            failed=failed,
            nonfinite=info.nonfinite,
            num_jacobian_evals=solved.prepared.num_jacobian_evals,
            num_lu_factorisations=solved.prepared.num_lu_factorisations,
            num_fn_evals=3 * info.num_iterations + estimate.num_fn_evals,
            dt_factor=self._proposal(error, info.num_iterations, state, h, keep),
        )

    def _stages(self, field, t0, t1, y0, args, state: RadauState) -> Stages:
        """Solve the stage equations by simplified Newton, starting from the last step's
        collocation polynomial continued."""
        tableau, h = self.tableau, t1 - t0
        jacobian, newton = Jacobian(self.jac), self.tight_newton(y0.dtype)
        prepared = newton.prepare(
            jacobian, field, t0, y0, args, h * tableau.gamma, state.implicit.cache,
            hg_complex=h * np.conj(tableau.eigenvalue),
        )  # fmt: skip
        c = jnp.asarray(tableau.c, t0.dtype)
        ts = jnp.where(c == 1, t1, t0 + c * h)
        system = Collocation(field, ts, h, y0, args, jnp.asarray(tableau.a, y0.dtype))
        transformed = dataclasses.replace(prepared, solve=_transformed_solve(prepared, tableau))
        scale = jnp.tile(replicated(newton.scale(field.coordinates, y0)), 3)
        guess = _flat(_starting_values(tableau, state, h))
        z, info = newton.solve(system, guess, transformed, scale, state.implicit.eta)
        return Stages(system, like(z.reshape(3, -1), y0), info, prepared)

    def _estimate(self, solved: Stages, t0: Scalar, y0: Y, y1: Y, state: RadauState) -> Estimate:
        """Hairer and Wanner's error estimate `(I - h gamma J)^{-1} (h gamma f(t0, y0) + gamma
        sum_i e_i Z_i)`; at a first or retried step whose estimate fails, the refined one
        that evaluates `f` at `y0` plus the first estimate (*Solving ODEs II*, IV.8, (8.20)).

        The estimate is differentiable in `f(t0, y0)`, the stages and the parameters, with the
        step's times and matrix held fixed: along a direction it is the same estimate of the
        sensitivities' error, which `ForwardSensitivity` judges. Its norm steers step sizes
        only, and is not differentiated."""
        tableau, system, z = self.tableau, solved.system, solved.increments
        prepared = solved.prepared
        solve = prepared.solve if prepared.factors is None else no_grad(prepared.factors).solve
        field, dtype = system.field, z.dtype
        combination = tableau.gamma * field.mass_times(jnp.asarray(tableau.error, dtype) @ z)
        hg = jax.lax.stop_gradient(jnp.asarray(system.h * tableau.gamma, dtype))
        first = solve(hg * field.ravel(state.implicit.f) + combination)
        y0, y1 = no_grad((y0, y1))
        norm = lambda e: self.error_norm(field.unravel(jax.lax.stop_gradient(e)), y0, y1)
        first_norm = norm(first)
        again = state.retry & (first_norm > 1)
        f_moved = lambda: field(jax.lax.stop_gradient(t0), system.y0 + first, system.args)
        refined = cond(again, lambda: solve(hg * f_moved() + combination), lambda: first)
        return Estimate(
            y_error=refined,
            norm=jnp.where(again, norm(refined), first_norm),
            num_fn_evals=again.astype(jnp.int32),
        )

    def _proposal(self, error, iterations, state: RadauState, h, keep: BoolScalar) -> Scalar:
        """RADAU5's ratio of the next step size to this one: `0.9 err^(-1/4)`, the safety
        factor lowered when Newton took many iterations; after an accepted step, also no more
        than Gustafsson's predictive ratio `(h / h_prev) (err_prev / err^2)^(1/4)`; and 1 when
        the ratio is within `[1, 1.2]` and the factorisations would be reused."""
        error, h = jax.lax.stop_gradient((error, h))
        most = 2 * self.newton.max_iters
        safety = _SAFETY * jnp.minimum(1.0, (1 + most) / (iterations + most))
        bound = lambda q: jnp.clip(q, 1 / _MAX_FACTOR, 1 / _MIN_FACTOR)
        quotient = bound(error**0.25 / safety)
        safe_h = jnp.where(h == 0, 1, h)
        predictive = bound(state.h / safe_h * (error**2 / state.error) ** 0.25 / _SAFETY)
        accepted = error <= 1
        quotient = jnp.where(accepted & (state.h != 0), jnp.maximum(quotient, predictive), quotient)
        factor = 1 / quotient
        unchanged = accepted & keep & (factor >= 1) & (factor <= _KEEP_STEP)
        return jnp.where(unchanged, 1.0, factor).astype(h.dtype)


def _transformed_solve(prepared: Prepared, tableau: CollocationTableau) -> Callable:
    """The increments `dZ` with `(I - h A (x) J) dZ = r`, through the eigenvectors `T` of `A`:
    `dZ = T dW` with `(I - h gamma J) dW_1 = rho_1` and `(I - h conj(lambda) J) (dW_2 + i dW_3)
    = rho_2 + i rho_3`, where `rho = T^{-1} r` (Hairer & Wanner, IV.8, (8.15)-(8.18))."""
    solve_complex = prepared.solve_complex
    assert solve_complex is not None
    # Made here, not in the loop that calls `solve` (see `Collocation`).
    inverse, transform = no_grad((jnp.asarray(tableau.inverse), jnp.asarray(tableau.transform)))

    def solve(r: Array) -> Array:
        rho = inverse.astype(r.dtype) @ r.reshape(3, -1)
        pair = solve_complex(jax.lax.complex(rho[1], rho[2]))
        dw = jnp.stack([prepared.solve(rho[0]), jnp.real(pair), jnp.imag(pair)]).astype(r.dtype)
        return (transform.astype(r.dtype) @ dw).reshape(-1)

    return solve


def _flat(rows: Array) -> Array:
    """`rows.reshape(-1)`: the stages' vectors stacked into one, replicated where they are
    sharded by their type over `Explicit` mesh axes (JAX's sharding rule of a reshape has no
    case for merging into a sharded minor axis; the Newton iteration then runs on the whole
    stacked vector, each field evaluation sharded again: `Collocation._values`)."""
    return replicated(rows).reshape(-1)


def _starting_values(tableau: CollocationTableau, state: RadauState, h: Scalar) -> Array:
    """The last accepted step's collocation polynomial, continued to this step's nodes, as
    increments from its end: `sum_p Q_p ((1 + c_i h / h_prev)^p - 1)` (zero at the first
    step, whose polynomial is zero)."""
    q = state.collocation
    ratio = (h / jnp.where(state.h == 0, 1, state.h)).astype(q.dtype)
    nodes = 1 + jnp.asarray(tableau.c, q.dtype) * ratio
    powers = nodes[:, None] ** jnp.arange(1, 4, dtype=q.dtype)[None, :] - 1
    return jax.lax.stop_gradient(powers @ q)
