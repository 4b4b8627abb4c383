"""Step-size controllers: how long the next step is, and whether the last one is accepted.

Times here are internal times `tau = direction * t`, so step sizes are positive.
"""

import abc
import dataclasses
import functools
from typing import TYPE_CHECKING, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._autodiff import stack
from .._checks import known_values
from .._error_norm import effective_tolerances, per_leaf, real_dtype, rms, scaled_error
from .._steppers import AbstractStepper
from .._types import Args, BoolScalar, Scalar, Tolerance, VectorField, Y
from ._decision import Decision
from ._landing import resolves

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar

DEFAULT_RTOL, DEFAULT_ATOL = 1e-6, 1e-8
"""The tolerances of a solve that sets none (`solve(rtol=None, atol=None)` and an adaptive
controller without its own)."""


class AbstractController(eqx.Module):
    """Chooses step sizes. `init` picks the first step; `adapt` judges each attempted step.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    controller: odeckpt.AbstractController = odeckpt.PIDController(rtol=1e-4, atol=1e-6)
    sol = odeckpt.solve(f, y0, (0.0, 1.0), controller=controller)
    ```
    """

    judges_error: AbstractClassVar[bool]
    """Whether `adapt` reads the error estimate, and then returns `finite=False` and rejects the
    step when it is NaN or inf."""
    fixed_steps: ClassVar[bool] = False
    """Whether the steps are those of `dt0` from `t0` whatever the solution (`ConstantStep`), so
    that their number is known before the solve when the times are."""

    @abc.abstractmethod
    def check(self, stepper: AbstractStepper, dt0: float | None) -> None:
        """Raise (naming the fix) if this controller cannot drive `stepper` with `dt0`."""

    @abc.abstractmethod
    def valid(self) -> BoolScalar:
        """Whether this controller's settings are valid. Settings known at construction are
        checked there; this checks traced ones at run time (a solve with invalid settings ends
        before its first step with `Status.invalid_settings`)."""

    @abc.abstractmethod
    def init(
        self,
        f: VectorField,
        t0: Scalar,
        y0: Y,
        f0: Y,
        args: Args,
        stepper: AbstractStepper,
        dt0: Scalar | None,
    ) -> tuple[Scalar, Y, int]:
        """First step size (positive), initial controller state, and the `f` evaluations used."""

    @abc.abstractmethod
    def adapt(
        self,
        t0: Scalar,
        t1: Scalar,
        dt: Scalar,
        y0: Y,
        y1: Y,
        y_error: Y | None,
        stepper: AbstractStepper,
        state: Y,
        *,
        clipped: BoolScalar,
        accept: BoolScalar | None = None,
        dt_factor: Scalar | None = None,
    ) -> Decision:
        """Judge the step from `t0` to `t1` and propose the next step size. `dt` is the step size
        that was proposed for this step; `clipped` says whether the step was cut short (`t1 -
        t0` about `dt` or less) to land on a save time or the end of the span. `accept`, when
        given, is the verdict to follow instead of judging the error: the recorded verdict of
        this same step, when the checkpointing engine recomputes it. `dt_factor`, when given,
        is the stepper's own proposal for the ratio of the next step size to this one
        (`Step.dt_factor`), which an adaptive controller follows within its bounds."""

    @abc.abstractmethod
    def reject(self, t0: Scalar, t1: Scalar, dt: Scalar, state: Y) -> Decision:
        """The verdict on a step that could not be completed (an implicit stepper's Newton
        iteration failed, or a stage, the error estimate or the new state is NaN or inf):
        rejected, with a shorter step to retry if this controller can shorten it (`underflow`
        if it cannot)."""


