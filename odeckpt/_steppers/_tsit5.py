"""Tsitouras 5(4) with its native continuous extension."""

from typing import ClassVar

import numpy as np
from numpy.polynomial import Polynomial

from ._explicit_rk import AbstractExplicitRK
from ._tableau import ButcherTableau

# Tsitouras (2011), Table 1. The paper gives c, b and a_ij for j >= 2; its first-column
# simplifying assumption fixes a_i1 = c_i - sum_{j>=2} a_ij.
_C = np.array([0.0, 0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0])
_B = np.array(
    [
        0.09646076681806523,
        0.01,
        0.4798896504144996,
        1.379008574103742,
        -3.290069515436081,
        2.324710524099774,
        0.0,
    ]
)
_A_TAIL = [
    [],
    [],
    [0.3354806554923570],
    [-6.359448489975075, 4.362295432869581],
    [-11.74888356406283, 7.495539342889836, -0.09249506636175525],
    [-12.92096931784711, 8.159367898576159, -0.07158497328140100, -0.02826905039406838],
]
# The paper prints the error weights b - b_hat; with e_7 = -1/66 they sum to zero.
_B_ERROR = np.array(
    [
        0.001780011052226,
        0.000816434459657,
        -0.007880878010262,
        0.144711007173263,
        -0.582357165452555,
        0.458082105929187,
        -1 / 66,
    ]
)


def _stage_matrix() -> np.ndarray:
    a = np.zeros((7, 7))
    for i, tail in enumerate(_A_TAIL):
        a[i, 1 : 1 + len(tail)] = tail
        if i > 0:
            a[i, 0] = _C[i] - sum(tail)
    a[6, :6] = _B[:6]
    return a


def _dense_weights() -> np.ndarray:
    """Tsitouras (2011), Sec. 3: the fourth-order continuous extension b_i(theta), printed in
    factored form, expanded here into powers theta^1 ... theta^4."""
    t = Polynomial([0.0, 1.0])
    b_theta = [
        -1.0530884977290216
        * t
        * (t - 1.3299890189751412)
        * (t**2 - 1.4364028541716351 * t + 0.7139816917074209),
        0.1017 * t**2 * (t**2 - 2.1966568338249754 * t + 1.2949852507374631),
        2.490627285651252793 * t**2 * (t**2 - 2.38535645472061657 * t + 1.57803468208092486),
        -16.54810288924490272 * (t - 1.21712927295533244) * (t - 0.61620406037800089) * t**2,
        47.37952196281928122 * (t - 1.203071208372362603) * (t - 0.658047292653547382) * t**2,
        -34.87065786149660974 * (t - 1.2) * (t - 0.666666666666666667) * t**2,
        2.5 * (t - 1) * (t - 0.6) * t**2,
    ]
    return np.stack([np.pad(p.coef, (0, 5 - len(p.coef)))[1:] for p in b_theta], axis=1)


_TSIT5 = ButcherTableau(a=_stage_matrix(), b=_B, c=_C, b_error=_B_ERROR, b_dense=_dense_weights())


class Tsit5(AbstractExplicitRK):
    """Tsitouras' 5(4) pair: fifth order, an embedded fourth-order error estimate, seven
    stages with FSAL (six evaluations per step), and its native fourth-order continuous
    extension as dense output (degree 4). A good default for non-stiff problems.

    **References:** Ch. Tsitouras, "Runge-Kutta pairs of order 5(4) satisfying only the first
    column simplifying assumption", *Comput. Math. Appl.* 62(2) (2011), 770-775.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Tsit5())  # the default solver
    ```
    """

    tableau: ClassVar[ButcherTableau] = _TSIT5
    name: ClassVar[str] = "tsit5"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = 4
    fn_evals_per_step: ClassVar[int] = _TSIT5.fn_evals_per_step
    dense_degree: ClassVar[int] = _TSIT5.dense_degree
