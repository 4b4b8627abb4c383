"""Run-time outcomes of a solve."""

from collections.abc import Mapping

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
import wadler_lindig as wl
from jaxtyping import Array, ArrayLike, Bool, Int

from ._errors import branched_error_if


class _Outcome:
    """One named outcome of `Status`, declared with its cause and its fix (empty for success):
    `Status.<name>` reads it as a `Status`. Its number is its order among the outcomes."""

    def __init__(self, cause: str = "", fix: str = ""):
        self.cause = cause
        self.fix = fix

    @property
    def message(self) -> str:
        """The cause and the fix, as one text (`""` for success)."""
        return f"{self.cause} Fix: {self.fix}" if self.cause else ""

    def __set_name__(self, owner: type, name: str):
        self.name = name

    def __get__(self, status, owner: "type[Status] | None" = None) -> "Status":
        assert owner is not None  # Python passes the class the outcome is read from
        return owner(np.array(_outcomes(owner).index(self.name), dtype=np.int32))


def _outcomes(owner: type) -> list[str]:
    return [name for name, value in vars(owner).items() if isinstance(value, _Outcome)]


class Status(eqx.Module):
    """How a solve ended. `sol.status == Status.successful` tests for success.

    With `solve(..., throw=True)` any other outcome raises with the message below, fitted to
    the solve (its fix to the stepper in use and, outside `jit`, saying where the solve
    stopped); with `throw=False` the partial solution is returned and the status says what
    happened (`sol.status.message`). A status prints as its name (`Status.successful`), an
    array of them (under `vmap`) as their names, and a traced one as `Status(traced)`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), max_steps=2, throw=False)
    ran_out = sol.status == odeckpt.Status.max_steps_reached  # a bool array: True here
    print(sol.status)  # Status.max_steps_reached
    ```
    """

    _value: Int[Array | np.ndarray, "..."]

    successful = _Outcome()
    max_steps_reached = _Outcome(
        "The maximum number of steps was reached before the end of the time span.",
        "raise `max_steps=` in `odeckpt.solve`, or loosen `rtol`/`atol`; if the stepper is "
        "explicit and the problem stiff (many tiny steps), use an implicit one "
        "(`solver=odeckpt.Radau5()`).",
    )
    dt_underflow = _Outcome(
        "The step size fell below its minimum (`dtmin`, or machine precision relative to t), "
        "or t is too large for the step size: the times near t are too far apart to resolve "
        "it (a `ConstantStep` step would be rounded by more than 1%).",
        "with an explicit stepper the problem is probably stiff (use an implicit one, "
        "`solver=odeckpt.Radau5()`); with an implicit one, the solution probably blows up or "
        "the vector field is singular near this time (check `f` there, and a user `jac=`). "
        "Lower `PIDController(dtmin=...)` or loosen the tolerances. At large |t| (or float32 "
        "times), shift time so that the span starts at 0 (solve over (0, t1 - t0) with `f` "
        "reading `t + t0`), solve in float64, or use a larger `dt0`.",
    )
    newton_failed = _Outcome(
        "The Newton iteration of an implicit solver did not converge, even with a fresh "
        "Jacobian and the step size shrunk to its minimum (or with `ConstantStep`, which cannot "
        "shrink it).",
        "check that a user `jac=` matches the vector field; with `ConstantStep`, reduce `dt0`; "
        "otherwise loosen rtol/atol, raise `Newton(max_iters=...)`, or try "
        "`solver=odeckpt.Rodas5()` (no Newton iteration).",
    )
    nonfinite_y0 = _Outcome(
        "The initial state y0 contains NaN or inf.",
        "check how the initial condition is computed.",
    )
    nonfinite_f0 = _Outcome(
        "The vector field is NaN or inf at the initial point: f(t0, y0, args) is not finite.",
        "check `args` for NaN or inf parameters, and the vector field at t0 for divisions by "
        "zero, logarithms or square roots of non-positive values, or overflow.",
    )
    nonfinite = _Outcome(
        "A step produced non-finite values (NaN or inf: in the vector field's values, the "
        "error estimate or the new state) and shortening it did not avoid them.",
        "check the vector field near this time for divisions by zero, square roots or "
        "logarithms of negative values (a solution that crosses the edge of the field's domain) "
        "or overflow (a solution that blows up); with `ConstantStep`, reduce `dt0`.",
    )
    max_jumps_reached = _Outcome(
        "An event with `update=` fired more often than its `max_jumps` allows (a Zeno "
        "system jumps ever more often, e.g. a bouncing ball coming to rest).",
        "raise `Event(max_jumps=...)`, shorten the span, or add a terminal event that stops the "
        "solve before the jumps accumulate.",
    )
    nonfinite_event = _Outcome(
        "An event's fn returned NaN or inf, so whether it fired cannot be told.",
        "check the event function (and `args`) for divisions by zero, square roots or "
        "logarithms of negative values along the solution.",
    )
    invalid_settings = _Outcome(
        "A tolerance or step-size controller setting given as a traced value is invalid: "
        "`rtol`, `atol`, `dtmin` and `dtmax` must be positive and finite, the PID gains finite, "
        "0 < factormin < 1 < factormax, 0 < safety <= 1 and dtmin <= dtmax.",
        "check how the traced value is computed (NaN, zero or negative).",
    )
    invalid_inputs = _Outcome(
        "An input given as a traced value is invalid: t0 or t1 is NaN or inf, dt0 is not "
        "finite, zero or points away from t1, SaveAt(ts=...) is not sorted in the direction of "
        "integration within [t0, t1], or jump_ts holds NaN or inf.",
        "check how these values are computed (with throw=True the error names the input).",
    )

    inconsistent_initial_values = _Outcome(
        "The initial values (or the state after an event's jump or at a time of `jump_ts`) do "
        "not satisfy the algebraic "
        "equations of the DAE `M y' = f` to the tolerances, and Newton's method on the "
        "algebraic variables did not find values that do (or, with "
        "`MassMatrix(initial='check')`, the given ones violate them).",
        "give algebraic components of y0 closer to a solution of the algebraic equations (or "
        "use `MassMatrix(initial='solve')`, the default, to solve for them); check the "
        "algebraic equations of `f` at t0 (a constraint that no state satisfies, or the wrong "
        "rows of `M` left zero).",
    )
    dae_index = _Outcome(
        "The algebraic equations of the DAE do not determine its algebraic variables: their "
        "Jacobian in those variables (`Q^T df/dy P`, with `P` spanning the null space of `M` "
        "and `Q` that of `M^T`) is singular, so the DAE is not of index 1 (an index-2 or "
        "higher problem, e.g. a constraint that does not involve the variable it should "
        "determine).",
        "reduce the index (differentiate the constraint until it involves the algebraic "
        "variable, as for the velocity form of a pendulum's constraint), or check that the "
        "zero rows and columns of `M` mark exactly the algebraic equations and variables.",
    )

    @classmethod
    def where(cls, pred: Bool[ArrayLike, "..."], a: "Status", b: "Status") -> "Status":
        """`a` where `pred` holds, else `b` (elementwise, as `jnp.where`)."""
        if a._value is b._value:
            return a
        return cls(jnp.where(pred, a._value, b._value))

    @classmethod
    def names(cls) -> list[str]:
        """The name of every outcome, in the order of their numbers."""
        return _outcomes(cls)

    @classmethod
    def messages(cls) -> list[str]:
        """The message of every outcome, in the order of their numbers."""
        return [cls.outcome(name).message for name in _outcomes(cls)]

    @classmethod
    def outcome(cls, name: str) -> _Outcome:
        """The outcome called `name`, with its `cause`, its `fix` and its `message` (the two
        together)."""
        return vars(cls)[name]

    def __eq__(self, other) -> Bool[Array, "..."]:  # pyright: ignore[reportIncompatibleMethodOverride]
        with jax.ensure_compile_time_eval():
            return jnp.asarray(self._value == _value_of(other))

    def __ne__(self, other) -> Bool[Array, "..."]:  # pyright: ignore[reportIncompatibleMethodOverride]
        with jax.ensure_compile_time_eval():
            return jnp.asarray(self._value != _value_of(other))

    def __bool__(self) -> bool:
        raise TypeError(
            "A Status has no truth value: every status, a failure too, would read as true. Fix: "
            "`sol.status == odeckpt.Status.successful` (an array under `vmap`), or "
            "`sol.status.name == 'successful'` for one known status."
        )

    @property
    def message(self) -> str:
        """What this outcome means and how to fix it (`""` for `successful`; for an array of
        statuses, the messages joined by name)."""
        names = self._names()
        if names is None:
            return "traced"
        messages = dict(zip(_outcomes(type(self)), type(self).messages(), strict=True))
        distinct = dict.fromkeys(np.ravel(names))
        if np.ndim(names) == 0:
            return messages[str(names)]
        return "\n".join(f"{name}: {messages[name]}" for name in distinct if messages[name])

    @property
    def name(self) -> str:
        """The name of this outcome (`"successful"`, ...), for one status known before run
        time; a `ValueError` for an array of statuses or a traced one."""
        names = self._names()
        if not isinstance(names, str):
            raise ValueError(f"{self!r} is not one known status. Fix: read `.name` of one.")
        return names

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of an array of statuses (`()` for one)."""
        return tuple(np.shape(self._value))

    def __getitem__(self, index) -> "Status":
        """The status (or statuses) at `index` of an array of them (one per lane under
        `vmap`, one per trajectory of an ensemble)."""
        return type(self)(self._value[index])

    def error_if(self, token, pred, *, messages: Mapping[str, str] | None = None):
        """`token`, raising at run time with this status's message if `pred` holds.

        **Arguments:**

        - `token`: a pytree holding at least one array, returned unchanged.
        - `pred`: whether to raise.
        - `messages`: the message of each outcome it names (by name), in place of its own.

        **Returns:**

        `token`.
        """
        messages = messages or {}
        texts = [
            messages.get(name, message)
            for name, message in zip(_outcomes(type(self)), type(self).messages(), strict=True)
        ]
        return branched_error_if(token, pred, self._value, texts)

    def is_traced(self) -> bool:
        """Whether this status is only known at run time."""
        return isinstance(self._value, jax.core.Tracer)

    def _names(self):
        """The name of each outcome (a str, or a NumPy array of them), or `None` if traced."""
        concrete = isinstance(self._value, np.ndarray | np.generic | jax.Array)
        if self.is_traced() or not concrete:
            return None  # (an abstract value, e.g. a shape and dtype, prints as traced too)
        names = np.array(_outcomes(type(self)), dtype=object)
        value = names[np.asarray(self._value)]
        return str(value) if np.ndim(value) == 0 else value

    def __repr__(self) -> str:
        names = self._names()
        if names is None:
            return "Status(traced)"
        if isinstance(names, str):
            return f"Status.{names}"
        return f"Status({np.array2string(names, separator=', ', formatter={'all': str})})"

    def __pdoc__(self, **kwargs):
        del kwargs
        return wl.TextDoc(repr(self))


def _value_of(other) -> Array | np.ndarray:
    if not isinstance(other, Status):
        raise ValueError(
            f"A Status can only be compared with a Status, got {other!r}. Fix: compare with "
            "e.g. `odeckpt.Status.successful`."
        )
    return other._value