class AbstractAdaptiveController(AbstractController):
    """A controller that adapts step sizes to tolerances. Each attempted step is judged by its
    scaled error norm: the root mean square of the embedded error estimate over `atol + rtol
    max(|y0|, |y1|)`, at the tolerances the stepper holds its steps to (`held_tolerances`); a
    step is accepted when it is at most 1. The norm is computed here (`adapt`), so the
    tolerances reach every adaptive controller alike: `solve(rtol=..., atol=...)` fills those
    left `None`, and an adjoint with tolerances of its own (a backward solve, forward
    sensitivities held to theirs) replaces them (`with_tolerances`) or judges its own norm
    (`judge`).

    A subclass declares the fields `rtol` and `atol` (default `None`: the solve's) and
    implements `judge`, `init`, `reject`, `check` and `valid_settings`. `judge` must return a
    positive `next_dt` (a step size that is not positive, or NaN, ends the solve with
    `Status.dt_underflow`), and should follow `dt_factor` when a stepper proposes it: `BDF`
    raises its order only after several steps of one size, and stays at order 1 (many more
    steps, a larger error) under a controller that changes the step size at every step.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    class Halving(odeckpt.AbstractAdaptiveController):
        rtol: float | None = None
        atol: float | None = None

        def check(self, stepper, dt0):
            pass

        def valid_settings(self):
            return jnp.array(True)

        def init(self, f, t0, y0, f0, args, stepper, dt0):
            return jnp.asarray(1e-3 if dt0 is None else dt0, jnp.result_type(t0)), None, 0

        def judge(self, t0, t1, dt, error, stepper, state, *, clipped, accept=None,
                  dt_factor=None):
            finite = jnp.isfinite(error)
            accept = finite & (error <= 1) if accept is None else accept
            next_dt = jnp.where(accept, 1.5, 0.5) * (t1 - t0)
            return odeckpt.Decision(accept, next_dt, state, next_dt < 1e-12, finite)

        def reject(self, t0, t1, dt, state):
            next_dt = 0.5 * (t1 - t0)
            return odeckpt.Decision(jnp.array(False), next_dt, state, next_dt < 1e-12,
                                    jnp.array(True))

    sol = odeckpt.solve(lambda t, y, args: -y, jnp.array([1.0]), (0.0, 1.0), rtol=1e-8,
                        atol=1e-10, controller=Halving())
    ```
    """

    rtol: eqx.AbstractVar[Tolerance | None]
    atol: eqx.AbstractVar[Tolerance | None]

    judges_error = True

    def with_tolerances(self, rtol: Tolerance, atol: Tolerance) -> "AbstractAdaptiveController":
        """This controller holding the steps to `rtol` and `atol` instead of its own (whatever
        its `__init__` takes)."""
        try:
            return dataclasses.replace(self, rtol=rtol, atol=atol)
        except TypeError:
            # An `__init__` of its own, taking other arguments: set the two fields directly.
            fields = lambda controller: (controller.rtol, controller.atol)
            return eqx.tree_at(fields, self, (rtol, atol), is_leaf=lambda x: x is None)

    def valid(self) -> BoolScalar:
        """Whether the tolerances are positive and finite and `valid_settings` holds."""
        tolerances = all_positive_finite(self.rtol) & all_positive_finite(self.atol)
        return tolerances & jnp.asarray(self.valid_settings())

    @abc.abstractmethod
    def valid_settings(self) -> BoolScalar:
        """Whether the settings other than the tolerances are valid (see `valid`)."""

    def held_tolerances(self, stepper: AbstractStepper, y0: Y) -> tuple[Y, Y]:
        """The tolerances `stepper`'s steps are held to (`effective_tolerances`, at the
        resolution of each leaf's own dtype), per leaf of `y0`."""
        if self.rtol is None or self.atol is None:
            raise ValueError(
                f"{type(self).__name__} has no tolerances (rtol={self.rtol}, atol={self.atol}). "
                "Fix: pass it to `odeckpt.solve`, which fills them from its `rtol` and `atol`, "
                "or set both."
            )
        exponent, reference = stepper.tolerance_exponent, stepper.tolerance_reference
        rtol, atol = per_leaf(self.rtol, y0), per_leaf(self.atol, y0)
        held = lambda i: (
            lambda r, a, y: effective_tolerances(r, a, exponent, real_dtype(y), reference)[i]
        )
        return jax.tree.map(held(0), rtol, atol, y0), jax.tree.map(held(1), rtol, atol, y0)

    def adapt(
        self, t0, t1, dt, y0, y1, y_error, stepper, state, *, clipped, accept=None, dt_factor=None
    ):
        if y_error is None:
            raise ValueError(
                f"{type(self).__name__} adapts the step size to the error estimate, and the "
                f"{type(stepper).__name__} stepper has none. Fix: pass "
                "`controller=odeckpt.ConstantStep()` with `dt0=...`."
            )
        # Step sizes are not differentiated (as in diffrax): the solution's derivative is that of
        # the steps taken, the same for every adjoint, and free of the controller's
        # ill-conditioned feedback.
        error = scaled_error(y_error, y0, y1, *self.held_tolerances(stepper, y0))
        error = jax.lax.stop_gradient(error.astype(t0.dtype))
        return self.judge(
            t0, t1, dt, error, stepper, state, clipped=clipped, accept=accept, dt_factor=dt_factor
        )

    @abc.abstractmethod
    def judge(
        self,
        t0: Scalar,
        t1: Scalar,
        dt: Scalar,
        error: Scalar,
        stepper: AbstractStepper,
        state: Y,
        *,
        clipped: BoolScalar,
        accept: BoolScalar | None = None,
        dt_factor: Scalar | None = None,
    ) -> Decision:
        """The verdict on the step from `t0` to `t1` whose scaled error norm is `error` (accept
        when at most 1; NaN or inf when the step is not finite, which is never accepted), and
        the next step size. The other arguments are those of `adapt`."""


