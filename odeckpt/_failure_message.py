"""The message a failed solve raises with: its status's cause, where the solve stopped (when that
is known, outside `jit`), a fix that fits the stepper and controller in use, notes on what the
inputs are, and, for an error raised inside a traced program, the line that called `solve`."""

import dataclasses
import inspect
import os
from collections.abc import Mapping

import equinox as eqx
import jax

from ._loop import AbstractController
from ._status import Status
from ._steppers import AbstractStepper


@dataclasses.dataclass(frozen=True)
class Stop:
    """Where a failed solve stopped: at time `t` of the span from `t0` to `t1`, after
    `num_steps` attempted steps, `num_rejected` of them rejected."""

    t: float
    t0: float
    t1: float
    num_steps: int
    num_rejected: int

    def sentence(self) -> str:
        """The stop, said in one sentence."""
        return (
            f" The solve stopped at t={self.t:.6g} of [{self.t0:g}, {self.t1:g}] after "
            f"{self.num_steps} steps ({self.num_rejected} of them rejected)."
        )


@dataclasses.dataclass(frozen=True)
class Failure:
    """What a solve's failure message says beyond its status: the `stepper` and `controller` in
    use, its `max_steps`, and `notes` appended to the messages of the outcomes they name."""

    stepper: AbstractStepper
    controller: AbstractController
    max_steps: int
    notes: Mapping[str, str]

    def message(self, name: str, stop: Stop | None = None, call_site: str = "") -> str:
        """The message of the outcome called `name`, saying where the solve stopped (`stop`,
        known outside `jit`) and naming the `call_site` of `solve` (for errors raised inside a
        traced program, whose traceback may be another call's)."""
        outcome = Status.outcome(name)
        if stop is not None:
            where = stop.sentence()
        elif name == "max_steps_reached":
            where = (
                " (Inside `jit`, or differentiated in the span's ends, this message cannot "
                "say where the solve stopped: with `throw=False` and `SaveAt(t1=True)`, "
                "`sol.ts[-1]` is that time.)"
            )
        else:
            where = ""
        fix = self._max_steps_fix() if name == "max_steps_reached" else outcome.fix
        site = f" (Raised by the `odeckpt.solve` called at {call_site}.)" if call_site else ""
        return f"{outcome.cause}{where} Fix: {fix}{self.notes.get(name, '')}{site}"

    def messages(self, call_site: str) -> dict[str, str]:
        """The message of every outcome but success, for an error raised at run time by the
        `solve` called at `call_site`."""
        return {
            name: self.message(name, call_site=call_site)
            for name in Status.names()
            if name != "successful"
        }

    def _max_steps_fix(self) -> str:
        """What to do when the steps ran out, for the stepper and controller in use."""
        more = f"`max_steps={4 * self.max_steps}`"
        name = type(self.stepper).__name__
        if self.controller.fixed_steps:
            return (
                "the constant steps of `dt0` need more than max_steps="
                f"{self.max_steps} steps to cover the span: raise `max_steps=` to "
                "|t1 - t0| / dt0 or more, or take a larger `dt0`."
            )
        if self.stepper.implicit:
            return (
                f"raise `max_steps=` (e.g. {more}: a long span at tight tolerances takes many "
                f"steps) or loosen `rtol`/`atol`. {name} is implicit already, made for stiff "
                "problems: if its steps shrank where the solve stopped, the solution may blow "
                "up or the vector field be singular there; check `f` near that time (and a user "
                "`jac=`)."
            )
        return (
            f"{name} is explicit: if the problem is stiff (many tiny steps, often rejected), "
            "use an implicit stepper, `solver=odeckpt.Radau5()` (or `odeckpt.BDF()` for large "
            f"systems); otherwise raise `max_steps=` (e.g. {more}) or loosen `rtol`/`atol`."
        )


# Frames of these packages are not the user's call.
_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (__file__, jax.__file__, eqx.__file__)
)


def call_site() -> str:
    """Where the user's code called into odeckpt, as `file:line, in function`: the nearest
    frame up the stack outside odeckpt, JAX and equinox (`""` if there is none)."""
    frame = inspect.currentframe()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}, in `{frame.f_code.co_name}`"
