"""Rosenbrock (linearly implicit) methods, and Rodas5 with its dense output."""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._types import Args, Scalar, VectorField, Y
from ._base import Step
from ._explicit_rk import combine, stage_time
from ._mass import AbstractMassMatrix, FlatMass
from ._newton import FlatField, Jacobian, lu_solve, lu_solver, no_grad
from ._tableau import frozen

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


@dataclasses.dataclass(frozen=True, eq=False)
class RosenbrockTableau:
    """The coefficients of a Rosenbrock method in Hairer and Wanner's transformed form
    (*Solving ODEs II*, Sec. IV.7, eq. (7.4')): with `h = t1 - t0`, `J = df/dy(t0, y0)` and
    `f_t = df/dt(t0, y0)`, the stage increments solve

    `(I / (h gamma) - J) u_i = f(t0 + c_i h, y0 + sum_{j<i} a_ij u_j) + d_i h f_t
    + sum_{j<i} (C_ij / h) u_j`,

    then `y1 = y0 + sum_i m_i u_i` and the error estimate is `sum_i e_i u_i`. The dense output
    is `y(theta) = (1 - theta) y0 + theta (y1 + (1 - theta) (K_1 + theta (K_2 + theta K_3)))`
    with `K_r = sum_i dense[r, i] u_i`.

    **Arguments:** `a`, `C` (`(s, s)`, strictly lower triangular), `gamma`, `c`, `d`, `m`,
    `e` (`(s,)`), `dense` (`(3, s)`). (In the transformed form `c_i` is not the row sum of `a`,
    so it is given.) `ValueError` names the violated condition.
    """

    a: np.ndarray
    C: np.ndarray
    gamma: float
    c: np.ndarray
    d: np.ndarray
    m: np.ndarray
    e: np.ndarray
    dense: np.ndarray

    num_stages: int = dataclasses.field(init=False)
    num_main_stages: int = dataclasses.field(init=False)
    """The stages before the first whose stage value is already a complete solution
    (`a[i, :i] == m[:i]`): the increments of the later ones are corrections of the size of the
    local error (for Rodas5, the last is the error estimate itself)."""
    dense_powers: np.ndarray = dataclasses.field(init=False)
    """`(4, s)` weights over the increments of `theta^1..theta^4`, without the `y0` terms."""

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)
        a, big_c = frozen(self.a, "a", 2), frozen(self.C, "C", 2)
        c, d, m, e = (frozen(getattr(self, n), n, 1) for n in ("c", "d", "m", "e"))
        dense = frozen(self.dense, "dense", 2)
        s = c.shape[0]
        if a.shape != (s, s) or big_c.shape != (s, s) or dense.shape != (3, s):
            raise ValueError("Shapes must be a, C: (s, s); c, d, m, e: (s,); dense: (3, s).")
        if any(x.shape != (s,) for x in (d, m, e)):
            raise ValueError(f"`d`, `m` and `e` must have shape ({s},).")
        if np.any(np.triu(a) != 0) or np.any(np.triu(big_c) != 0):
            raise ValueError("`a` and `C` must be strictly lower triangular.")
        if c[0] != 0 or np.any((c < 0) | (c > 1)):
            raise ValueError("Stage nodes `c` must lie in [0, 1] with c_1 = 0.")
        if not self.gamma > 0:
            raise ValueError(f"gamma={self.gamma} must be positive.")
        k1, k2, k3 = dense
        # (1 - th) y0 + th (y1 + (1 - th)(K1 + th K2 + th^2 K3)), with y1 - y0 = sum m_i u_i.
        powers = np.stack([m + k1, k2 - k1, k3 - k2, -k3])
        powers.flags.writeable = False
        for name, value in (("a", a), ("C", big_c), ("c", c), ("d", d), ("m", m), ("e", e)):
            set_(name, value)
        set_("dense", dense)
        set_("num_stages", s)
        complete = [i for i in range(1, s) if np.array_equal(a[i, :i], m[:i])]
        set_("num_main_stages", complete[0] if complete else s)
        set_("dense_powers", powers)


