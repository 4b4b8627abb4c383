"""One generic step for every explicit Runge-Kutta tableau."""

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._autodiff import stack
from .._types import Args, Scalar, VectorField, Y
from ._base import AbstractStepper, Step
from ._fence import fence
from ._tableau import ButcherTableau

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


def combine(y0: Y | None, h: Scalar | float, weights: np.ndarray, ks: Sequence[Y]) -> Y:
    """`y0 + h * sum_j weights[j] * ks[j]` leaf by leaf (no `y0` term if `y0` is None).

    Zero weights are skipped at trace time. Coefficients enter as Python floats (weakly typed)
    and `h` is cast to each leaf's dtype, so a float32 or complex64 state is never promoted.
    """
    terms = [(float(w), k) for w, k in zip(weights, ks, strict=False) if w != 0]
    if not terms:
        return jax.tree.map(jnp.zeros_like, ks[0]) if y0 is None else y0
    coeffs = [w for w, _ in terms]

    def leaf(y, *k):
        total = coeffs[0] * k[0]
        for w, k_j in zip(coeffs[1:], k[1:], strict=True):
            total = total + w * k_j
        increment = jnp.asarray(h, dtype=total.dtype) * total
        return increment if y is None else y + increment

    stage_trees = [k for _, k in terms]
    if y0 is None:
        return jax.tree.map(lambda *k: leaf(None, *k), *stage_trees)
    return jax.tree.map(leaf, y0, *stage_trees)


def stage_time(t0: Scalar, t1: Scalar, h: Scalar, c: float) -> Scalar:
    # Exact endpoints: `t0 + 1.0 * (t1 - t0)` need not round to `t1`.
    if c == 0:
        return t0
    if c == 1:
        return t1
    return t0 + float(c) * h  # a Python float keeps a float32 time float32


class AbstractExplicitRK(AbstractStepper):
    """An explicit Runge-Kutta method given by its `ButcherTableau`.

    Concrete methods set `tableau` and the `AbstractStepper` class variables; this class
    implements `init` and `step` once for all of them.

    The state carried between steps is `f(t1, y1)`, used as the next step's first stage. For a
    FSAL tableau it is the last stage; otherwise it costs one evaluation at the end of the step
    (which also feeds the cubic Hermite dense output).
    """

    tableau: AbstractClassVar[ButcherTableau]
    state_is_derivative: ClassVar[bool] = True
    implicit: ClassVar[bool] = False
    multistep: ClassVar[bool] = False

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> Y:
        """**Returns:** `f(t0, y0, args)`, the first stage of the first step."""
        return f(t0, y0, args)

    def step(self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: Y) -> Step:
        """Attempt one step from `(t0, y0)` to `t1` (`t1 < t0` integrates backwards).

        **Arguments:**

        - `f`: the vector field `f(t, y, args)`.
        - `t0`, `t1`: start and end of the step.
        - `y0`: the solution at `t0`, any pytree of floating or complex arrays.
        - `args`: passed through to `f`.
        - `state`: `f(t0, y0, args)`, from `init` or the previous accepted step.

        **Returns:** a `Step` with `y1`, the embedded error estimate `y1 - y1_hat` (or `None`),
        the dense-output coefficients in `theta = (t - t0) / (t1 - t0)`, and the new state
        `f(t1, y1, args)`.
        """
        tableau = self.tableau
        h = t1 - t0
        num_explicit = tableau.num_stages - 1 if tableau.fsal else tableau.num_stages
        ks = [state]
        for i in range(1, num_explicit):
            t_i = stage_time(t0, t1, h, tableau.c[i])
            z_i = combine(y0, h, tableau.a[i, :i], ks)
            ks.append(f(t_i, fence(t_i, z_i), args))
        y1 = combine(y0, h, tableau.b, ks)
        f1 = f(t1, fence(t1, y1), args)
        ks.append(f1)
        if tableau.b_error is None:
            y_error = None
        else:
            y_error = combine(None, h, tableau.b_error, ks)
        powers = [combine(None, h, w, ks) for w in tableau.dense_weights]
        dense = jax.tree.map(lambda *p: stack(p), y0, *powers)
        return Step(y1=y1, y_error=y_error, dense=dense, state=f1)
