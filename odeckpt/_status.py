"""Run-time outcomes of a solve."""

import equinox as eqx


class Status(eqx.Enumeration):
    """How a solve ended. `sol.status == Status.successful` tests for success.

    With `solve(..., throw=True)` any other outcome raises at run time with the message below;
    with `throw=False` the partial solution is returned and the status says what happened.

    **Example:**

    ```python
    sol = odeckpt.solve(f, y0, (0.0, 1.0), max_steps=2, throw=False)
    ran_out = sol.status == odeckpt.Status.max_steps_reached  # a bool array: True here
    ```
    """

    successful = ""
    max_steps_reached = (
        "The maximum number of steps was reached before the end of the time span. Fix: raise "
        "`max_steps=` in `odeckpt.solve`, loosen `rtol`/`atol`, or use an implicit solver if the "
        "problem is stiff."
    )
    dt_underflow = (
        "The step size fell below its minimum (`dtmin`, or machine precision relative to t). "
        "Fix: the problem is probably stiff (use an implicit solver) or singular near this time; "
        "lower `PIDController(dtmin=...)` or loosen the tolerances."
    )
    newton_failed = (
        "The Newton iteration of an implicit solver did not converge, even with a fresh "
        "Jacobian and the step size shrunk to its minimum (or with `ConstantStep`, which cannot "
        "shrink it). Fix: check that a user `jac=` matches the vector field; with "
        "`ConstantStep`, reduce `dt0`; otherwise loosen rtol/atol, raise "
        "`Newton(max_iters=...)`, or try `solver=odeckpt.Rodas5()` (no Newton iteration)."
    )
    nonfinite_y0 = (
        "The initial state y0 contains NaN or inf. Fix: check how the initial condition is "
        "computed."
    )
    nonfinite_f0 = (
        "The vector field is NaN or inf at the initial point: f(t0, y0, args) is not finite. "
        "Fix: check `args` for NaN or inf parameters, and the vector field at t0 for divisions "
        "by zero, logarithms or square roots of non-positive values, or overflow."
    )
    nonfinite = (
        "A step produced non-finite values (NaN or inf: in the vector field's values, the "
        "error estimate or the new state) and shortening it did not avoid them. Fix: check "
        "the vector field near this time for divisions by zero, square roots or logarithms of "
        "negative values (a solution that crosses the edge of the field's domain) or overflow "
        "(a solution that blows up); with `ConstantStep`, reduce `dt0`."
    )
    max_jumps_reached = (
        "An event with `update=` fired more often than its `max_jumps` allows (a Zeno "
        "system jumps ever more often, e.g. a bouncing ball coming to rest). Fix: raise "
        "`Event(max_jumps=...)`, shorten the span, or add a terminal event that stops the solve "
        "before the jumps accumulate."
    )
    nonfinite_event = (
        "An event's fn returned NaN or inf, so whether it fired cannot be told. Fix: check "
        "the event function (and `args`) for divisions by zero, square roots or logarithms of "
        "negative values along the solution."
    )