class AbstractRosenbrock(AbstractMassMatrix):
    """A Rosenbrock method given by its `RosenbrockTableau`: no Newton iteration, one
    Jacobian, one `df/dt` (a Jacobian-vector product) and one LU factorisation of
    `I - h gamma J` (`M - h gamma J` with a mass matrix) per step, and one linear solve per
    stage, plus one evaluation of `f` and one solve for the error estimate (see
    `_midpoint_defect`); the solves of the main stages (`RosenbrockTableau.num_main_stages`)
    are refined once with a Jacobian-vector product of
    `f`, so that the step keeps the linear conservation laws that `f` keeps (see
    `_stage_solvers`). The Jacobian must be exact at `(t0, y0)` for the method's order, so it
    is evaluated at every step, and gradients differentiate through it (second derivatives of
    `f`).

    The state carried between steps is `f(t1, y1)`, the next step's first stage.
    """

    tableau: AbstractClassVar[RosenbrockTableau]
    jac: eqx.AbstractVar[Callable | None]
    state_is_derivative: ClassVar[bool] = True
    implicit: ClassVar[bool] = True
    multistep: ClassVar[bool] = False

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> Y:
        """**Returns:** `f(t0, y0, args)`, the first stage of the first step."""
        return f(t0, y0, args)

    def step(self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: Y) -> Step:
        """Attempt one step from `(t0, y0)` to `t1` (`t1 < t0` integrates backwards).

        **Returns:** a `Step` with `y1`, the embedded error estimate, the method's dense output
        (degree 4 in `theta`), the new state `f(t1, y1)`, one Jacobian evaluation and one LU
        factorisation.
        """
        tableau = self.tableau
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = t1 - t0
        field, y0_flat = self.field_of(f, t0, y0, args)
        field = field.for_step(h)
        jacobian = Jacobian(self.jac)(field, t0, y0_flat, args)
        f_t = jax.jvp(lambda t: field(t, y0_flat, args), (t0,), (jnp.ones_like(t0),))[1]
        hg = jnp.asarray(h * tableau.gamma, y0_flat.dtype)
        solve, refined_solve = _stage_solvers(
            field, t0, y0_flat, args, jacobian, hg, user_jac=self.jac is not None
        )
        # Both sides times h gamma: (M - h gamma J) u_i = h gamma (f_i + d_i h f_t) + gamma
        # M sum_j C_ij u_j, which has no 1/h (a zero-length step stays finite).
        us = []
        for i in range(tableau.num_stages):
            if i == 0:
                f_i = field.ravel(state)
            else:
                z_i = combine(y0_flat, 1.0, tableau.a[i, :i], us)
                f_i = field(stage_time(t0, t1, h, tableau.c[i]), z_i, args)
            rhs = hg * f_i
            if tableau.d[i] != 0:
                rhs = rhs + hg * jnp.asarray(tableau.d[i] * h, y0_flat.dtype) * f_t
            if i > 0:
                rhs = rhs + field.mass_times(combine(None, tableau.gamma, tableau.C[i, :i], us))
            us.append(refined_solve(rhs) if i < tableau.num_main_stages else solve(rhs))
        y1_flat = combine(y0_flat, 1.0, tableau.m, us)
        powers = [combine(None, 1.0, w, us) for w in tableau.dense_powers]
        defect = _midpoint_defect(field, t0, t1, h, y0_flat, args, powers)
        if self.mass is not None:
            # The defect measures the differential equations' quadrature error; the algebraic
            # ones' error is the embedded estimate's (Rodas5's pair is made for index-1 DAEs),
            # and their residual at mid-step, filtered by (M - h gamma J)^-1, would reject
            # steps that are accurate (TRANSAMP, docs/dae.md).
            defect = self.mass.without_constraints(defect)
        y_error = combine(solve(defect), 1.0, tableau.e, us)
        dense = jax.vmap(field.unravel)(jnp.stack([y0_flat, *powers]))
        y1 = field.unravel(y1_flat)
        return Step(
            y1=y1,
            y_error=field.unravel(y_error),
            dense=dense,
            state=f(t1, y1, args),
            num_jacobian_evals=jnp.ones((), jnp.int32),
            num_lu_factorisations=jnp.ones((), jnp.int32),
        )


