"""What the integration loop carries from step to step, and the record of each step's decisions."""

from typing import ClassVar, overload

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Int

from .._autodiff import stack
from .._status import Status
from .._types import IntScalar, Scalar, Y
from ._events import EventState


class _Counter:
    """A named entry of `LoopState.counts`: declared once, read as an attribute, and set by
    name in `LoopState.increments`. Its position is its order among the counters."""

    def __init__(self, doc: str):
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str):
        self.name = name

    @overload
    def __get__(self, state: None, owner: type | None = None) -> "_Counter": ...
    @overload
    def __get__(self, state: "LoopState", owner: type | None = None) -> IntScalar: ...
    def __get__(
        self, state: "LoopState | None", owner: type | None = None
    ) -> "_Counter | IntScalar":
        if state is None:
            return self
        return state.counts[counters(type(state)).index(self.name)]


def counters(owner: type) -> tuple[str, ...]:
    """The names of the counters of `owner`, in order."""
    return tuple(name for name, v in vars(owner).items() if isinstance(v, _Counter))


class LoopState(eqx.Module):
    """What the loop carries from step to step (and all that a checkpoint must hold).

    **Fields:** the time `t`, the state `y`, the step size `dt` to try next, the stepper's and
    the controller's states, the integer `counts` and the `status`.
    """

    t: Scalar
    y: Y
    dt: Scalar
    stepper_state: Y
    controller_state: Y
    counts: Int[Array, " counters"]
    """The integer bookkeeping, read through the counters below: one vector, which XLA
    updates with one kernel per step instead of one per counter."""
    status: Status
    events: EventState | None = None
    """What the loop carries for its events (`None` when the solve has none)."""

    save_index = _Counter("How many (distinct) save times have been written.")
    num_steps = _Counter("Steps attempted.")
    num_accepted = _Counter("Steps accepted.")
    num_rejected = _Counter("Steps rejected.")
    num_jacobian_evals = _Counter("Jacobian evaluations of an implicit stepper.")
    num_lu_factorisations = _Counter("LU factorisations of an implicit stepper.")
    num_fn_evals = _Counter("Vector-field evaluations in the steps.")

    @classmethod
    def increments(cls, **values) -> Int[Array, " counters"]:
        """A vector to add to `counts`, from values given by counter name (others 0)."""
        names = counters(cls)
        unknown = set(values) - set(names)
        if unknown:
            raise TypeError(f"unknown counters {sorted(unknown)}; the counters are {names}")
        return stack([jnp.asarray(values.get(n, 0)).astype(jnp.int32) for n in names])


class StepRecord(eqx.Module):
    """The discrete decisions of one attempted step (see `IntegrationLoop.step`). The
    checkpointing engine keeps up to `2**20` of them, so the verdict and the clipping share one
    byte: bits 0-1 the verdict, bit 2 `clipped`, bit 3 whether an event fired in it."""

    rejected: ClassVar[int] = 0
    accepted: ClassVar[int] = 1
    newton_failed: ClassVar[int] = 2
    nonfinite: ClassVar[int] = 3

    code: Array
    """`uint8`: `verdict + 4 * clipped + 8 * event`."""
    next_dt: Scalar
    """The step size proposed for the next step. Step sizes are not differentiated, and an
    error estimate at its rounding-noise floor can propose visibly different ones when the
    recomputation rounds differently."""

    @classmethod
    def make(
        cls, verdict: Array, clipped: Array, next_dt: Scalar, event: Array | None = None
    ) -> "StepRecord":
        code = verdict.astype(jnp.uint8) + 4 * clipped.astype(jnp.uint8)
        if event is not None:
            code = code + 8 * event.astype(jnp.uint8)
        return cls(code, next_dt)

    @property
    def verdict(self) -> Array:
        """`accepted`, `rejected` (error too large), `newton_failed` (an implicit stage did not
        converge) or `nonfinite` (a stage, the error estimate or the new state is NaN or
        inf)."""
        return self.code & 3

    @property
    def clipped(self) -> Array:
        """Whether the step was shortened to land on the end of the span or a save time."""
        return (self.code & 4) != 0

    @property
    def event(self) -> Array:
        """Whether an event fired in the step (it then ends at the event)."""
        return (self.code & 8) != 0


def failure_status(verdict: Array) -> Status:
    """How the solve ends when a step with this `StepRecord` verdict cannot be shortened."""
    status = Status.where(verdict == StepRecord.nonfinite, Status.nonfinite, Status.dt_underflow)
    return Status.where(verdict == StepRecord.newton_failed, Status.newton_failed, status)
