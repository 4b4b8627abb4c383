"""The interface between a stepper and the integration loop."""

import abc
from typing import TYPE_CHECKING, ClassVar

import equinox as eqx

from .._error_norm import TOLERANCE_REFERENCE
from .._types import Args, BoolScalar, IntScalar, Scalar, VectorField, Y

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar

    from ._mass import Consistency
else:
    from equinox import AbstractClassVar


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
    - `state_on_reject`: the stepper state to carry if this step is rejected; `None` keeps the
        state from before the step. (Implicit steppers keep a Jacobian evaluated in a rejected
        attempt.)
    - `failed`: whether the step could not be computed (an implicit stepper's Newton iteration
        did not converge); `None` for steppers that cannot fail. A failed step is rejected and
        retried with a shorter step (see `AbstractController.reject`).
    - `nonfinite`: whether the step met NaN or inf that none of `y1`, `y_error` and `state`
        shows (an implicit stage's Newton iteration stopped on them, returning its finite
        guess); `None` for steppers whose every value reaches those. Such a step is rejected
        as non-finite.
    - `num_jacobian_evals`, `num_lu_factorisations`: the work of this attempt, summed into
        `Stats` (0 for explicit steppers).
    - `num_fn_evals`: the evaluations of `f` in this attempt, summed into `Stats`; `None`
        means the stepper's `fn_evals_per_step` (implicit steppers count their Newton
        iterations).
    - `dt_factor`: the stepper's own proposal for the ratio of the next step size to this
        one, for a stepper whose step-size rule needs more than the error estimate (`Radau5`'s
        predictive controller uses the previous step; `BDF` chooses its order and step size
        together); an adaptive controller follows it within its bounds instead of its own
        rule. `None` (every other stepper) leaves the choice to the controller.
    """

    y1: Y
    y_error: Y | None
    dense: Y
    state: Y
    state_on_reject: Y | None = None
    failed: BoolScalar | None = None
    nonfinite: BoolScalar | None = None
    num_jacobian_evals: IntScalar | int = 0
    num_lu_factorisations: IntScalar | int = 0
    num_fn_evals: IntScalar | int | None = None
    dt_factor: Scalar | None = None


class AbstractStepper(eqx.Module):
    """A one-step method. Concrete steppers are final modules with no fields of their own beyond
    configuration, so they can be passed through `jit` as static data.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    stepper: odeckpt.AbstractStepper = odeckpt.Tsit5()
    state = stepper.init(f, 0.0, y0, None)
    step = stepper.step(f, 0.0, 0.1, y0, None, state)  # step.y1, step.y_error, step.state
    ```
    """

    name: AbstractClassVar[str]
    """Lower-case name accepted by `solve(solver=...)`."""
    order: AbstractClassVar[int]
    """Classical order of the propagated solution."""
    error_order: AbstractClassVar[int | None]
    """Order of the embedded method used for the error estimate; `None` if there is none (only
    constant step sizes are then possible)."""
    fn_evals_per_step: AbstractClassVar[int]
    """Evaluations of `f` per attempted step, with the first stage supplied by `state` (for an
    implicit stepper: with one Newton iteration per stage; its `Step.num_fn_evals` gives the
    real count)."""
    dense_degree: AbstractClassVar[int]
    """Degree of the continuous extension returned in `Step.dense`."""
    implicit: AbstractClassVar[bool]
    """Whether the stages are solved with the Jacobian of `f` (Newton, or a Rosenbrock method's
    linear solves): a method for stiff problems. The continuous adjoints then read the forward
    state from forward re-solves rather than integrating it backwards (unstable on stiff
    problems)."""
    multistep: AbstractClassVar[bool]
    """Whether a step depends on a history of earlier steps carried in the stepper state (then
    the stepper says which part of its state is differentiable: `differentiable_state`)."""
    state_is_derivative: ClassVar[bool] = False
    """Whether the stepper state is just `f(t, y, args)` at the current point (as `init`
    returns it), so a checkpoint may drop it and recompute it on restore."""
    tolerance_exponent: ClassVar[float] = 1.0
    """The exponent `e` with which the solve's tolerances become those its steps are held to:
    `rtol' = r0 (rtol / r0) ** e` with `r0 = tolerance_reference`, and `atol` scaled alike
    (`odeckpt._error_norm.effective_tolerances`), so that the error at the end of a solve
    falls by about one decade per decade of `rtol`. Above 1 for a stepper whose error per
    step, held at the tolerance, adds up to a global error that shrinks more slowly than the
    tolerance; below 1 for one whose global error shrinks faster."""
    tolerance_reference: ClassVar[float] = TOLERANCE_REFERENCE
    """The `rtol` at which the steps are held to the solve's tolerances whatever
    `tolerance_exponent`."""

    @abc.abstractmethod
    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> Y:
        """The stepper state at the initial point (for explicit steppers `f(t0, y0, args)`)."""

    @abc.abstractmethod
    def step(self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: Y) -> Step:
        """Attempt one step from `(t0, y0)` to `t1`; `t1 < t0` integrates backwards."""

    def pack_state(self, state: Y) -> Y | None:
        """What a checkpoint keeps of the stepper state: nothing if it is `f(t, y, args)`."""
        return None if self.state_is_derivative else state

    def unpack_state(self, f: VectorField, t: Scalar, y: Y, args: Args, packed: Y | None) -> Y:
        """The stepper state at `(t, y)` from what `pack_state` kept."""
        return self.init(f, t, y, args) if self.state_is_derivative else packed

    def derivative(self, state: Y) -> Y:
        """`f(t, y, args)` at the point the stepper state belongs to; the default: the state is
        that derivative itself (every explicit stepper)."""
        return state

    def differentiable_state(self, state: Y) -> Y:
        """The part of `state` that a step depends on differentiably, beyond `(y, args)`:
        what forward sensitivities differentiate a step with respect to, and carry a tangent
        of from step to step. The default, for a one-step method: `derivative(state)` (a
        starting guess or a cache is not part of it); a multistep method adds its history and
        must say so."""
        self._one_step("differentiable_state")
        return self.derivative(state)

    def with_differentiable_state(self, state: Y, part: Y) -> Y:
        """`state` with its `differentiable_state` replaced by `part`; `derivative` of the
        result is read from `part` alone. The default, for a one-step method whose state is
        that derivative itself: `part`."""
        self._one_step("with_differentiable_state")
        del state
        return part

    def _one_step(self, hook: str) -> None:
        if self.multistep:
            raise NotImplementedError(
                f"{type(self).__name__} is a multistep method (`multistep = True`), so the "
                f"one-step default of `{hook}` would drop its history. Fix: implement "
                "`differentiable_state` and `with_differentiable_state` for its state."
            )

    @property
    def has_mass_matrix(self) -> bool:
        """Whether this stepper solves `M y' = f` with a mass matrix (set by `odeckpt.solve`)."""
        return False

    def consistent(
        self, f: VectorField, t: Scalar, y: Y, args: Args
    ) -> tuple[Y, "Consistency | None"]:
        """`y` made consistent with the algebraic equations of a DAE `M y' = f` (with how it
        went), for a stepper given a singular mass matrix; the default (an ODE): `y` itself and
        `None`."""
        del f, t, args
        return y, None

    def slope(self, f: VectorField, t: Scalar, y: Y, args: Args, state: Y | None = None) -> Y:
        """`dy/dt` of the solution through `(t, y)`: `f(t, y, args)` for an ODE (read from the
        stepper `state` at that point when given), the slope that keeps a DAE's algebraic
        equations for a stepper given a mass matrix."""
        return f(t, y, args) if state is None else self.derivative(state)

    def with_fresh_jacobian(self, state: Y) -> Y:
        """`state`, asking for a Jacobian at the next attempt (for a stepper that reuses one;
        the default: unchanged)."""
        return state
