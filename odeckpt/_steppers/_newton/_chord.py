"""Simplified ("chord") Newton: a dense Jacobian and its LU factors, reused across the stages
and the steps of a solve.

**References:** E. Hairer & G. Wanner, *Solving Ordinary Differential Equations II*, 2nd ed.
(1996), Sec. IV.8 (simplified Newton iterations, and when to re-evaluate the Jacobian).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..._autodiff import cond
from ..._types import BoolScalar, Scalar
from ...checkpointing import lockstep_while_loop
from ._base import DEFAULT_ATOL, DEFAULT_RTOL, AbstractNewton, Prepared, check_settings
from ._linear import ShiftedLU, lu_solver, same_step_size
from ._system import Stage, no_grad


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
        check_settings(self)
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
        matrix = cond(evaluate, lambda: jacobian(field, t0, y0, args), lambda: cache.jacobian)
        refactor = evaluate | ~same_step_size(hg, cache.hg)
        shifts = (hg,) if hg_complex is None else (hg, hg_complex)
        old = (cache.lu,) if hg_complex is None else (cache.lu, cache.lu_complex)
        factors = cond(
            refactor,
            lambda: tuple(ShiftedLU.factor(matrix, jnp.asarray(s), field.mass) for s in shifts),
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
        rtol = DEFAULT_RTOL if self.rtol is None else self.rtol
        atol = DEFAULT_ATOL if self.atol is None else self.atol
        eps = jnp.finfo(z.dtype).eps
        count = max(coordinates.num_components, 1)  # a state without components: norm 0

        def norm(d, x):
            weight = atol + rtol * coordinates.modulus(x)
            return jnp.sqrt(jnp.sum(jnp.abs(d / weight) ** 2) / count)

        def going(carry):
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
        x, _, _, done, _ = lockstep_while_loop(going, body, carry)
        return jnp.where(done, x, jnp.nan)
