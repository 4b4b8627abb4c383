"""Variable-order (1 to 5), variable-step backward differentiation formulas in the quasi-constant
step size form of Shampine and Reichelt's ode15s (scipy's `BDF`)."""

import dataclasses
from collections.abc import Callable
from typing import ClassVar, overload

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._autodiff import filled
from .._real_coordinates import RealCoordinates
from .._types import Args, IntScalar, Scalar, VectorField, Y
from ._base import Step
from ._esdirk import ImplicitState
from ._implicit import AbstractProposer, check_jac, check_tolerances, per_step
from ._mass import AbstractMassMatrix, FlatMass
from ._newton import AbstractNewton, Jacobian, Newton, Stage, same_step_size

MAX_ORDER = 5
_MIN_FACTOR, _MAX_FACTOR = 0.2, 10.0
"""Bounds on the ratio of consecutive step sizes (scipy's)."""
_SAFETY = 0.9


@dataclasses.dataclass(frozen=True, eq=False)
class BDFCoefficients:
    """The coefficients of the backward differentiation formulas of orders 1 to 5 in backward
    difference form, checked once at construction.

    With backward differences `D_j` of the solution on an equally spaced history (spacing `h`)
    and the order `k`, a step predicts `y_p = sum_{j<=k} D_j` and solves
    `y1 = y_p - psi + (h / alpha_k) f(t1, y1)` with `psi = sum_{j=1..k} gamma_j D_j / alpha_k`;
    its error estimate is `error_k (y1 - y_p)`.

    **Arguments:**

    - `kappa`: `(6,)` the coefficients of Klopfenstein and Shampine's numerical differentiation
        formulas (NDFs), `kappa[0]` unused and 0; all zero gives the BDFs.

    Raises `ValueError` on `kappa` of another shape, with `kappa[0] != 0` or `|kappa| >= 1/2`.

    **Derived fields:** `gamma` (`gamma_j = sum_{i<=j} 1/i`), `alpha` (`(1 - kappa_j) gamma_j`),
    `error` (`kappa_j gamma_j + 1/(j + 1)`), `unit` (the matrix `U` that, with `R` of the same
    form for a ratio `r` of step sizes, interpolates the differences to the spacing `r h`:
    `D <- (R U)^T D`; `U U = I`), and `interpolation`: the `(6, 6)` coefficients of the powers
    `theta^0..theta^5` of `prod_{i<j} (theta - 1 + i) / (i + 1)`, with which the interpolant
    through the history is `sum_j D_j prod_{i<j} (...)` over the last step (`theta` from 0 to
    1).

    **References:** L. F. Shampine & M. W. Reichelt, "The MATLAB ODE suite", *SIAM J. Sci.
    Comput.* 18 (1997), 1-22; Hairer & Wanner, *Solving ODEs II*, Sec. III.1 and III.5.
    """

    kappa: np.ndarray

    gamma: np.ndarray = dataclasses.field(init=False)
    alpha: np.ndarray = dataclasses.field(init=False)
    error: np.ndarray = dataclasses.field(init=False)
    unit: np.ndarray = dataclasses.field(init=False)
    interpolation: np.ndarray = dataclasses.field(init=False)

    def __post_init__(self):
        kappa = np.array(self.kappa, dtype=np.float64)
        if kappa.shape != (MAX_ORDER + 1,) or kappa[0] != 0 or np.any(np.abs(kappa) >= 0.5):
            raise ValueError(
                f"`kappa` must have shape ({MAX_ORDER + 1},), kappa[0] = 0 and |kappa| < 1/2; "
                f"got {kappa}."
            )
        j = np.arange(MAX_ORDER + 1)
        gamma = np.concatenate([[0.0], np.cumsum(1 / j[1:])])
        unit = change_matrix(np.float64(1.0))
        if not np.allclose(unit @ unit, np.eye(MAX_ORDER + 1), atol=1e-12):
            raise ValueError("The difference matrix U must be an involution.")
        derived = dict(
            kappa=kappa, gamma=gamma, alpha=(1 - kappa) * gamma,
            error=kappa * gamma + 1 / (j + 1), unit=unit, interpolation=_interpolation(),
        )  # fmt: skip
        for name, value in derived.items():
            value.flags.writeable = False
            object.__setattr__(self, name, value)


@overload
def change_matrix(ratio: jax.Array) -> jax.Array: ...
@overload
def change_matrix(ratio: float | np.floating) -> np.ndarray: ...
def change_matrix(ratio):
    """Shampine and Reichelt's `R`: with `U = R(1)`, `(R(ratio) U)^T` maps the backward
    differences of a history spaced `h` to those of the same interpolant spaced `ratio h`.
    NumPy or JAX, as `ratio` is."""
    xp = jnp if isinstance(ratio, jax.Array) else np
    i = xp.arange(1, MAX_ORDER + 1)[:, None]
    j = xp.arange(1, MAX_ORDER + 1)[None, :]
    inner = (i - 1 - ratio * j) / i
    first = xp.ones((1, MAX_ORDER + 1), dtype=inner.dtype)
    rest = xp.concatenate([xp.zeros((MAX_ORDER, 1), dtype=inner.dtype), inner], axis=1)
    return xp.cumprod(xp.concatenate([first, rest], axis=0), axis=0)


