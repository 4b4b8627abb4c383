"""Bogacki-Shampine 3(2)."""

from typing import ClassVar

import numpy as np

from ._explicit_rk import AbstractExplicitRK
from ._tableau import ButcherTableau

_B = np.array([2 / 9, 1 / 3, 4 / 9, 0.0])
_B_HAT = np.array([7 / 24, 1 / 4, 1 / 3, 1 / 8])

_BOSH3 = ButcherTableau(
    a=np.array(
        [
            [0.0, 0.0, 0.0, 0.0],
            [1 / 2, 0.0, 0.0, 0.0],
            [0.0, 3 / 4, 0.0, 0.0],
            _B,
        ]
    ),
    b=_B,
    c=np.array([0.0, 1 / 2, 3 / 4, 1.0]),
    b_error=_B - _B_HAT,
)


class Bosh3(AbstractExplicitRK):
    """The Bogacki-Shampine 3(2) pair: third order, an embedded second-order error estimate,
    four stages with FSAL (three evaluations per step); cubic Hermite dense output.

    **References:** P. Bogacki & L. F. Shampine, "A 3(2) pair of Runge-Kutta formulas",
    *Appl. Math. Lett.* 2(4) (1989), 321-325.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Bosh3(), rtol=1e-4, atol=1e-6)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _BOSH3
    name: ClassVar[str] = "bosh3"
    order: ClassVar[int] = 3
    error_order: ClassVar[int | None] = 2
    fn_evals_per_step: ClassVar[int] = _BOSH3.fn_evals_per_step
    dense_degree: ClassVar[int] = _BOSH3.dense_degree