class ConstantStep(AbstractController):
    """Fixed step size `dt0` (given to `solve`). The solve takes exactly `ceil((t1 - t0) / dt0)`
    steps, the last one shortened to land on `t1`; a step whose end would fall within rounding
    error of `t1` or of a save time lands on it exactly.

    At large |t| the times near `t` may be too far apart to resolve `dt0` (`t + dt0` rounds to
    a step more than 1% longer or shorter: `dt0 = 0.3` at `t = 1e14` in float64). Such a solve
    is a `ValueError` when `t0`, `t1` and `dt0` are known at call time, and otherwise ends with
    `Status.dt_underflow` at the first such step. A `dt0` that the times represent exactly
    (`0.5` at `t = 1e14`) takes the steps of the same solve shifted to start at 0.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    sol = odeckpt.solve(f, y0, (0.0, 1.0), solver="rk4", controller=odeckpt.ConstantStep(),
                        dt0=0.01)
    ```
    """

    judges_error = False
    fixed_steps = True

    def check(self, stepper: AbstractStepper, dt0: float | None) -> None:
        if dt0 is None:
            raise ValueError(
                "ConstantStep needs a step size. Fix: pass `dt0=...` to `odeckpt.solve`."
            )

    def valid(self) -> BoolScalar:
        # `dt0` is checked by `solve`.
        return jnp.array(True)

    def init(self, f, t0, y0, f0, args, stepper, dt0):
        assert dt0 is not None
        return dt0, None, 0

    def adapt(
        self, t0, t1, dt, y0, y1, y_error, stepper, state, *, clipped, accept=None, dt_factor=None
    ):
        # Every finite step is accepted (the loop rejects a non-finite one, see `reject`),
        # unless the times near t0 are too far apart for steps of dt: then the solve ends
        # rather than go on with steps of other sizes.
        del y0, y1, y_error, stepper, dt_factor
        unresolved = ~clipped & ~resolves(jnp, t0, t1, dt)
        return Decision(
            accept=~unresolved if accept is None else accept,
            next_dt=dt,
            state=state,
            underflow=unresolved,
            finite=jnp.array(True),
        )

    def reject(self, t0, t1, dt, state):
        # A constant step cannot be shortened: the failure is final.
        del t0, t1
        true = jnp.array(True)
        return Decision(accept=~true, next_dt=dt, state=state, underflow=true, finite=true)


_SCALAR_SETTINGS = (
    "pcoeff", "icoeff", "dcoeff", "dtmin", "dtmax", "factormin", "factormax", "safety",
)  # fmt: skip
_EXAMPLES = dict(
    pcoeff=0.4, icoeff=0.3, dcoeff=0.0, dtmin=1e-10, dtmax=1.0, factormin=0.2, factormax=10.0,
    safety=0.9,
)  # fmt: skip


