"""Kværnø's ESDIRK methods 3(2), 4(3) and 5(4): L-stable, stiffly accurate, explicit first
stage.

Coefficients from A. Kværnø, "Singly diagonally implicit Runge-Kutta methods with an explicit
first stage", *BIT Numer. Math.* 44 (2004), 489-502 (the 4(3) pair is the one advancing with the
fourth-order last stage). The Newton predictors interpolate the stage derivatives linearly in
time between earlier stages (stage 2 starts from `k_1`; the last stage from the embedded
solution's weights).
"""

from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from ._esdirk import AbstractESDIRK
from ._implicit import check_jac
from ._implicit_tableau import ESDIRKTableau
from ._newton import AbstractNewton, Newton


def _lower(gamma: float, rows: Sequence[Sequence[float | np.ndarray]]) -> np.ndarray:
    """The `(s, s)` ESDIRK matrix with the given rows `2..s` below the diagonal `gamma`."""
    s = len(rows) + 1
    a = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        a[i, :i] = row
        a[i, i] = gamma
    return a


def _predictor(rows: Sequence[Sequence[float | np.ndarray]]) -> np.ndarray:
    s = len(rows) + 1
    alpha = np.zeros((s, s))
    for i, row in enumerate(rows, start=1):
        alpha[i, : len(row)] = row
    return alpha


def _esdirk(a: np.ndarray, predictor: np.ndarray) -> ESDIRKTableau:
    """The tableau whose error estimate compares the last stage with the one before it."""
    previous = np.append(a[-2, :-1], 0.0)
    return ESDIRKTableau(a=a, c=a.sum(axis=1), b_error=a[-1] - previous, predictor=predictor)


# 3(2), gamma the root of 6 g^3 - 18 g^2 + 9 g - 1 in (1/3, 1/2) (L-stability).
_G3 = 0.43586652150
_THETA3 = 1 / (2 * _G3)
_ROW3_3 = [(-4 * _G3**2 + 6 * _G3 - 1) / (4 * _G3), (-2 * _G3 + 1) / (4 * _G3)]
_KVAERNO3 = _esdirk(
    _lower(
        _G3,
        [
            [_G3],
            _ROW3_3,
            [
                (6 * _G3 - 1) / (12 * _G3),
                -1 / ((24 * _G3 - 12) * _G3),
                (-6 * _G3**2 + 6 * _G3 - 1) / (6 * _G3 - 3),
            ],
        ],
    ),
    _predictor([[1.0], [1 - _THETA3, _THETA3], [*_ROW3_3, _G3]]),
)

# 4(3), gamma = 0.5728160625.
_G4 = 0.5728160625
_p = lambda *coeffs: np.polyval(coeffs, _G4)
_ROW4_3 = [
    _p(144, -180, 81, -15, 1) * _G4 / _p(12, -6, 1) ** 2,
    _p(-36, 39, -15, 2) * _G4 / _p(12, -6, 1) ** 2,
]
_ROW4_4 = [
    _p(-144, 396, -330, 117, -18, 1) / (12 * _G4**2 * _p(12, -9, 2)),
    _p(72, -126, 69, -15, 1) / (12 * _G4**2 * _p(3, -1)),
    (_p(-6, 6, -1) * _p(12, -6, 1) ** 2) / (12 * _G4**2 * _p(12, -9, 2) * _p(3, -1)),
]
_ROW4_5 = [
    _p(288, -312, 120, -18, 1) / (48 * _G4**2 * _p(12, -9, 2)),
    _p(24, -12, 1) / (48 * _G4**2 * _p(3, -1)),
    -(_p(12, -6, 1) ** 3) / (48 * _G4**2 * _p(3, -1) * _p(12, -9, 2) * _p(6, -6, 1)),
    _p(-24, 36, -12, 1) / _p(24, -24, 4),
]
_C4 = (2 * _G4, _G4 + sum(_ROW4_3))
_THETA4 = (_C4[1] / _C4[0], (1 - _C4[0]) / (_C4[1] - _C4[0]))
_KVAERNO4 = _esdirk(
    _lower(_G4, [[_G4], _ROW4_3, _ROW4_4, _ROW4_5]),
    _predictor(
        [
            [1.0],
            [1 - _THETA4[0], _THETA4[0]],
            [0.0, 1 - _THETA4[1], _THETA4[1]],
            [*_ROW4_4, _G4],
        ]
    ),
)

