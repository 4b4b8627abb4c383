"""The implicit Euler method and the trapezoidal rule (Crank-Nicolson), as ESDIRK tableaux."""

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ._esdirk import AbstractESDIRK
from ._implicit import check_jac
from ._implicit_tableau import ESDIRKTableau
from ._newton import AbstractNewton, Newton

_FIRST_GUESS = np.array([[0.0, 0.0], [1.0, 0.0]])
"""Both start Newton from `k_2 = k_1 = f(t0, y0)`."""

# y1 = y0 + h f(t1, y1); the error estimate compares with y0 + h (k1 + k2) / 2 (second order).
_IMPLICIT_EULER = ESDIRKTableau(
    a=np.array([[0.0, 0.0], [0.0, 1.0]]),
    c=np.array([0.0, 1.0]),
    b_error=np.array([-0.5, 0.5]),
    predictor=_FIRST_GUESS,
)

# y1 = y0 + h (f(t0, y0) + f(t1, y1)) / 2; the error estimate compares with explicit Euler.
_TRAPEZOID = ESDIRKTableau(
    a=np.array([[0.0, 0.0], [0.5, 0.5]]),
    c=np.array([0.0, 1.0]),
    b_error=np.array([-0.5, 0.5]),
    predictor=_FIRST_GUESS,
)


class ImplicitEuler(AbstractESDIRK):
    """The implicit (backward) Euler method: first order, L-stable, one implicit stage per
    step; the error estimate `h (f(t1, y1) - f(t0, y0)) / 2` (the difference from a
    second-order trapezoidal combination) allows adaptive steps. Cubic Hermite dense output.

    **Arguments:** `newton` and `jac` as for `odeckpt.Kvaerno3`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, 1.0), args=1e6,
                        solver=odeckpt.ImplicitEuler(), controller=odeckpt.ConstantStep(),
                        dt0=0.1)
    ```

    **References:** Hairer & Wanner, *Solving ODEs II*, Sec. IV.3.
    """

    newton: AbstractNewton = Newton()
    jac: Callable | None = None

    tableau: ClassVar[ESDIRKTableau] = _IMPLICIT_EULER
    name: ClassVar[str] = "implicit_euler"
    order: ClassVar[int] = 1
    error_order: ClassVar[int | None] = 2
    fn_evals_per_step: ClassVar[int] = 1
    dense_degree: ClassVar[int] = 3
    tolerance_exponent: ClassVar[float] = 2.0

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)


class Trapezoid(AbstractESDIRK):
    """The trapezoidal rule (Crank-Nicolson): second order, A-stable but not L-stable (stiff
    components are not damped: prefer `Kvaerno3` for very stiff problems), one implicit stage
    per step, an error estimate from explicit Euler. Cubic Hermite dense output.

    **Arguments:** `newton` and `jac` as for `odeckpt.Kvaerno3`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    sol = odeckpt.solve(lambda t, y, args: -10.0 * y, jnp.array([1.0]), (0.0, 1.0),
                        solver=odeckpt.Trapezoid(), rtol=1e-5)
    ```

    **References:** J. Crank & P. Nicolson, *Proc. Camb. Phil. Soc.* 43 (1947), 50-67; Hairer &
    Wanner, *Solving ODEs II*, Sec. IV.3.
    """

    newton: AbstractNewton = Newton()
    jac: Callable | None = None

    tableau: ClassVar[ESDIRKTableau] = _TRAPEZOID
    name: ClassVar[str] = "trapezoid"
    order: ClassVar[int] = 2
    error_order: ClassVar[int | None] = 1
    fn_evals_per_step: ClassVar[int] = 1
    dense_degree: ClassVar[int] = 3

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)
