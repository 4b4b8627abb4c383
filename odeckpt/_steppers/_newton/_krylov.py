"""Matrix-free Newton-Krylov: Newton's linear systems solved by GMRES with Jacobian-vector
products, the Jacobian never formed.

**References:** D. A. Knoll & D. E. Keyes, "Jacobian-free Newton-Krylov methods: a survey",
*J. Comput. Phys.* 193 (2004), 357-397.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from ._base import AbstractNewton, Prepared, check_settings
from ._system import no_grad


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
        check_settings(self)
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
            lambda v: field.mass_times(v) - hg * jvp(v), jax.ShapeDtypeStruct(y0.shape, y0.dtype)
        )
        solver = self._gmres(self.krylov_rtol)
        solve = lambda op, r: lx.linear_solve(op, r, solver, throw=False).value
        solve_complex = None
        if hg_complex is not None:
            # (M - s J)(x + iy) as a real operator on (x, y): M and J are real.
            s = jnp.asarray(hg_complex)
            sr, si = jnp.real(s).astype(y0.dtype), jnp.imag(s).astype(y0.dtype)

            def pair(v):
                x, y = jvp(v[0]), jvp(v[1])
                mx, my = field.mass_times(v[0]), field.mass_times(v[1])
                return jnp.stack([mx - sr * x + si * y, my - sr * y - si * x])

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
