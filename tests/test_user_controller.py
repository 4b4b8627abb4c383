"""A user's step-size controller, as the docs allow: the solve's tolerances and every adjoint's
own reach an adaptive one, and one that takes none says so at call time."""

from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt
from odeckpt._steppers import Step


def decay(t, y, k):
    return -k * y


Y0, K, T1 = jnp.array([1.0, 2.0]), jnp.array(1.3), 2.0


def exact(y0, k):
    return y0 * jnp.exp(-k * T1)


class Integral(odeckpt.AbstractAdaptiveController):
    """The classic integral controller, written against the adaptive contract: it sees the
    scaled error norm only."""

    rtol: float | None = None
    atol: float | None = None

    def check(self, stepper, dt0):
        pass

    def valid_settings(self):
        return jnp.array(True)

    def init(self, f, t0, y0, f0, args, stepper, dt0):
        return jnp.asarray(1e-3 if dt0 is None else dt0, jnp.result_type(t0)), None, 0

    def judge(self, t0, t1, dt, error, stepper, state, *, clipped, accept=None, dt_factor=None):
        finite = jnp.isfinite(error)
        accept = finite & (error <= 1) if accept is None else accept
        factor = 0.9 * jnp.where(finite, jnp.maximum(error, 1e-10), 1e10) ** (-1 / 5)
        factor = jnp.clip(factor, 0.2, 5.0)
        factor = jnp.where(accept, factor, jnp.minimum(factor, 1))
        next_dt = jax.lax.stop_gradient(factor * (t1 - t0))
        return odeckpt.Decision(accept, next_dt, state, next_dt < 1e-14, finite)

    def reject(self, t0, t1, dt, state):
        next_dt = 0.5 * (t1 - t0)
        return odeckpt.Decision(jnp.array(False), next_dt, state, next_dt < 1e-14, jnp.array(True))


class OwnTolerances(odeckpt.AbstractController):
    """A controller written against the bare contract, with tolerances of its own that the solve
    cannot know about (what the docs allowed before the adaptive contract)."""

    rtol: float = 1e-3
    atol: float = 1e-6

    judges_error: ClassVar[bool] = True

    def check(self, stepper, dt0):
        pass

    def valid(self):
        return jnp.array(True)

    def init(self, f, t0, y0, f0, args, stepper, dt0):
        return jnp.asarray(0.1, jnp.result_type(t0)), None, 0

    def adapt(self, t0, t1, dt, y0, y1, y_error, stepper, state, *, clipped, accept=None,
              dt_factor=None):  # fmt: skip
        scale = self.atol + self.rtol * jnp.abs(y1)
        error = jnp.sqrt(jnp.mean((y_error / scale) ** 2))
        finite = jnp.isfinite(error)
        accept = finite & (error <= 1) if accept is None else accept
        next_dt = jnp.where(accept, 1.5, 0.5) * (t1 - t0)
        return odeckpt.Decision(accept, next_dt, state, next_dt < 1e-14, finite)

    def reject(self, t0, t1, dt, state):
        return odeckpt.Decision(jnp.array(False), 0.5 * (t1 - t0), state, jnp.array(False),
                                jnp.array(True))  # fmt: skip


def test_solve_tolerances_reach_a_user_adaptive_controller():
    errors, steps = [], []
    for rtol in (1e-3, 1e-6, 1e-10):
        sol = odeckpt.solve(decay, Y0, (0.0, T1), K, rtol=rtol, atol=rtol * 1e-2,
                            controller=Integral())  # fmt: skip
        errors.append(float(jnp.max(jnp.abs(sol.ys[-1] - exact(Y0, K)))))
        steps.append(int(sol.stats.num_accepted_steps))
    # Tsit5 (order 5) with error-per-step control: the error follows the tolerance.
    assert errors[2] < 1e-9 < errors[0]
    assert steps[0] < steps[1] < steps[2]
    # The controller's own tolerances, where set, are kept.
    own = odeckpt.solve(decay, Y0, (0.0, T1), K, controller=Integral(rtol=1e-10, atol=1e-12))
    assert int(own.stats.num_accepted_steps) == steps[2]


def test_tolerances_given_twice_is_an_error():
    with pytest.raises(ValueError, match="rtol is given twice"):
        odeckpt.solve(decay, Y0, (0.0, T1), K, rtol=1e-8,
                      controller=odeckpt.PIDController(rtol=1e-4))  # fmt: skip
    with pytest.raises(ValueError, match="atol is given twice"):
        odeckpt.solve(decay, Y0, (0.0, T1), K, atol=1e-8, controller=Integral(atol=1e-4))


