"""An explicit stepper made algebraically reversible by coupling two states (McCallum & Foster)."""

# The class variables of `AbstractStepper` are read from the wrapped stepper (`AbstractWrapper`)
# through properties, which pyright sees as assigned to a `str` or an `int`.
# pyright: reportAssignmentType=false, reportIncompatibleMethodOverride=false

import numbers

import equinox as eqx
import jax
import jax.numpy as jnp

from .._types import Args, Scalar, VectorField, Y
from ._base import AbstractStepper, Step
from ._wrapper import AbstractWrapper


class ReversibleState(eqx.Module):
    """What `Reversible` carries between steps: the second state `z` and `f(t, z)`, the first
    stage of the next step of the wrapped stepper."""

    z: Y
    f_z: Y


class Reversible(AbstractWrapper):
    """An explicit stepper made algebraically reversible: each step can be undone exactly
    (`undo`), in exact arithmetic, from the state after it.

    With `Psi_h(t, x)` the increment of one step of `stepper` of size `h` from `(t, x)`, the
    solution `y` is coupled to a second state `z` (starting at `z_0 = y_0`):

        y_{n+1} = c y_n + (1 - c) z_n + Psi_h(t_n, z_n)
        z_{n+1} = z_n - Psi_{-h}(t_{n+1}, y_{n+1})

    and the step is undone by `z_n = z_{n+1} + Psi_{-h}(t_{n+1}, y_{n+1})`, then
    `y_n = (y_{n+1} - (1 - c) z_n - Psi_h(t_n, z_n)) / c`. The method has the order of
    `stepper`. A step costs two steps of `stepper` and two more evaluations of `f`.

    Stability: on `y' = lambda y` the coupled scheme has the mode of `stepper`, `R(h lambda)`,
    and a parasitic one, `c / R(h lambda)`, which grows where `|R| < c` (a damped component at
    a step size with `h |lambda|` above about `1 - c`). The error estimate that adapts the
    steps is therefore `stepper`'s estimate of the step from `z_n` plus the change of the gap
    `y - z` beyond its damping (`gap_{n+1} - c gap_n`), which grows with the parasitic mode:
    the steps shrink where it would grow. With `ConstantStep`, keeping `h |lambda|` small
    enough is the caller's part.

    The coupling `c` is in `(0, 1]`. Undoing a step divides by `c`, so the round-off of a
    reconstruction over `n` steps grows like `c**-n` (at `c = 0.999` and 1000 steps, about
    2.7 times that of `c = 1`): a coupling close to 1 undoes many steps accurately, and needs
    small steps on damped components (see Stability).

    The stepper state is a `ReversibleState`. Dense output: the continuous extension of the
    step of `stepper` from `z_n`, shifted by `(1 - theta + c theta) (y_n - z_n)` so that it
    runs from `y_n` to `y_{n+1}`.

    **Arguments:**

    - `stepper`: an explicit one-step stepper (`Tsit5()`, `Dopri5()`, `RK4()`, ...).
    - `coupling`: `c`, a number in `(0, 1]`.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    sol = odeckpt.solve(f, jnp.array([1.0, 2.0]), (0.0, 1.0),
                        solver=odeckpt.Reversible(odeckpt.Tsit5()))
    ```

    **References:** S. McCallum and J. Foster, "Efficient, accurate and stable gradients for
    neural ODEs", arXiv:2410.11648 (2024).
    """

    stepper: AbstractStepper
    coupling: float = 0.999

    def __check_init__(self):
        stepper = self.stepper
        if not isinstance(stepper, AbstractStepper):
            raise TypeError(
                f"Reversible(stepper={stepper!r}) needs a stepper. Fix: pass e.g. "
                "`odeckpt.Reversible(odeckpt.Tsit5())`."
            )
        if stepper.implicit or stepper.multistep or not stepper.state_is_derivative:
            raise ValueError(
                f"Reversible wraps explicit one-step steppers; {type(stepper).__name__} is not "
                "one. Fix: wrap e.g. `odeckpt.Tsit5()`, `odeckpt.Dopri5()` or `odeckpt.RK4()`."
            )
        coupling = self.coupling
        if not isinstance(coupling, numbers.Real) or not 0 < coupling <= 1:
            raise ValueError(
                f"Reversible(coupling={coupling!r}) must be a number in (0, 1]. Fix: pass e.g. "
                "coupling=0.999."
            )

    name = property(lambda self: f"reversible {self.stepper.name}")
    fn_evals_per_step = property(lambda self: 2 * self.stepper.fn_evals_per_step + 2)

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> ReversibleState:
        """**Returns:** `z_0 = y_0` and `f(t0, y0, args)`."""
        return ReversibleState(y0, self.stepper.init(f, t0, y0, args))

    def step(
        self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: ReversibleState
    ) -> Step:
        """One coupled step from `(t0, y0)` and `state` to `t1` (see the class docstring)."""
        c, z = self.coupling, state.z
        forward = self.stepper.step(f, t0, t1, z, args, state.f_z)
        gap = _sub(y0, z)
        y1 = jax.tree.map(lambda a, b, y: c * a + (1 - c) * b + (y - b), y0, z, forward.y1)
        back = self._increment(f, t1, t0, y1, args)
        z1 = _sub(z, back)
        f_z1 = self.stepper.init(f, t1, z1, args)

        def dense(coeffs, g):
            shifted = coeffs.at[0].add(g)
            if coeffs.shape[0] > 1:
                shifted = shifted.at[1].add((c - 1) * g)
            return shifted

        # The change of the gap between the two states beyond its damping: about the round
        # trip's error while the coupled scheme is stable at this step size, growing with the
        # gap where it is not, which the wrapped stepper's estimate does not see.
        drift = jax.tree.map(lambda y, z, g: (y - z) - c * g, y1, z1, gap)
        y_error = None if forward.y_error is None else jax.tree.map(jnp.add, forward.y_error, drift)
        return Step(
            y1=y1,
            y_error=y_error,
            dense=jax.tree.map(dense, forward.dense, gap),
            state=ReversibleState(z1, f_z1),
        )

    def undo(
        self, f: VectorField, t0: Scalar, t1: Scalar, y1: Y, args: Args, state: ReversibleState
    ) -> tuple[Y, ReversibleState]:
        """The state before the step from `t0` to `t1` that ended at `y1` with `state`: `(y0,
        state0)` with `step(f, t0, t1, y0, args, state0)` giving `y1` and `state` (up to
        round-off).

        **Returns:** `y0` and the `ReversibleState` at `t0`.
        """
        c = self.coupling
        back = self._increment(f, t1, t0, y1, args)
        z0 = jax.tree.map(jnp.add, state.z, back)
        f_z0 = self.stepper.init(f, t0, z0, args)
        forward = self._increment(f, t0, t1, z0, args, f_z0)
        y0 = jax.tree.map(lambda y, z, p: (y - (1 - c) * z - p) / c, y1, z0, forward)
        return y0, ReversibleState(z0, f_z0)

    def _increment(self, f, t0, t1, x, args, f_x=None) -> Y:
        """`Psi`: the increment of one step of the wrapped stepper from `(t0, x)` to `t1`."""
        if f_x is None:
            f_x = self.stepper.init(f, t0, x, args)
        return _sub(self.stepper.step(f, t0, t1, x, args, f_x).y1, x)

    def derivative(self, state: ReversibleState) -> Y:
        """`f(t, z)`: the vector field at the second state (at `t0`, where `z = y`, the
        solution's derivative)."""
        return state.f_z

    def differentiable_state(self, state: ReversibleState) -> ReversibleState:
        """All of it: a step depends on `z` and `f(t, z)` beyond `(y, args)`."""
        return state

    def with_differentiable_state(
        self, state: ReversibleState, part: ReversibleState
    ) -> ReversibleState:
        del state
        return part


def _sub(a: Y, b: Y) -> Y:
    return jax.tree.map(jnp.subtract, a, b)
