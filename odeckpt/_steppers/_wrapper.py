"""Steppers built on another stepper."""

# The class variables of `AbstractStepper` are read from the wrapped stepper here, through
# properties (which equinox accepts), not assigned: pyright sees a property assigned to a `str`.
# pyright: reportAssignmentType=false

import equinox as eqx

from ._base import AbstractStepper


class AbstractWrapper(AbstractStepper):
    """A stepper that advances another system with the method of `stepper` (the state with its
    sensitivities, an adjoint whose error is measured by a seminorm): it has `stepper`'s class
    variables (orders, costs, the tolerances its steps are held to, its capabilities), read
    from it. A subclass implements `init` and `step`, and the state hooks its state needs."""

    stepper: eqx.AbstractVar[AbstractStepper]

    name = property(lambda self: self.stepper.name)
    order = property(lambda self: self.stepper.order)
    error_order = property(lambda self: self.stepper.error_order)
    fn_evals_per_step = property(lambda self: self.stepper.fn_evals_per_step)
    dense_degree = property(lambda self: self.stepper.dense_degree)
    implicit = property(lambda self: self.stepper.implicit)
    multistep = property(lambda self: self.stepper.multistep)
    # The wrapped system's steps are held to the tolerances `stepper` holds its own steps to.
    tolerance_exponent = property(lambda self: self.stepper.tolerance_exponent)
    tolerance_reference = property(lambda self: self.stepper.tolerance_reference)