def test_a_controller_without_tolerances_says_so_at_call_time():
    with pytest.raises(ValueError, match="AbstractAdaptiveController"):
        odeckpt.solve(decay, Y0, (0.0, T1), K, rtol=1e-10, atol=1e-12, controller=OwnTolerances())
    # Without tolerances given to the solve, it runs on its own.
    sol = odeckpt.solve(decay, Y0, (0.0, T1), K, controller=OwnTolerances())
    assert sol.status == odeckpt.Status.successful


@pytest.mark.parametrize("adjoint", [odeckpt.BacksolveAdjoint(), odeckpt.InterpolatingAdjoint()])
def test_continuous_adjoints_after_a_controller_without_tolerances(adjoint):
    loss = lambda k, adjoint: jnp.sum(odeckpt.solve(decay, Y0, (0.0, T1), k, adjoint=adjoint,
                                                    controller=OwnTolerances()).ys[-1])  # fmt: skip
    with pytest.raises(ValueError, match="takes no tolerances"):
        jax.grad(loss)(K, adjoint)
    # Tolerances of the adjoint's own do not help: the reconstructed state's drift from the
    # forward solution is measured in the forward solve's tolerances too.
    with pytest.raises(ValueError, match="takes no tolerances"):
        jax.grad(loss)(K, type(adjoint)(rtol=1e-9, atol=1e-11))


@pytest.mark.parametrize("adjoint", ["backsolve", "interpolating"])
def test_continuous_adjoints_hold_a_user_controller_to_their_tolerances(adjoint):
    def loss(k, rtol):
        kind = odeckpt.BacksolveAdjoint if adjoint == "backsolve" else odeckpt.InterpolatingAdjoint
        adj = kind(rtol=rtol, atol=rtol * 1e-2)
        sol = odeckpt.solve(decay, Y0, (0.0, T1), k, rtol=1e-10, atol=1e-12, adjoint=adj,
                            controller=Integral())  # fmt: skip
        return jnp.sum(sol.ys[-1])

    expected = jax.grad(lambda k: jnp.sum(exact(Y0, k)))(K)
    loose = abs(float(jax.grad(loss)(K, 1e-4) - expected))
    tight = abs(float(jax.grad(loss)(K, 1e-10) - expected))
    assert tight < 1e-8 and tight < loose / 100


def test_forward_sensitivity_tolerances_reach_a_user_controller():
    def grad(adjoint):
        def loss(k):
            sol = odeckpt.solve(decay, Y0, (0.0, T1), k, rtol=1e-4, atol=1e-6, adjoint=adjoint,
                                controller=Integral())  # fmt: skip
            return jnp.sum(sol.ys[-1])

        return jax.grad(loss)(K)

    expected = jax.grad(lambda k: jnp.sum(exact(Y0, k)))(K)
    default = abs(float(grad(odeckpt.ForwardSensitivity()) - expected))
    tight = abs(float(grad(odeckpt.ForwardSensitivity(rtol=1e-10, atol=1e-12)) - expected))
    # The sensitivities' own tolerances and per-direction error control apply.
    assert tight < 1e-8 and tight < default / 100


def test_forward_sensitivity_with_controllers_that_take_no_tolerances():
    loss = lambda k, adjoint, controller, dt0=None: jnp.sum(
        odeckpt.solve(decay, Y0, (0.0, T1), k, adjoint=adjoint, controller=controller,
                      dt0=dt0).ys[-1]
    )  # fmt: skip
    with pytest.raises(ValueError, match="AbstractAdaptiveController"):
        jax.grad(loss)(K, odeckpt.ForwardSensitivity(), OwnTolerances())
    with pytest.raises(ValueError, match="drop ForwardSensitivity's tolerances"):
        jax.grad(loss)(K, odeckpt.ForwardSensitivity(rtol=1e-8), odeckpt.ConstantStep(), 0.1)


def test_a_multistep_stepper_must_say_what_state_is_differentiable():
    class TwoStep(odeckpt.AbstractStepper):
        """The two-step Adams-Bashforth method (Euler to start), its history the last `f`."""

        name: ClassVar[str] = "ab2"
        order: ClassVar[int] = 2
        error_order: ClassVar[int | None] = None
        fn_evals_per_step: ClassVar[int] = 1
        dense_degree: ClassVar[int] = 1
        implicit: ClassVar[bool] = False
        multistep: ClassVar[bool] = True

        def init(self, f, t0, y0, args):
            f0 = f(t0, y0, args)
            return (f0, f0)

        def derivative(self, state):
            return state[0]

        def step(self, f, t0, t1, y0, args, state):
            h = t1 - t0
            f0, f_prev = state
            y1 = y0 + h * (1.5 * f0 - 0.5 * f_prev)
            dense = jnp.stack([y0, y1 - y0])
            return Step(y1, None, dense, (f(t1, y1, args), f0))

    def loss(k):
        sol = odeckpt.solve(decay, Y0, (0.0, T1), k, solver=TwoStep(), dt0=0.01,
                            adjoint=odeckpt.ForwardSensitivity())  # fmt: skip
        return jnp.sum(sol.ys[-1])

    with pytest.raises(NotImplementedError, match="differentiable_state"):
        jax.grad(loss)(K)


