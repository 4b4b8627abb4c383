"""The interface between a stepper and the integration loop."""

import abc

import equinox as eqx

from .._types import Args, Scalar, VectorField, Y


class Step(eqx.Module):
    """What one attempted step from `t0` to `t1` produces.

    **Fields:**

    - `y1`: the solution at `t1`.
    - `y_error`: the embedded local error estimate (same structure as `y1`), or `None` for a
        method without an embedded pair.
    - `dense`: the step's continuous extension as polynomial coefficients in
        `theta = (t - t0) / (t1 - t0)`: a pytree like `y1` whose leaves have a leading axis of
        length `degree + 1`, lowest power first, so `y(theta) = sum_j dense[j] * theta**j`.
    - `state`: the stepper state to carry to the next step if this one is accepted (for every
        explicit stepper: `f(t1, y1, args)`, which is the next step's first stage).
    """

    y1: Y
    y_error: Y | None
    dense: Y
    state: Y


class AbstractStepper(eqx.Module):
    """A one-step method. Concrete steppers are final modules with no fields of their own beyond
    configuration, so they can be passed through `jit` as static data.
    """

    name: eqx.AbstractClassVar[str]
    """Lower-case name accepted by `solve(solver=...)`."""
    order: eqx.AbstractClassVar[int]
    """Classical order of the propagated solution."""
    error_order: eqx.AbstractClassVar[int | None]
    """Order of the embedded method used for the error estimate; `None` if there is none (only
    constant step sizes are then possible)."""
    fn_evals_per_step: eqx.AbstractClassVar[int]
    """Evaluations of `f` per attempted step, with the first stage supplied by `state`."""
    dense_degree: eqx.AbstractClassVar[int]
    """Degree of the continuous extension returned in `Step.dense`."""

    @abc.abstractmethod
    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> Y:
        """The stepper state at the initial point (for explicit steppers `f(t0, y0, args)`)."""

    @abc.abstractmethod
    def step(self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: Y) -> Step:
        """Attempt one step from `(t0, y0)` to `t1`; `t1 < t0` integrates backwards."""