def _interpolation() -> np.ndarray:
    rows = [np.array([1.0])]
    for j in range(1, MAX_ORDER + 1):
        factor = np.array([(j - 2) / j, 1 / j])  # (theta - 1 + (j - 1)) / j, lowest power first
        rows.append(np.convolve(rows[-1], factor))
    return np.stack([np.pad(r, (0, MAX_ORDER + 1 - r.size)) for r in rows])


BDF_COEFFICIENTS = BDFCoefficients(kappa=np.zeros(MAX_ORDER + 1))
"""The backward differentiation formulas."""
NDF_COEFFICIENTS = BDFCoefficients(kappa=np.array([0, -0.1850, -1 / 9, -0.0823, -0.0415, 0]))
"""Klopfenstein and Shampine's numerical differentiation formulas, as in ode15s and scipy."""


class BDFHistory(eqx.Module):
    """What a `BDF` step depends on differentiably besides `(y, args)` (see `BDFState`)."""

    f: Y
    differences: Array


class BDFState(eqx.Module):
    """What `BDF` carries between steps.

    **Fields:**

    - `implicit`: `f(t, y, args)` at the current point (from the last step's implicit
        equation), the Newton method's cache and its convergence estimate.
    - `differences`: `(8, m)` backward differences `D_0 = y, D_1, ..., D_{k+2}` of the
        solution on an equally spaced history (spacing `h`), in real coordinates; rows past
        `k + 2` are stale.
    - `h`: the spacing of `differences`.
    - `order`: the order `k` of the next step.
    - `equal_steps`: the steps taken since the order or the step size last changed.
    """

    implicit: ImplicitState
    differences: Array
    h: Scalar
    order: IntScalar
    equal_steps: IntScalar


