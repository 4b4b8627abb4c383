"""Explicit, implicit (ESDIRK) and Rosenbrock steppers (private; the public names live in
`odeckpt`)."""

from ._base import AbstractStepper as AbstractStepper, Step as Step
from ._bdf import BDF as BDF, BDFCoefficients as BDFCoefficients, BDFState as BDFState
from ._bosh3 import Bosh3 as Bosh3
from ._classic import (
    RK4 as RK4,
    Euler as Euler,
    Heun as Heun,
    Midpoint as Midpoint,
    Ralston as Ralston,
)
from ._dopri5 import Dopri5 as Dopri5
from ._dopri8 import Dopri8 as Dopri8
from ._esdirk import AbstractESDIRK as AbstractESDIRK, ImplicitState as ImplicitState
from ._explicit_rk import AbstractExplicitRK as AbstractExplicitRK
from ._implicit import (
    AbstractImplicit as AbstractImplicit,
    AbstractProposer as AbstractProposer,
    map_jac as map_jac,
    newton_rtol as newton_rtol,
    with_newton_tolerances as with_newton_tolerances,
    with_staggered_tangents as with_staggered_tangents,
)
from ._implicit_classic import ImplicitEuler as ImplicitEuler, Trapezoid as Trapezoid
from ._implicit_tableau import ESDIRKTableau as ESDIRKTableau
from ._kvaerno import Kvaerno3 as Kvaerno3, Kvaerno4 as Kvaerno4, Kvaerno5 as Kvaerno5
from ._mass import (
    AbstractMassMatrix as AbstractMassMatrix,
    Consistency as Consistency,
    FlatMass as FlatMass,
)
from ._newton import (
    AbstractNewton as AbstractNewton,
    Newton as Newton,
    NewtonKrylov as NewtonKrylov,
)
from ._radau import Radau5 as Radau5, RadauState as RadauState
from ._radau_tableau import CollocationTableau as CollocationTableau
from ._registry import STEPPERS as STEPPERS, stepper_from_name as stepper_from_name
from ._reversible import Reversible as Reversible, ReversibleState as ReversibleState
from ._rosenbrock import (
    AbstractRosenbrock as AbstractRosenbrock,
    Rodas5 as Rodas5,
    RosenbrockTableau as RosenbrockTableau,
)
from ._tableau import ButcherTableau as ButcherTableau
from ._tsit5 import Tsit5 as Tsit5
from ._wrapper import AbstractWrapper as AbstractWrapper