# 5(4), gamma = 0.26.
_G5 = 0.26
_ROW5_6 = [
    0.13855640231268224,
    0.0,
    -0.04245337201752043,
    0.02446657898003141,
    0.61943039072480676,
]
_KVAERNO5 = _esdirk(
    _lower(
        _G5,
        [
            [_G5],
            [0.13, 0.84033320996790809],
            [0.22371961478320505, 0.47675532319799699, -0.06470895363112615],
            [0.16648564323248321, 0.10450018841591720, 0.03631482272098715, -0.13090704451073998],
            _ROW5_6,
            [
                0.13659751177640291,
                0.0,
                -0.05496908796538376,
                -0.04118626728321046,
                0.62993304899016403,
                0.06962479448202728,
            ],
        ],
    ),
    _predictor(
        [
            [1.0],
            [-1.366025403784441, 2.3660254037844357],
            [-0.19650552613122207, 0.8113579546496623, 0.38514757148155954],
            [0.10375304369958693, 0.937994698066431, -0.04174774176601781],
            [-0.17281112873898072, 0.6235784481025847, 0.5492326806363959],
            [*_ROW5_6, _G5],
        ]
    ),
)


class Kvaerno3(AbstractESDIRK):
    """Kværnø's ESDIRK 3(2): third order, L-stable and stiffly accurate, an embedded
    second-order error estimate, four stages (one explicit, three implicit with the same
    diagonal), cubic Hermite dense output. A good default at loose tolerances (`rtol >= 1e-4`).

    **Arguments:**

    - `newton`: the Newton method of the implicit stages: `odeckpt.Newton()` (dense Jacobian,
        reused across steps; the default) or `odeckpt.NewtonKrylov()` (matrix-free).
    - `jac`: optional `jac(t, y, args) -> (n, n)` Jacobian of `f` with respect to the raveled
        state; `None` uses `jax.jacfwd`. For a complex state, either the complex `(n, n)` matrix
        (holomorphic `f`) or the real one over the real and imaginary parts (any `f`). Only
        Newton's iteration uses it, so it may be approximate or stale; derivatives use the
        exact Jacobian.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, 1.0), args=1e4,
                        solver=odeckpt.Kvaerno3(), rtol=1e-4, atol=1e-6)
    ```

    **References:** Kværnø (2004), *BIT* 44, 489-502.
    """

    newton: AbstractNewton = Newton()
    jac: Callable | None = None

    tableau: ClassVar[ESDIRKTableau] = _KVAERNO3
    name: ClassVar[str] = "kvaerno3"
    order: ClassVar[int] = 3
    error_order: ClassVar[int | None] = 2
    fn_evals_per_step: ClassVar[int] = 3
    dense_degree: ClassVar[int] = 3
    tolerance_exponent: ClassVar[float] = 1.25

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)


class Kvaerno4(AbstractESDIRK):
    """Kværnø's ESDIRK 4(3): fourth order, L-stable and stiffly accurate, an embedded
    third-order error estimate, five stages (one explicit), cubic Hermite dense output.

    **Arguments:** `newton` and `jac` as for `Kvaerno3`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    sol = odeckpt.solve(lambda t, y, k: -k * y, jnp.array([1.0]), (0.0, 1.0), args=1e4,
                        solver=odeckpt.Kvaerno4())
    ```

    **References:** Kværnø (2004), *BIT* 44, 489-502.
    """

    newton: AbstractNewton = Newton()
    jac: Callable | None = None

    tableau: ClassVar[ESDIRKTableau] = _KVAERNO4
    name: ClassVar[str] = "kvaerno4"
    order: ClassVar[int] = 4
    error_order: ClassVar[int | None] = 3
    fn_evals_per_step: ClassVar[int] = 4
    dense_degree: ClassVar[int] = 3
    tolerance_exponent: ClassVar[float] = 1.25

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)


class Kvaerno5(AbstractESDIRK):
    """Kværnø's ESDIRK 5(4): fifth order, L-stable and stiffly accurate, an embedded
    fourth-order error estimate, seven stages (one explicit), cubic Hermite dense output. The
    ESDIRK of choice at tight tolerances. Stages 3 and 4 evaluate `f` slightly past `t1`
    (`c_3 = 1.23`).

    **Arguments:** `newton` and `jac` as for `Kvaerno3`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def robertson(t, y, k):
        k1, k2, k3 = k
        return jnp.stack([
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ])

    sol = odeckpt.solve(robertson, jnp.array([1.0, 0.0, 0.0]), (0.0, 1e5),
                        args=(0.04, 3e7, 1e4), solver=odeckpt.Kvaerno5(), rtol=1e-6,
                        atol=1e-10)
    ```

    **References:** Kværnø (2004), *BIT* 44, 489-502.
    """

    newton: AbstractNewton = Newton()
    jac: Callable | None = None

    tableau: ClassVar[ESDIRKTableau] = _KVAERNO5
    name: ClassVar[str] = "kvaerno5"
    order: ClassVar[int] = 5
    error_order: ClassVar[int | None] = 4
    fn_evals_per_step: ClassVar[int] = 6
    dense_degree: ClassVar[int] = 3
    tolerance_exponent: ClassVar[float] = 1.25

    def __check_init__(self):
        check_jac(self, self.newton, self.jac)
