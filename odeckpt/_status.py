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
    nonfinite = (
        "The state became non-finite (NaN or inf). Fix: check the vector field for divisions by "
        "zero or overflow near this time; with `ConstantStep`, reduce `dt0`; otherwise tighten "
        "the tolerances or use an implicit solver."
    )
