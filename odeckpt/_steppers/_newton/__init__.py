"""Newton's method for the implicit stages of the steppers, one idea per module: the flat field
and the systems it defines (`_system`), the LU linear solvers (`_linear`), the contract of a
Newton method with the stages' implicit-function derivative (`_base`), chord Newton (`_chord`)
and Newton-Krylov (`_krylov`)."""

from ._base import (
    AbstractNewton as AbstractNewton,
    Iteration as Iteration,
    Prepared as Prepared,
    implicit_solution as implicit_solution,
)
from ._chord import Newton as Newton
from ._krylov import NewtonKrylov as NewtonKrylov
from ._linear import (
    lu_solve as lu_solve,
    lu_solver as lu_solver,
    same_step_size as same_step_size,
)
from ._system import (
    AbstractSystem as AbstractSystem,
    FlatField as FlatField,
    Jacobian as Jacobian,
    Stage as Stage,
    exact_jacobian as exact_jacobian,
    no_grad as no_grad,
)
