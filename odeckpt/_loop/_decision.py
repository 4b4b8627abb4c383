"""A step-size controller's verdict on an attempted step, and the check of its contract."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .._types import BoolScalar, Scalar, Y


class Decision(eqx.Module):
    """A controller's verdict on an attempted step.

    **Fields:**

    - `accept`: whether the step is accepted.
    - `next_dt`: the step size to take next (positive).
    - `state`: the controller state to carry.
    - `underflow`: `next_dt` fell below the smallest step size (or is NaN): the solve cannot go
        on.
    - `finite`: the error estimate was finite (a NaN or inf error is never accepted).

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    # What a controller's `judge` or `reject` returns: here, reject and halve a step of 0.1.
    true = jnp.array(True)
    decision = odeckpt.Decision(accept=~true, next_dt=jnp.array(0.05), state=None,
                                underflow=~true, finite=true)
    ```
    """

    accept: BoolScalar
    next_dt: Scalar
    state: Y
    underflow: BoolScalar
    finite: BoolScalar


def checked_decision(decision, controller, dtype, state: Y) -> Decision:
    """`decision`, as `controller` returned it, with its flags as boolean arrays; raises at
    trace time, naming the field and the fix, if it breaks the contract of `Decision` (a user's
    `judge`, `adapt` or `reject`)."""
    name = type(controller).__name__
    fix = (
        "Fix: return `odeckpt.Decision(accept, next_dt, state, underflow, finite)` with "
        "booleans, `next_dt` of the times' dtype (`jnp.asarray(next_dt, t0.dtype)`) and the "
        "controller state as `init` returned it."
    )
    if not isinstance(decision, Decision):
        raise TypeError(f"{name} returned a {type(decision).__name__}, not a Decision. {fix}")
    flags = {}
    for field in ("accept", "underflow", "finite"):
        value = getattr(decision, field)
        value = None if value is None else jnp.asarray(value)
        if value is None or value.shape != () or value.dtype != jnp.bool_:
            shown = "None" if value is None else f"shape {value.shape}, dtype {value.dtype}"
            raise TypeError(f"{name}'s Decision.{field} ({shown}) must be one boolean. {fix}")
        flags[field] = value
    next_dt = decision.next_dt
    if not (hasattr(next_dt, "shape") and next_dt.shape == () and next_dt.dtype == dtype):
        shown = f"shape {jnp.shape(next_dt)}, dtype {jnp.result_type(next_dt)}"
        raise TypeError(f"{name}'s Decision.next_dt ({shown}) must be one {dtype} number. {fix}")
    shapes = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)
    if jax.tree.structure(decision.state) != jax.tree.structure(state) or shapes(
        decision.state
    ) != shapes(state):
        raise TypeError(f"{name}'s Decision.state changed from what `init` returned. {fix}")
    return dataclasses.replace(decision, **flags)