class PIDController(AbstractAdaptiveController):
    """Adaptive step size from the embedded error estimate (Söderlind's PID form).

    The scaled error is the root mean square over all components of
    `error / (atol + rtol * max(|y0|, |y1|))`; a step is accepted when it is at most 1. The next
    step is `safety * e_n**(-b1/k) * e_{n-1}**(-b2/k) * e_{n-2}**(-b3/k)` times the last one, with
    `k = error_order + 1`, `b1 = pcoeff + icoeff + dcoeff`, `b2 = -(pcoeff + 2 * dcoeff)`,
    `b3 = dcoeff`, clipped to `[factormin, factormax]` (and to at most 1 after a rejection).
    The default `icoeff=1` is the classic integral ("I") controller; `pcoeff=0.4, icoeff=0.3` is
    the PI controller recommended for stiff problems. A stepper that proposes its own ratio
    of step sizes (`Step.dt_factor`: `Radau5`'s predictive controller, `BDF`'s choice of order
    and step) replaces the PID factor; the bounds (`factormin`, `factormax`, `dtmin`, `dtmax`,
    at most 1 after a rejection) apply to it alike.

    **Arguments:**

    - `rtol`, `atol`: tolerances; `None` takes those passed to `odeckpt.solve`.
    - `pcoeff`, `icoeff`, `dcoeff`: PID gains.
    - `dtmin`, `dtmax`: bounds on the step size; a step size forced below `dtmin` (or below
        machine precision relative to t) ends the solve with `Status.dt_underflow`.
    - `factormin`, `factormax`: bounds on the ratio of consecutive step sizes.
    - `safety`: safety factor.

    **Example:**

    ```python
    import jax.numpy as jnp
    import odeckpt

    def f(t, y, args):
        return -y

    y0 = jnp.array([1.0, 2.0])
    controller = odeckpt.PIDController(rtol=1e-5, atol=1e-7, pcoeff=0.4, icoeff=0.3)
    sol = odeckpt.solve(f, y0, (0.0, 1.0), controller=controller)
    ```

    **References:** G. Söderlind, "Digital filters in adaptive time-stepping", ACM TOMS 29 (2003);
    Hairer, Nørsett & Wanner, *Solving ODEs I*, section II.4.
    """

    rtol: Tolerance | None = None
    atol: Tolerance | None = None
    pcoeff: float = 0.0
    icoeff: float = 1.0
    dcoeff: float = 0.0
    dtmin: float | None = None
    dtmax: float | None = None
    factormin: float = 0.2
    factormax: float = 10.0
    safety: float = 0.9

    def __check_init__(self):
        # Settings known now are checked now; traced ones by `valid` at run time.
        known = {name: known_values(f"PIDController({name})", getattr(self, name)) for name in (
            "rtol", "atol", "dtmin", "dtmax", "pcoeff", "icoeff", "dcoeff", "factormin",
            "factormax", "safety",
        )}  # fmt: skip
        for name in _SCALAR_SETTINGS:
            value = getattr(self, name)
            if value is not None and jnp.ndim(value) != 0:
                raise ValueError(
                    f"PIDController({name}=...) has shape {jnp.shape(value)}; it must be one "
                    f"number (only rtol and atol may be given per component). Fix: pass e.g. "
                    f"PIDController({name}={_EXAMPLES[name]})."
                )
        for name in ("rtol", "atol", "dtmin", "dtmax"):
            value = known[name]
            if value is not None and not (np.all(value > 0) and np.all(value < np.inf)):
                raise ValueError(
                    f"PIDController({name}={getattr(self, name)}) must be positive and finite. "
                    f"Fix: pass e.g. PIDController({name}={_EXAMPLES.get(name, 1e-6)})."
                )
        for name in ("pcoeff", "icoeff", "dcoeff"):
            value = known[name]
            if value is not None and not np.all(np.isfinite(value)):
                raise ValueError(
                    f"PIDController({name}={getattr(self, name)}) must be finite. Fix: pass e.g. "
                    f"PIDController({name}={_EXAMPLES[name]})."
                )
        factormin, factormax, safety = known["factormin"], known["factormax"], known["safety"]
        if factormin is not None and factormax is not None and not 0 < factormin < 1 < factormax:
            raise ValueError(
                "PIDController needs 0 < factormin < 1 < factormax, got "
                f"factormin={self.factormin}, factormax={self.factormax}. Fix: pass e.g. "
                "PIDController(factormin=0.2, factormax=10.0)."
            )
        if safety is not None and not 0 < safety <= 1:
            raise ValueError(
                f"PIDController(safety={self.safety}) must be in (0, 1]. Fix: pass e.g. "
                "PIDController(safety=0.9)."
            )
        dtmin, dtmax = known["dtmin"], known["dtmax"]
        if dtmin is not None and dtmax is not None and dtmin.size and dtmax.size and dtmin > dtmax:
            raise ValueError(
                f"PIDController needs dtmin <= dtmax, got dtmin={self.dtmin}, "
                f"dtmax={self.dtmax}. Fix: swap them, or leave either unset (None)."
            )

    def valid_settings(self) -> BoolScalar:
        """Whether the settings other than the tolerances are valid (the bounds above);
        constant `True` unless some are traced, which `__check_init__` cannot check."""
        ok = [all_positive_finite(x) for x in (self.dtmin, self.dtmax) if x is not None]
        ok += [jnp.isfinite(x) for x in (self.pcoeff, self.icoeff, self.dcoeff)]
        ok += [0 < self.factormin, self.factormin < 1, 1 < self.factormax]
        ok += [0 < self.safety, self.safety <= 1]
        if self.dtmin is not None and self.dtmax is not None:
            ok.append(self.dtmin <= self.dtmax)
        return functools.reduce(jnp.logical_and, [jnp.asarray(x) for x in ok])

    def check(self, stepper: AbstractStepper, dt0: float | None) -> None:
        if stepper.error_order is None:
            raise ValueError(
                f"The {type(stepper).__name__} stepper has no embedded error estimate, so it "
                "cannot adapt its step size. Fix: pass `controller=odeckpt.ConstantStep()` with "
                "`dt0=...`, or choose an adaptive solver such as 'tsit5' or 'dopri5'."
            )

    def init(self, f, t0, y0, f0, args, stepper, dt0):
        # The last two inverse error norms, in one vector (one loop-carried leaf, not two).
        inverse_errors = jnp.ones((2,), jnp.result_type(t0))
        if dt0 is not None:
            # A hint, like every step size this controller chooses: derivatives never
            # depend on it (as they do not on the automatic first step).
            dt0 = jax.lax.stop_gradient(jnp.asarray(dt0, t0.dtype))
            return self._clip(dt0), inverse_errors, 0
        dt = jax.lax.stop_gradient(self._initial_dt(f, t0, y0, f0, args, stepper))
        # Below rounding relative to t0 a step would not advance t at all.
        return self._clip(jnp.maximum(dt, self._dtmin(t0, t0))), inverse_errors, 1

    def _initial_dt(self, f, t0, y0, f0, args, stepper) -> Scalar:
        """Hairer, Nørsett & Wanner, *Solving ODEs I*, II.4, "Starting step size"."""
        rtol, atol = self.held_tolerances(stepper, y0)
        scale = jax.tree.map(lambda y, a, r: a + r * jnp.abs(y), y0, atol, rtol)
        d0 = rms(y0, scale)
        d1 = rms(f0, scale)
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1).astype(t0.dtype)
        y1 = jax.tree.map(lambda y, k: y + h0.astype(y.dtype) * k, y0, f0)
        f1 = f(t0 + h0, y1, args)
        d2 = rms(jax.tree.map(jnp.subtract, f1, f0), scale) / h0
        order = min(stepper.order, stepper.error_order or stepper.order)
        d12 = jnp.maximum(d1, d2)
        h1 = jnp.where(
            d12 <= 1e-15,
            jnp.maximum(1e-6, h0 * 1e-3),
            (0.01 / d12) ** (1.0 / (order + 1)),
        ).astype(t0.dtype)
        return jnp.minimum(100 * h0, h1)

    def judge(self, t0, t1, dt, error, stepper, state, *, clipped, accept=None, dt_factor=None):
        # The loop folds non-finite components of y1 and f(t1, y1) into y_error (see
        # `IntegrationLoop.step`), so the error norm alone detects a non-finite step.
        finite = jnp.isfinite(error)
        if accept is None:
            accept = finite & (error <= 1)
        inverse = jnp.where(finite, 1 / jnp.maximum(error, 1e-10), 0.0)
        inverse_prev = state[0]
        factor = self._pid_factor(stepper, inverse, state)
        if dt_factor is not None:
            # A rejected step shrinks at least as the PID rule says, even where the stepper's
            # own judgement differs (e.g. under a seminorm that the stepper does not know).
            proposal = jax.lax.stop_gradient(jnp.asarray(dt_factor, t0.dtype))
            proposal = jnp.where(finite & jnp.isfinite(proposal), proposal, self.factormin)
            factor = jnp.where(accept, proposal, jnp.minimum(proposal, factor))
        factor = jnp.clip(factor, self.factormin, self.factormax)
        factor = jnp.where(accept, factor, jnp.minimum(factor, 1.0))
        next_dt = factor * (t1 - t0)
        # An accepted step shortened to hit a save time says nothing against the longer proposal.
        next_dt = jnp.where(accept & clipped, jnp.maximum(next_dt, dt), next_dt)
        next_dt = jax.lax.stop_gradient(self._clip(next_dt))
        state = jnp.where(accept, stack([inverse, inverse_prev]), state)
        return Decision(
            accept=accept,
            next_dt=next_dt,
            state=state,
            underflow=~(next_dt >= self._dtmin(t0, t1)),
            finite=finite,
        )

    def _pid_factor(self, stepper: AbstractStepper, inverse: Scalar, state: Y) -> Scalar:
        """The PID ratio of the next step size to this one, from the inverse error norms."""
        k = min(stepper.order, stepper.error_order or stepper.order) + 1
        b1 = (self.pcoeff + self.icoeff + self.dcoeff) / k
        b2 = -(self.pcoeff + 2 * self.dcoeff) / k
        b3 = self.dcoeff / k
        factor = self.safety * inverse**b1
        # Known-zero gains cost nothing; traced ones are applied whatever their value.
        if not _known_zero(b2):
            factor = factor * state[0] ** b2
        if not _known_zero(b3):
            factor = factor * state[1] ** b3
        return factor

    def reject(self, t0, t1, dt, state):
        # Halve the step, as after a Newton failure in Hairer & Wanner's RADAU5 (Sec. IV.8).
        del dt
        next_dt = jax.lax.stop_gradient(self._clip(0.5 * (t1 - t0)))
        true = jnp.array(True)
        return Decision(
            accept=~true,
            next_dt=next_dt,
            state=state,
            underflow=~(next_dt >= self._dtmin(t0, t1)),
            finite=true,
        )

    def _dtmin(self, t0: Scalar, t1: Scalar) -> Scalar:
        """The smallest step size: `dtmin`, and never below rounding relative to t."""
        tiny = 10 * jnp.finfo(t0.dtype).eps * jnp.maximum(jnp.abs(t1), jnp.abs(t0))
        return tiny if self.dtmin is None else jnp.maximum(self.dtmin, tiny)

    def _clip(self, dt: Scalar) -> Scalar:
        if self.dtmax is not None:
            dt = jnp.minimum(dt, self.dtmax)
        return dt


def all_positive_finite(tolerance) -> BoolScalar:
    """Whether every number in `tolerance` (a number or a pytree of them) is positive and
    finite (`False` for NaN)."""
    checks = [jnp.all((jnp.asarray(x) > 0) & jnp.isfinite(x)) for x in jax.tree.leaves(tolerance)]
    return functools.reduce(jnp.logical_and, checks, jnp.array(True))


def _known_zero(x) -> bool:
    return isinstance(x, int | float) and x == 0
