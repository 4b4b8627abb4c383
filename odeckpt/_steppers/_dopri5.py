"""Dormand-Prince 5(4) with Shampine's continuous extension."""

from typing import ClassVar

import numpy as np

from ._explicit_rk import AbstractExplicitRK
from ._tableau import ButcherTableau

_B = np.array([35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84, 0.0])
_B_HAT = np.array([5179 / 57600, 0.0, 7571 / 16695, 393 / 640, -92097 / 339200, 187 / 2100, 1 / 40])

# Hairer, Norsett & Wanner vol. I, Sec. II.6 (code DOPRI5, after Shampine 1986):
#   y(theta) = y0 + theta (dy + (1 - theta) (h k1 - dy + theta (2 dy - h k1 - h k7
#              + (1 - theta) h sum_i d_i k_i)))          with dy = y1 - y0 = h sum_i b_i k_i.
# Expanded in powers of theta this is the cubic Hermite interpolant through (y0, k1, y1, k7)
# plus theta^2 (1 - theta)^2 h sum_i d_i k_i.
_D = np.array(
    [
        -12715105075 / 11282082432,
        0.0,
        87487479700 / 32700410799,
        -10690763975 / 1880347072,
        701980252875 / 199316789632,
        -1453857185 / 822651844,
        69997945 / 29380423,
    ]
)
_K1 = np.eye(7)[0]
_K7 = np.eye(7)[6]

_DOPRI5 = ButcherTableau(
    a=np.array(
        [
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [1 / 5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            [3 / 40, 9 / 40, 0.0, 0.0, 0.0, 0.0, 0.0],
            [44 / 45, -56 / 15, 32 / 9, 0.0, 0.0, 0.0, 0.0],
            [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729, 0.0, 0.0, 0.0],
            [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656, 0.0, 0.0],
            _B,
        ]
    ),
    b=_B,
    c=np.array([0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0]),
    b_error=_B - _B_HAT,
    b_dense=np.stack(
        [
            _K1,  # theta
            3 * _B - 2 * _K1 - _K7 + _D,  # theta^2
            _K1 + _K7 - 2 * _B - 2 * _D,  # theta^3
            _D,  # theta^4
        ]
    ),
)


class Dopri5(AbstractExplicitRK):
    """The Dormand-Prince 5(4) pair ("DOPRI5", RK5(4)7M): fifth order, an embedded
    fourth-order error estimate, seven stages with FSAL (six evaluations per step), and
    Shampine's free fourth-order continuous extension as dense output (degree 4).

    **References:** J. R. Dormand & P. J. Prince, "A family of embedded Runge-Kutta formulae",
    *J. Comput. Appl. Math.* 6(1) (1980), 19-26; L. F. Shampine, "Some practical Runge-Kutta
    formulas", *Math. Comp.* 46 (1986), 135-150; Hairer, Norsett & Wanner, *Solving Ordinary
    Differential Equations I*, 2nd ed. (1993), Sec. II.5-II.6.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Dopri5(),
                        saveat=odeckpt.SaveAt(dense=True))
    y_half = sol.evaluate(0.5)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _DOPRI5
    name: ClassVar[str] = "dopri5"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = 4
    fn_evals_per_step: ClassVar[int] = _DOPRI5.fn_evals_per_step
    dense_degree: ClassVar[int] = _DOPRI5.dense_degree
