"""What a solve writes out, and where."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float


class SaveAt(eqx.Module):
    """Which points of the solution to return.

    `sol.ts`/`sol.ys` hold the requested points as consecutive blocks, in this order: `t0` (one
    point), `ts` (`len(ts)` points), `steps` (`max_steps` points: the end of every accepted step,
    padded with `inf` after the last one), `t1` (one point).

    **Arguments:**

    - `t0`: save the initial point.
    - `t1`: save the final point (the default when `saveat=None`).
    - `ts`: times to save at: finite, sorted in the direction of integration and inside the
        time span. Values are interpolated with the stepper's continuous extension, and steps
        are shortened so that at most 16 distinct save times fall inside one step. Steppers
        whose continuous extension is of lower order than their steps (Dopri8, Kvaerno5) land
        on every save time instead. A time repeated is solved once (the copies are equal);
        times equal to `t0` hold `y0`.
    - `steps`: save the end of every accepted step.
    - `dense`: keep each step's continuous extension, so that `sol.evaluate(t)` works.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    saveat = odeckpt.SaveAt(ts=jnp.linspace(0.0, 1.0, 11), t1=True)
    sol = odeckpt.solve(lambda t, y, args: -y, jnp.array([1.0]), (0.0, 1.0), saveat=saveat)
    ```
    """

    t0: bool = False
    t1: bool = False
    ts: Float[Array, " n"] | None = None
    steps: bool = False
    dense: bool = False

    def __init__(
        self,
        *,
        t0: bool = False,
        t1: bool = False,
        ts: Float[ArrayLike, " n"] | None = None,
        steps: bool = False,
        dense: bool = False,
    ):
        self.t0 = t0
        self.t1 = t1
        self.steps = steps
        self.dense = dense
        if ts is None:
            self.ts = None
            return
        if not isinstance(ts, jnp.ndarray):
            ts = np.asarray(ts)
        if ts.ndim != 1 or ts.shape[0] == 0:
            raise ValueError(
                f"SaveAt(ts=...) must be a non-empty 1-D array of times, got shape {ts.shape}. "
                "Fix: pass e.g. `jnp.linspace(t0, t1, n)`."
            )
        if not jnp.issubdtype(ts.dtype, jnp.floating):
            ts = ts.astype(float)
        self.ts = jnp.asarray(ts)

    def __check_init__(self):
        if not (self.t0 or self.t1 or self.steps or self.dense or self.ts is not None):
            raise ValueError(
                "SaveAt saves nothing. Fix: set at least one of t0, t1, ts, steps or dense."
            )
