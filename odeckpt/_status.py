"""Run-time outcomes of a solve."""

import equinox as eqx


class Status(eqx.Enumeration):
    """How a solve ended. `sol.status == Status.successful` tests for success.

    With `solve(..., throw=True)` any other outcome raises at run time with the message below;
    with `throw=False` the partial solution is returned and the status says what happened.
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
    nonfinite_y0 = (
        "The initial state y0 contains NaN or inf. Fix: check how the initial condition is "
        "computed."
    )
    nonfinite = (
        "The state became non-finite (NaN or inf). Fix: check the vector field for divisions by "
        "zero or overflow near this time; with `ConstantStep`, reduce `dt0`; otherwise tighten "
        "the tolerances or use an implicit solver."
    )
