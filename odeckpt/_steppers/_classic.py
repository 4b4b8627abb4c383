"""Classical fixed-order explicit Runge-Kutta methods: Euler, Heun, Midpoint, Ralston, RK4.

All use the cubic Hermite interpolant through `(y0, f0, y1, f1)` for dense output. Only Heun
carries an embedded (Euler) error estimate.
"""

from typing import ClassVar

import numpy as np

from ._explicit_rk import AbstractExplicitRK
from ._tableau import ButcherTableau

_EULER = ButcherTableau(a=np.zeros((1, 1)), b=np.array([1.0]), c=np.array([0.0]))

_HEUN = ButcherTableau(
    a=np.array([[0.0, 0.0], [1.0, 0.0]]),
    b=np.array([1 / 2, 1 / 2]),
    c=np.array([0.0, 1.0]),
    b_error=np.array([1 / 2, 1 / 2]) - np.array([1.0, 0.0]),  # b - b_euler
)

_MIDPOINT = ButcherTableau(
    a=np.array([[0.0, 0.0], [1 / 2, 0.0]]),
    b=np.array([0.0, 1.0]),
    c=np.array([0.0, 1 / 2]),
)

_RALSTON = ButcherTableau(
    a=np.array([[0.0, 0.0], [2 / 3, 0.0]]),
    b=np.array([1 / 4, 3 / 4]),
    c=np.array([0.0, 2 / 3]),
)

_RK4 = ButcherTableau(
    a=np.array(
        [
            [0.0, 0.0, 0.0, 0.0],
            [1 / 2, 0.0, 0.0, 0.0],
            [0.0, 1 / 2, 0.0, 0.0],
            [0.0, 0.0, 1.0, 0.0],
        ]
    ),
    b=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
    c=np.array([0.0, 1 / 2, 1 / 2, 1.0]),
)


class Euler(AbstractExplicitRK):
    """The explicit Euler method: first order, one evaluation per step, no error estimate.

    **References:** L. Euler, *Institutiones calculi integralis* (1768); Hairer, Norsett &
    Wanner, *Solving Ordinary Differential Equations I*, 2nd ed. (1993), Sec. I.7 and II.1.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Euler(),
                        controller=odeckpt.ConstantStep(), dt0=0.001)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _EULER
    name: ClassVar[str] = "euler"
    order: ClassVar[int] = 1
    error_order: ClassVar[int | None] = None
    fn_evals_per_step: ClassVar[int] = _EULER.fn_evals_per_step
    dense_degree: ClassVar[int] = _EULER.dense_degree


class Heun(AbstractExplicitRK):
    """Heun's method (explicit trapezoidal rule): second order, with Euler embedded for a
    first-order error estimate.

    **References:** K. Heun, "Neue Methoden zur approximativen Integration der
    Differentialgleichungen einer unabhangigen Veranderlichen", *Z. Math. Phys.* 45 (1900);
    Hairer, Norsett & Wanner vol. I (1993), Sec. II.1.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Heun(), rtol=1e-4, atol=1e-6)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _HEUN
    name: ClassVar[str] = "heun"
    order: ClassVar[int] = 2
    error_order: ClassVar[int | None] = 1
    fn_evals_per_step: ClassVar[int] = _HEUN.fn_evals_per_step
    dense_degree: ClassVar[int] = _HEUN.dense_degree


class Midpoint(AbstractExplicitRK):
    """The explicit midpoint method (Runge's second-order method); no error estimate.

    **References:** C. Runge, "Uber die numerische Auflosung von Differentialgleichungen",
    *Math. Ann.* 46 (1895); Hairer, Norsett & Wanner vol. I (1993), Sec. II.1.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Midpoint(),
                        controller=odeckpt.ConstantStep(), dt0=0.01)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _MIDPOINT
    name: ClassVar[str] = "midpoint"
    order: ClassVar[int] = 2
    error_order: ClassVar[int | None] = None
    fn_evals_per_step: ClassVar[int] = _MIDPOINT.fn_evals_per_step
    dense_degree: ClassVar[int] = _MIDPOINT.dense_degree


class Ralston(AbstractExplicitRK):
    """Ralston's second-order method (`c_2 = 2/3`, minimising the truncation-error bound);
    no error estimate.

    **References:** A. Ralston, "Runge-Kutta methods with minimum error bounds", *Math. Comp.*
    16 (1962), 431-437.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver=odeckpt.Ralston(),
                        controller=odeckpt.ConstantStep(), dt0=0.01)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _RALSTON
    name: ClassVar[str] = "ralston"
    order: ClassVar[int] = 2
    error_order: ClassVar[int | None] = None
    fn_evals_per_step: ClassVar[int] = _RALSTON.fn_evals_per_step
    dense_degree: ClassVar[int] = _RALSTON.dense_degree


class RK4(AbstractExplicitRK):
    """The classical fourth-order Runge-Kutta method; no error estimate.

    **References:** W. Kutta, "Beitrag zur naherungsweisen Integration totaler
    Differentialgleichungen", *Z. Math. Phys.* 46 (1901); Hairer, Norsett & Wanner vol. I
    (1993), Sec. II.1.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    f = lambda t, y, args: -y
    stepper = odeckpt.RK4()
    y0 = jnp.array([1.0])
    step = stepper.step(f, 0.0, 0.1, y0, None, stepper.init(f, 0.0, y0, None))
    # step.y1 ~ exp(-0.1); step.state == f(0.1, step.y1, None)
    ```
    """

    tableau: ClassVar[ButcherTableau] = _RK4
    name: ClassVar[str] = "rk4"
    order: ClassVar[int] = 4
    error_order: ClassVar[int | None] = None
    fn_evals_per_step: ClassVar[int] = _RK4.fn_evals_per_step
    dense_degree: ClassVar[int] = _RK4.dense_degree