def _midpoint_defect(
    field: FlatField, t0: Scalar, t1: Scalar, h: Scalar, y0: Array, args: Args,
    powers: list[Array],
) -> Array:  # fmt: skip
    """`h f(t_half, P(1/2)) - P'(1/2)`: how far the dense output `P(theta)` (weights `powers`
    on `theta^1..theta^4`) is from solving the ODE at mid-step, times `h`, of the size of the
    local error of an order-4 method (`O(h^5)`).

    Rodas5's embedded estimate cannot see the error of the time quadrature: its order-4
    conditions leave free only weights on the last three stages, which share the node
    `c = 1`, so where `f` does not depend on `y` the embedded and main solutions coincide and
    the estimate is exactly 0. This defect, filtered through `(I - h gamma J)^-1` so that
    stiff components are damped as in the stages, supplies the missing part.

    **References:** L. F. Shampine, "Implementation of implicit formulas for the solution of
    ODEs", *SIAM J. Sci. Stat. Comput.* 1 (1980), 103-118 (filtering an error estimate);
    Hairer & Wanner, *Solving ODEs II*, Sec. IV.8 (the estimate of Radau5).
    """
    p = combine(y0, 1.0, 0.5 ** np.arange(1, 5), powers)
    slope = combine(None, 1.0, np.arange(1, 5) * 0.5 ** np.arange(4), powers)
    f_half = field(stage_time(t0, t1, h, 0.5), p, args)
    return jnp.asarray(h, y0.dtype) * f_half - field.mass_times(slope)


def _stage_solvers(
    field: FlatField, t0: Scalar, y0: Array, args: Args, jacobian: Array, hg: Array,
    user_jac: bool,
) -> tuple[Callable[[Array], Array], Callable[[Array], Array]]:  # fmt: skip
    """Two ways to find `u` with `(I - hg J) u = rhs`: an LU solve, and the same followed by
    one step of iterative refinement whose residual takes `J u` from a Jacobian-vector product
    of `f`, not from the matrix.

    The refinement keeps the linear conservation laws that `f` keeps in floating point, which
    the LU solve alone loses at the level of its rounding errors (why this matters, and on
    which problem: docs/architecture.md, "Refined stages in Rodas5"). Only the main stages
    need it. The correction is of the size of rounding errors and is not differentiated: the
    derivative is that of the exact solve. With a user's `jac` (`user_jac`), which may be
    approximate, the correction is more than rounding, and it is differentiated: the
    derivative is that of the step computed.

    **References:** R. D. Skeel, "Iterative refinement implies numerical stability for Gaussian
    elimination", *Math. Comp.* 35 (1980), 817-832; N. J. Higham, *Accuracy and Stability of
    Numerical Algorithms*, 2nd ed. (2002), Ch. 12.
    """
    solve = lu_solver(field.shifted(jacobian, hg))
    if user_jac:

        def refined_differentiably(rhs: Array) -> Array:
            u = solve(rhs)
            product = jax.jvp(lambda y: field(t0, y, args), (y0,), (u,))[1]
            return u + solve(rhs - field.mass_times(u) + hg * product)

        return solve, refined_differentiably
    lu_and_pivots, field, t0, y0, args, hg = no_grad((solve.factors, field, t0, y0, args, hg))
    _, jvp = jax.linearize(lambda y: field(t0, y, args), y0)

    def refined_solve(rhs: Array) -> Array:
        u = solve(rhs)
        frozen_u = jax.lax.stop_gradient(u)
        residual = jax.lax.stop_gradient(rhs - field.mass_times(u)) + hg * jvp(frozen_u)
        return u + lu_solve(lu_and_pivots, residual)

    return solve, refined_solve


_A6 = [
    -14.09640773051259,
    6.925207756232704,
    -41.47510893210728,
    2.343771018586405,
    24.13215229196062,
]


def _rows(rows: list[list[float]]) -> np.ndarray:
    s = len(rows) + 1
    out = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        out[i, : len(row)] = row
    return out