def test_a_stepper_must_say_whether_it_is_implicit():
    class Undeclared(odeckpt.AbstractStepper):
        name: ClassVar[str] = "undeclared"
        order: ClassVar[int] = 1
        error_order: ClassVar[int | None] = None
        fn_evals_per_step: ClassVar[int] = 1
        dense_degree: ClassVar[int] = 1

        def init(self, f, t0, y0, args):
            return f(t0, y0, args)

        def step(self, f, t0, t1, y0, args, state):
            raise NotImplementedError

    with pytest.raises(TypeError, match="implicit"):
        Undeclared()


def test_a_step_size_that_is_not_positive_ends_the_solve():
    class Backwards(Integral):
        def judge(self, t0, t1, dt, error, stepper, state, *, clipped, accept=None,
                  dt_factor=None):  # fmt: skip
            d = Integral.judge(self, t0, t1, dt, error, stepper, state, clipped=clipped,
                               accept=accept, dt_factor=dt_factor)  # fmt: skip
            return odeckpt.Decision(d.accept, -d.next_dt, d.state, d.underflow, d.finite)

    sol = odeckpt.solve(decay, Y0, (0.0, T1), K, controller=Backwards(), throw=False,
                        saveat=odeckpt.SaveAt(steps=True))  # fmt: skip
    assert sol.status == odeckpt.Status.dt_underflow
    assert bool(jnp.all(sol.ts[jnp.isfinite(sol.ts)] >= 0))


def test_a_controller_with_an_init_of_its_own():
    class Scaled(Integral):
        def __init__(self, tolerance=None):
            self.rtol = tolerance
            self.atol = None if tolerance is None else tolerance * 1e-2

    own = odeckpt.solve(decay, Y0, (0.0, T1), K, controller=Scaled(1e-10))
    given = odeckpt.solve(decay, Y0, (0.0, T1), K, rtol=1e-10, atol=1e-12, controller=Scaled())
    assert float(jnp.max(jnp.abs(own.ys[-1] - exact(Y0, K)))) < 1e-9
    assert int(own.stats.num_steps) == int(given.stats.num_steps)


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: (d.accept, d.next_dt), "not a Decision"),
        (lambda d: odeckpt.Decision(d.accept, d.next_dt[None], d.state, d.underflow, d.finite),
         "next_dt"),
        (lambda d: odeckpt.Decision(d.accept, d.next_dt, d.state, None, d.finite), "underflow"),
        (lambda d: odeckpt.Decision(d.accept * 1.0, d.next_dt, d.state, d.underflow, d.finite),
         "accept"),
        (lambda d: odeckpt.Decision(d.accept, d.next_dt, jnp.zeros(3), d.underflow, d.finite),
         "state"),
    ],
)  # fmt: skip
def test_a_decision_that_breaks_the_contract_names_the_field(change, field):
    class Broken(Integral):
        def judge(self, t0, t1, dt, error, stepper, state, *, clipped, accept=None,
                  dt_factor=None):  # fmt: skip
            d = Integral.judge(self, t0, t1, dt, error, stepper, state, clipped=clipped,
                               accept=accept, dt_factor=dt_factor)  # fmt: skip
            return change(d)

    with pytest.raises(TypeError, match=field):
        odeckpt.solve(decay, Y0, (0.0, T1), K, controller=Broken())


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve", "forward_sensitivity"])
def test_a_user_controller_fails_loudly_on_a_non_finite_field(adjoint):
    """A NaN in `f` past t = 1 in one lane of a batch: that lane fails, its gradient is NaN, and
    the other lane is untouched."""

    def f(t, y, k):
        return jnp.where((t > 1.0) & (k > 2.0), jnp.nan, -k * y)

    def loss(k):
        sol = odeckpt.solve(f, Y0, (0.0, T1), k, adjoint=adjoint, controller=Integral(),
                            throw=False)  # fmt: skip
        return jnp.sum(sol.ys[-1]), sol.status

    ks = jnp.array([1.3, 2.5])
    (values, status), grads = jax.vmap(jax.value_and_grad(loss, has_aux=True))(ks)
    ok = np.asarray(status == odeckpt.Status.successful)
    assert ok.tolist() == [True, False]
    assert bool(jnp.isfinite(grads[0])) and bool(jnp.isnan(grads[1]))
    expected = jax.grad(lambda k: jnp.sum(exact(Y0, k)))(ks[0])
    assert abs(float(grads[0] - expected)) < 1e-4 * abs(float(expected))
