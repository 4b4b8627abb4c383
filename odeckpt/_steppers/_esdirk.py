"""One generic step for every ESDIRK tableau, with Newton's method for the implicit stages."""

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._autodiff import filled, scan
from .._real_coordinates import RealCoordinates
from .._types import Args, BoolScalar, IntScalar, Scalar, VectorField, Y
from ._base import Step
from ._implicit import AbstractImplicit, per_step
from ._implicit_tableau import ESDIRKTableau
from ._newton import AbstractNewton, FlatField, Jacobian, Stage

# equinox's documented import: pyright reads `eqx.AbstractClassVar` as an instance field, so
# a subclass's `ClassVar` would look like an incompatible override (pyright#4965).
if TYPE_CHECKING:
    from typing import ClassVar as AbstractClassVar
else:
    from equinox import AbstractClassVar


class ImplicitState(eqx.Module):
    """What an implicit stepper carries between steps.

    **Fields:**

    - `f`: `f(t, y, args)` at the current point: the next step's explicit first stage.
    - `cache`: the Newton method's cache (for `Newton`: the Jacobian, its LU factors and when
        to re-evaluate them; `None` for `NewtonKrylov`).
    - `eta`: Hairer and Wanner's convergence estimate, which starts the next iteration.
    """

    f: Y
    cache: Y
    eta: Scalar

    @classmethod
    def initial(
        cls, newton: AbstractNewton, f: VectorField, t0: Scalar, y0: Y, args: Args, **cache
    ) -> "ImplicitState":
        """The state at the initial point: `f(t0, y0, args)`, an empty cache that asks for a
        Jacobian at the first step (`cache` are `newton.init_cache`'s options), `eta = 1`."""
        t0 = jnp.asarray(t0)
        _, y0_flat = RealCoordinates.make(y0)
        return cls(
            f=f(t0, y0, args),
            cache=newton.init_cache(y0_flat, t0, **cache),
            eta=jnp.ones((), jnp.finfo(y0_flat.dtype).dtype),
        )

    def rejected(self, cache: Y, failed: BoolScalar, eta: Scalar) -> "ImplicitState":
        """The state to keep when an attempt from this point is rejected: the same `f`, the
        cache to carry on rejection, and `eta` (1 after a failed iteration)."""
        return ImplicitState(self.f, cache, jnp.where(failed, 1.0, eta).astype(eta.dtype))


class _StageCarry(NamedTuple):
    """The carry of `AbstractESDIRK.step`'s scan over the implicit stages: the stage
    derivatives `k_i` (flat, one row each), the last stage's `eta`, whether any stage's Newton
    iteration failed or met a non-finite value, the largest contraction rate, and the Newton
    iterations taken (one evaluation of `f` each)."""

    ks: Array
    eta: Scalar
    failed: BoolScalar
    nonfinite: BoolScalar
    rate: Scalar
    num_fn_evals: IntScalar