class BDF(AbstractMassMatrix, AbstractProposer):
    """Variable-order (1 to 5), variable-step backward differentiation formulas, as in CVODE,
    scipy's `BDF` and Julia's `QNDF`/`FBDF`: one implicit equation per step, solved by
    simplified Newton with the Jacobian reused across steps, so a step costs one or two
    evaluations of `f`. For large stiff systems and for loose to moderate tolerances; A-stable
    up to order 2 and stable on sectors about the negative axis up to order 5.

    The history is kept as backward differences on an equally spaced grid (the quasi-constant
    step size form of ode15s and scipy, equivalent to rescaling a Nordsieck array): when the
    step size changes, the differences are interpolated to the new spacing. After `k + 1`
    steps at the same step size and order `k`, the order is chosen among `k - 1`, `k`,
    `k + 1` by the error estimates of the three (from the differences), together with the
    next step size (`Step.dt_factor`); in between, the step size is kept. Every decision is a
    function of the carried state, so a checkpointing adjoint's recomputation repeats it.
    Starts at order 1.

    The state carried between steps (and held by every snapshot of a checkpointing adjoint) is
    the `8 n` differences, `f` (`n`), and for `Newton` the Jacobian and its LU factors
    (`2 n^2`); the stage is differentiated by the implicit function theorem, and gradients flow
    through the history. `Stats.num_fn_evals` counts one evaluation of `f` per Newton
    iteration.

    **Arguments:**

    - `newton`: `odeckpt.Newton()` (the default: at most 4 iterations a step, the Jacobian
        re-evaluated only when an iteration contracts slower than 0.5 per iteration or fails)
        or `odeckpt.NewtonKrylov()`.
    - `jac`: optional `jac(t, y, args)`, as for `odeckpt.Kvaerno3`.
    - `ndf`: use Klopfenstein and Shampine's numerical differentiation formulas (NDFs: smaller
        error constants at orders 1 to 4, as scipy's `BDF` and ode15s do) instead of the BDFs.
    - `rtol`, `atol`: the tolerances of the order and step-size choice; `None` (the default)
        takes those of the solve.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def robertson(t, y, k):
        return jnp.stack([
            -k[0] * y[0] + k[2] * y[1] * y[2],
            k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
            k[1] * y[1] ** 2,
        ])

    sol = odeckpt.solve(robertson, jnp.array([1.0, 0.0, 0.0]), (0.0, 1e5),
                        args=jnp.array([0.04, 3e7, 1e4]), solver=odeckpt.BDF(), rtol=1e-6,
                        atol=1e-10)
    ```

    **References:** Shampine & Reichelt (1997), *SIAM J. Sci. Comput.* 18, 1-22; A. C.
    Hindmarsh et al., "SUNDIALS", *ACM TOMS* 31 (2005), 363-396; Hairer & Wanner, *Solving
    ODEs II*, Sec. III.5 and VI.
    """

    newton: AbstractNewton = Newton(max_iters=4, reuse_rate=0.5)
    jac: Callable | None = None
    ndf: bool = eqx.field(default=False, static=True)
    rtol: float | None = None
    atol: float | None = None
    mass: FlatMass | None = None

    name: ClassVar[str] = "bdf"
    order: ClassVar[int] = MAX_ORDER
    error_order: ClassVar[int | None] = 1
    fn_evals_per_step: ClassVar[int] = 1
    dense_degree: ClassVar[int] = MAX_ORDER
    multistep: ClassVar[bool] = True
    tolerance_exponent: ClassVar[float] = 1.2

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)
        check_tolerances(self)
        if not isinstance(self.ndf, bool):
            raise TypeError(f"BDF(ndf={self.ndf!r}) must be True or False.")

    @property
    def coefficients(self) -> BDFCoefficients:
        return NDF_COEFFICIENTS if self.ndf else BDF_COEFFICIENTS

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> BDFState:
        """**Returns:** the state at the initial point: the differences of the constant-slope
        history `D_0 = y0, D_1 = y'(t0)` (spacing 1; `y' = f(t0, y0)` for an ODE, the slope
        of the consistent solution for a DAE), order 1, an empty Newton cache."""
        t0 = jnp.asarray(t0)
        implicit = ImplicitState.initial(self.newton, f, t0, y0, args)
        coordinates, y0_flat = RealCoordinates.make(y0)
        slope = implicit.f if self.mass is None else self.slope(f, t0, y0, args)
        differences = filled(y0_flat, 0, rows=MAX_ORDER + 3)
        differences = differences.at[0].set(y0_flat).at[1].set(coordinates.ravel(slope))
        return BDFState(
            implicit=implicit,
            differences=differences,
            h=jnp.ones((), t0.dtype),
            order=jnp.ones((), jnp.int32),
            equal_steps=jnp.zeros((), jnp.int32),
        )

    def differentiable_state(self, state: BDFState) -> BDFHistory:
        """**Returns:** `f(t, y, args)` and the backward differences: a step's predictor and
        its implicit equation are linear in the differences."""
        return BDFHistory(state.implicit.f, state.differences)

    def with_differentiable_state(self, state: BDFState, part: BDFHistory) -> BDFState:
        state = super().with_differentiable_state(state, part.f)
        return dataclasses.replace(state, differences=part.differences)

    def step(
        self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: BDFState
    ) -> Step:
        """Attempt one step of order `state.order` from `(t0, y0)` to `t1` (`t1 < t0`
        integrates backwards), the history first interpolated to the spacing `t1 - t0`.

        **Returns:** a `Step` with `y1`, the error estimate `error_k (y1 - y_p)`, the
        interpolant through the history as dense output (degree up to 5, padded with zeros),
        the states to carry on acceptance (with the order for the next step) and on
        rejection, whether the Newton iteration failed, the proposed ratio of step sizes
        (`dt_factor`) and the work done.
        """
        coefficients = self.coefficients
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = t1 - t0
        field, y0_flat = self.field_of(f, t0, y0, args)
        field = field.for_step(h)
        dtype, k = y0_flat.dtype, state.order
        history = _rescale(state.differences, k, (h / state.h).astype(dtype))
        rows = jnp.arange(MAX_ORDER + 3)
        predicted = (rows <= k).astype(dtype) @ history
        gamma = jnp.asarray(np.pad(coefficients.gamma, (0, 2)), dtype)
        alpha = jnp.asarray(coefficients.alpha, t0.dtype)[k]
        psi = (jnp.where(rows <= k, gamma, 0) @ history) / alpha.astype(dtype)
        c = h / alpha
        newton, jacobian = self.tight_newton(dtype), Jacobian(self.jac)
        prepared = newton.prepare(jacobian, field, t0, y0_flat, args, c, state.implicit.cache)
        stage = Stage(field, t1, c, predicted - psi, args)
        scale = newton.scale(field.coordinates, y0_flat)
        z, info = newton.solve(stage, predicted, prepared, scale, state.implicit.eta)
        d = z - predicted
        y1 = field.unravel(z)
        y_error = jnp.asarray(coefficients.error, dtype)[k] * d
        differences = _updated(history, d, k)
        choice = self._choose(field, y0, y1, y_error, differences, state, h, info.num_iterations)
        failed = ~info.converged
        on_accept, on_reject = newton.next_caches(prepared.cache, failed, info.rate)
        # f(t1, y1) from the implicit equation, as ESDIRK steppers take theirs.
        f1 = field.unravel(per_step(field.mass_times(z - stage.base), c))
        accepted = BDFState(
            implicit=ImplicitState(f1, on_accept, info.eta), differences=differences, h=h,
            order=jnp.where(choice.ready, choice.order, k), equal_steps=choice.equal_steps,
        )  # fmt: skip
        interpolation = jnp.where((rows[:6] <= k)[:, None], coefficients.interpolation, 0)
        dense = interpolation.astype(dtype).T @ differences[: MAX_ORDER + 1]
        return Step(
            y1=y1,
            y_error=field.unravel(y_error),
            dense=jax.vmap(field.unravel)(dense),
            state=accepted,
            state_on_reject=dataclasses.replace(
                state,
                implicit=state.implicit.rejected(on_reject, failed, info.eta),
                equal_steps=jnp.zeros_like(k),
            ),
            failed=failed,
            nonfinite=info.nonfinite,
            num_jacobian_evals=prepared.num_jacobian_evals,
            num_lu_factorisations=prepared.num_lu_factorisations,
            num_fn_evals=info.num_iterations,
            dt_factor=choice.dt_factor,
        )

    def _choose(self, field, y0, y1, y_error, differences, state, h, iterations) -> "Choice":
        """The next order and ratio of step sizes (scipy's `BDF`): after `k + 1` equal steps,
        the order among `k - 1, k, k + 1` whose error estimate allows the longest step, and
        that step; before, the same step; after a rejection, a shorter step at order `k`."""
        k = state.order
        error = jnp.asarray(self.coefficients.error, differences.dtype)
        y_error, differences, y0, y1, h = jax.lax.stop_gradient((y_error, differences, y0, y1, h))
        norm = lambda v: self.error_norm(field.unravel(v), y0, y1)
        error_k = norm(y_error)
        below = jnp.where(k > 1, norm(error[k - 1] * differences[k]), jnp.inf)
        above = jnp.where(
            k < MAX_ORDER, norm(error[jnp.minimum(k + 1, MAX_ORDER)] * differences[k + 2]), jnp.inf
        )
        orders = jnp.stack([k - 1, k, k + 1])
        factors = jnp.stack([below, error_k, above]) ** (-1.0 / (orders + 1))
        most = 2 * self.newton.max_iters
        safety = _SAFETY * (most + 1) / (most + iterations)
        equal = jnp.where(same_step_size(h, state.h), state.equal_steps, 0) + 1
        ready = equal >= k + 1
        grow = jnp.where(ready, jnp.minimum(_MAX_FACTOR, safety * jnp.max(factors)), 1.0)
        shrink = jnp.maximum(_MIN_FACTOR, safety * error_k ** (-1.0 / (k + 1)))
        return Choice(
            order=jnp.clip(orders[jnp.argmax(factors)], 1, MAX_ORDER),
            ready=ready,
            equal_steps=jnp.where(ready, 0, equal),
            dt_factor=jnp.where(error_k <= 1, grow, shrink).astype(h.dtype),
        )