_RODAS5 = RosenbrockTableau(
    a=_rows(
        [
            [2.0],
            [3.040894194418781, 1.041747909077569],
            [2.576417536461461, 1.622083060776640, -0.9089668560264532],
            [2.760842080225597, 1.446624659844071, -0.3036980084553738, 0.2877498600325443],
            _A6,
            [*_A6, 1.0],
            [*_A6, 1.0, 1.0],
        ]
    ),
    C=_rows(
        [
            [-10.31323885133993],
            [-21.04823117650003, -7.234992135176716],
            [32.22751541853323, -4.943732386540191, 19.44922031041879],
            [-20.69865579590063, -8.816374604402768, 1.260436877740897, -0.7495647613787146],
            [
                -46.22004352711257,
                -17.49534862857472,
                -289.6389582892057,
                93.60855400400906,
                318.3822534212147,
            ],
            [
                34.20013733472935,
                -14.15535402717690,
                57.82335640988400,
                25.83362985412365,
                1.408950972071624,
                -6.551835421242162,
            ],
            [
                42.57076742291101,
                -13.80770672017997,
                93.98938432427124,
                18.77919633714503,
                -31.58359187223370,
                -6.685968952921985,
                -5.810979938412932,
            ],
        ]
    ),
    gamma=0.19,
    c=np.array(
        [0.0, 0.38, 0.3878509998321533, 0.4839718937873840, 0.4570477008819580, 1.0, 1.0, 1.0]
    ),
    d=np.array(
        [
            0.19,
            -0.1823079225333714636,
            -0.319231832186874912,
            0.3449828624725343,
            -0.377417564392089818,
            0.0,
            0.0,
            0.0,
        ]
    ),
    m=np.array([*_A6, 1.0, 1.0, 1.0]),
    e=np.eye(8)[7],
    dense=np.array(
        [
            [
                27.354592673333357,
                -6.925207756232857,
                26.40037733258859,
                0.5635230501052979,
                -4.699151156849391,
                -1.6008677469422725,
                -1.5306074446748028,
                -1.3929872940716344,
            ],
            [
                44.19024239501722,
                1.3677947663381929e-13,
                202.93261852171622,
                -35.5669339789154,
                -181.91095152160645,
                3.4116351403665033,
                2.5793540257308067,
                2.2435122582734066,
            ],
            [
                -44.0988150021747,
                -5.755396159656812e-13,
                -181.26175034586677,
                56.99302194811676,
                183.21182741427398,
                -7.480257918273637,
                -5.792426076169686,
                -5.32503859794143,
            ],
        ]
    ),
)


class Rodas5(AbstractRosenbrock):
    """Rodas5: a stiffly accurate Rosenbrock method of order 5 with an embedded order-4 error
    estimate, eight stages, and its own continuous extension (degree 4 in `theta`). L-stable;
    one Jacobian and one LU factorisation per step, no Newton iteration (so no convergence
    failures). Often the fastest choice for small and medium stiff systems at moderate to tight
    tolerances; it needs an exact Jacobian at every step.

    **Arguments:**

    - `jac`: optional `jac(t, y, args) -> (n, n)` Jacobian of `f` with respect to the raveled
        state; `None` uses `jax.jacfwd`. It must be exact (Rosenbrock methods lose their order
        with an approximate Jacobian); derivatives are those of the steps computed with it.
        Complex states: as for `odeckpt.Kvaerno3`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def van_der_pol(t, y, mu):
        return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])

    sol = odeckpt.solve(van_der_pol, jnp.array([2.0, 0.0]), (0.0, 2.0), args=1000.0,
                        solver=odeckpt.Rodas5(), rtol=1e-6, atol=1e-6)
    ```

    **References:** G. A. Di Marzo, "RODAS5(4) -- Méthodes de Rosenbrock d'ordre 5(4) adaptées
    aux problèmes différentiels-algébriques", MSc thesis, Univ. Geneva (1993) (coefficients and
    dense output); Hairer & Wanner, *Solving ODEs II*, Sec. IV.7 (the transformed formulation).
    """

    jac: Callable | None = None
    mass: FlatMass | None = None

    tableau: ClassVar[RosenbrockTableau] = _RODAS5
    name: ClassVar[str] = "rodas5"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = 4
    fn_evals_per_step: ClassVar[int] = 9
    dense_degree: ClassVar[int] = 4

    def __check_init__(self):
        if self.jac is not None and not callable(self.jac):
            raise TypeError(f"Rodas5(jac={self.jac!r}) must be a function `jac(t, y, args)`.")