class AbstractESDIRK(AbstractImplicit):
    """An ESDIRK method given by its `ESDIRKTableau`, solving each implicit stage with Newton's
    method (`newton`), whose Jacobian is reused across stages and steps (see `Newton`).

    Concrete methods set `tableau` and the `AbstractStepper` class variables and hold the
    fields `newton` and `jac`; this class implements `init` and `step` once for all of them.
    Each stage value is differentiated by the implicit function theorem (`_steppers._newton`).
    `fn_evals_per_step` counts one Newton iteration per implicit stage; `Step.num_fn_evals`
    counts the iterations taken (one evaluation of `f` each).
    """

    tableau: AbstractClassVar[ESDIRKTableau]
    newton: eqx.AbstractVar[AbstractNewton]
    jac: eqx.AbstractVar[Callable | None]
    multistep: ClassVar[bool] = False

    def init(self, f: VectorField, t0: Scalar, y0: Y, args: Args) -> ImplicitState:
        """**Returns:** the state at the initial point (`ImplicitState.initial`)."""
        return ImplicitState.initial(self.newton, f, t0, y0, args)

    def derivative(self, state: ImplicitState) -> Y:
        """**Returns:** `state.f`, i.e. `f(t, y, args)` at the state's point."""
        return state.f

    def with_differentiable_state(self, state: ImplicitState, part: Y) -> ImplicitState:
        """**Returns:** `state` with `f` replaced by `part`."""
        return dataclasses.replace(state, f=part)

    def with_fresh_jacobian(self, state: ImplicitState) -> ImplicitState:
        """**Returns:** `state`, its Newton cache asking for a Jacobian at the next attempt."""
        return dataclasses.replace(state, cache=self.newton.refreshed(state.cache))

    def step(
        self, f: VectorField, t0: Scalar, t1: Scalar, y0: Y, args: Args, state: ImplicitState
    ) -> Step:
        """Attempt one step from `(t0, y0)` to `t1` (`t1 < t0` integrates backwards).

        **Arguments:** as for `AbstractStepper.step`; `state` is an `ImplicitState`.

        **Returns:** a `Step` with `y1 = z_s`, the embedded error estimate, the cubic Hermite
        dense output, the states to carry on acceptance and on rejection, whether any stage's
        Newton iteration failed, and the Jacobian evaluations, LU factorisations and
        evaluations of `f` (Newton iterations) done.
        """
        tableau = self.tableau
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        h = t1 - t0
        hg = h * tableau.gamma
        field, y0_flat = FlatField.make(f, t0, y0, args)
        jacobian = Jacobian(self.jac)
        newton = self.held_newton(y0_flat.dtype)
        prepared = newton.prepare(jacobian, field, t0, y0_flat, args, hg, state.cache)
        scale = newton.scale(field.coordinates, y0_flat)
        dtype = y0_flat.dtype
        s = tableau.num_stages
        ks = filled(y0_flat, 0, rows=s).at[0].set(field.ravel(state.f))

        # The implicit stages as one scan (traced once, not once per stage: compile time).
        def stage(carry: _StageCarry, i) -> tuple[_StageCarry, Array]:
            hk = jnp.asarray(h, dtype) * carry.ks
            base = y0_flat + jnp.asarray(tableau.a, dtype)[i] @ hk
            guess = base + jnp.asarray(tableau.gamma, dtype) * (
                jnp.asarray(tableau.predictor, dtype)[i] @ hk
            )
            c = jnp.asarray(tableau.c, t0.dtype)[i]
            t = jnp.where(c == 1, t1, t0 + c * h)
            # After a failed stage the step is retried shorter: the rest are not worth solving.
            system = Stage(field, t, hg, base, args)
            z, info = newton.solve(system, guess, prepared, scale, carry.eta, carry.failed)
            # A zero-length step (a finished lane under vmap) has z = base: k = 0, never 0/0.
            ks = carry.ks.at[i].set(per_step(z - base, hg))
            rate = jnp.maximum(carry.rate, info.rate)
            evals = carry.num_fn_evals + info.num_iterations
            failed, nonfinite = carry.failed | ~info.converged, carry.nonfinite | info.nonfinite
            return _StageCarry(ks, info.eta, failed, nonfinite, rate, evals), z

        init = _StageCarry(
            ks=ks,
            eta=state.eta,
            failed=jnp.array(False),
            nonfinite=jnp.array(False),
            rate=jnp.zeros_like(state.eta),
            num_fn_evals=jnp.zeros((), jnp.int32),
        )
        stages, zs = scan(stage, init, jnp.arange(1, s))
        z = zs[-1]
        # The error estimate and the dense output's powers of theta as one matrix product
        # (fewer operations to trace and compile than a sum per weight).
        weights = jnp.asarray(np.stack([tableau.b_error, *tableau.dense_weights]), dtype)
        combined = weights @ (jnp.asarray(h, dtype) * stages.ks)
        y_error = combined[0]
        dense = jax.vmap(field.unravel)(jnp.concatenate([y0_flat[None], combined[1:]]))
        on_accept, on_reject = newton.next_caches(prepared.cache, stages.failed, stages.rate)
        return Step(
            y1=field.unravel(z),
            y_error=field.unravel(y_error),
            dense=dense,
            state=ImplicitState(f=field.unravel(stages.ks[-1]), cache=on_accept, eta=stages.eta),
            state_on_reject=state.rejected(on_reject, stages.failed, stages.eta),
            failed=stages.failed,
            nonfinite=stages.nonfinite,
            num_jacobian_evals=prepared.num_jacobian_evals,
            num_lu_factorisations=prepared.num_lu_factorisations,
            num_fn_evals=stages.num_fn_evals,
        )