class Choice(eqx.Module):
    """BDF's choice after a step: the next order (used if `ready`), the count of equal steps
    to carry, and the proposed ratio of step sizes."""

    order: IntScalar
    ready: Array
    equal_steps: IntScalar
    dt_factor: Scalar


def _rescale(differences: Array, order: IntScalar, ratio: Scalar) -> Array:
    """The differences of orders `0..order` interpolated to a spacing `ratio` times theirs:
    `D <- (R U)^T D` (the leading blocks of the order-5 matrices are those of lower orders,
    `U` being upper triangular); the rows past `order` unchanged."""
    unit = jnp.asarray(BDF_COEFFICIENTS.unit, differences.dtype)
    product = change_matrix(ratio) @ unit
    rows = jnp.arange(MAX_ORDER + 1)
    inside = (rows[:, None] <= order) & (rows[None, :] <= order)
    product = jnp.where(inside, product, jnp.eye(MAX_ORDER + 1, dtype=differences.dtype))
    head = product.T @ differences[: MAX_ORDER + 1]
    return jnp.concatenate([head, differences[MAX_ORDER + 1 :]])


def _updated(differences: Array, d: Array, order: IntScalar) -> Array:
    """The differences after an accepted step whose solution is `y_p + d`: `D_{k+2} = d -
    D_{k+1}`, `D_{k+1} = d`, and `D_i = D_i + D_{i+1}` downwards from `i = k` (so `D_0 = y1`)."""
    rows = jnp.arange(differences.shape[0])[:, None]
    upto = rows <= order
    suffix = jnp.cumsum(jnp.where(upto, differences, 0)[::-1], axis=0)[::-1]
    new = jnp.where(upto, d[None] + suffix, differences)
    new = jnp.where(rows == order + 1, d[None], new)
    return jnp.where(rows == order + 2, (d - differences[order + 1])[None], new)
