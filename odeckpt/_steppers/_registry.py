"""Look up a stepper by its lower-case name."""

from ._base import AbstractStepper
from ._bdf import BDF
from ._bosh3 import Bosh3
from ._classic import RK4, Euler, Heun, Midpoint, Ralston
from ._dopri5 import Dopri5
from ._dopri8 import Dopri8
from ._implicit_classic import ImplicitEuler, Trapezoid
from ._kvaerno import Kvaerno3, Kvaerno4, Kvaerno5
from ._radau import Radau5
from ._rosenbrock import Rodas5
from ._tsit5 import Tsit5

STEPPERS: dict[str, type[AbstractStepper]] = {
    cls.name: cls
    for cls in (
        *(Euler, Heun, Midpoint, Ralston, RK4, Bosh3, Tsit5, Dopri5, Dopri8),
        *(ImplicitEuler, Trapezoid, Kvaerno3, Kvaerno4, Kvaerno5, Rodas5, Radau5, BDF),
    )
}
"""Every built-in stepper class, keyed by its `name`."""


def stepper_from_name(name: str) -> AbstractStepper:
    """The built-in stepper called `name` (case-insensitive).

    **Arguments:**

    - `name`: e.g. `"tsit5"` or `"Dopri5"`.

    **Returns:** an instance of the stepper class.

    Raises `ValueError`, listing the valid names, if there is no such stepper.

    **Example:**

    ```python
    from odeckpt._steppers import stepper_from_name

    stepper = stepper_from_name("Tsit5")  # Tsit5()
    ```
    """
    try:
        cls = STEPPERS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(
            f"Unknown stepper {name!r}; valid names are: {', '.join(sorted(STEPPERS))}."
        ) from None
    return cls()
