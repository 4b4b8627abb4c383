"""`odeckpt.Reversible`: McCallum & Foster's algebraically reversible wrapper of an explicit
stepper. Its order is the wrapped stepper's, its steps can be undone to round-off, and it solves
and differentiates as every stepper does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt

PARAMS = jnp.array([1.1, 0.4, 0.4, 0.1])
Y0 = jnp.array([10.0, 5.0])


def lotka_volterra(t, y, args):
    a, b, c, d = args[0], args[1], args[2], args[3]
    return jnp.stack([a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - c * y[1]])


def decay(t, y, args):
    return -y + jnp.sin(t)


def _exact_decay(t, y0):
    """The solution of `y' = -y + sin t`."""
    particular = lambda s: (jnp.sin(s) - jnp.cos(s)) / 2
    return (y0 - particular(0.0)) * jnp.exp(-t) + particular(t)


@pytest.mark.parametrize("base, order", [(odeckpt.Heun(), 2), (odeckpt.RK4(), 4)])
def test_the_order_is_the_wrapped_steppers(base, order):
    y0 = jnp.array([1.0, -0.5])
    errors = []
    for dt in (0.1, 0.05, 0.025):
        sol = odeckpt.solve(
            decay, y0, (0.0, 2.0), solver=odeckpt.Reversible(base),
            controller=odeckpt.ConstantStep(), dt0=dt,
        )  # fmt: skip
        errors.append(float(jnp.max(jnp.abs(sol.ys[-1] - _exact_decay(2.0, y0)))))
    slopes = np.diff(np.log(errors)) / np.log(0.5)
    assert np.all(np.abs(slopes - order) < 0.25), slopes


@pytest.mark.parametrize("coupling", [1.0, 0.999])
def test_steps_are_undone_to_round_off(coupling):
    stepper = odeckpt.Reversible(odeckpt.Tsit5(), coupling)
    times = np.linspace(0.0, 10.0, 1001)

    def forward(carry, t01):
        y, state = carry
        step = stepper.step(lotka_volterra, t01[0], t01[1], y, PARAMS, state)
        return (step.y1, step.state), None

    def backward(carry, t01):
        y, state = carry
        return stepper.undo(lotka_volterra, t01[0], t01[1], y, PARAMS, state), None

    pairs = jnp.stack([times[:-1], times[1:]], axis=1)
    start = (Y0, stepper.init(lotka_volterra, 0.0, Y0, PARAMS))
    end, _ = jax.lax.scan(forward, start, pairs)
    (y, state), _ = jax.lax.scan(backward, end, pairs, reverse=True)
    assert float(jnp.max(jnp.abs(end[0] - Y0))) > 1  # it went somewhere
    np.testing.assert_allclose(y, Y0, rtol=1e-11)
    np.testing.assert_allclose(state.z, Y0, rtol=1e-11)


def test_an_adaptive_solve_is_as_accurate_as_its_tolerance():
    ts = jnp.linspace(0.0, 10.0, 11)
    reference = odeckpt.solve(lotka_volterra, Y0, (0.0, 10.0), PARAMS, rtol=1e-12, atol=1e-12,
                              saveat=ts)  # fmt: skip
    sol = odeckpt.solve(
        lotka_volterra, Y0, (0.0, 10.0), PARAMS, rtol=1e-8, atol=1e-8, saveat=ts,
        solver=odeckpt.Reversible(odeckpt.Tsit5()),
    )  # fmt: skip
    assert sol.status == odeckpt.Status.successful
    np.testing.assert_allclose(sol.ys, reference.ys, rtol=1e-5)
    dense = odeckpt.solve(
        lotka_volterra, Y0, (0.0, 10.0), PARAMS, rtol=1e-8, atol=1e-8,
        saveat=odeckpt.SaveAt(dense=True), solver=odeckpt.Reversible(odeckpt.Tsit5()),
    )  # fmt: skip
    middle = jax.vmap(dense.evaluate)(ts[1:-1] + 0.37)
    expected = odeckpt.solve(lotka_volterra, Y0, (0.0, 10.0), PARAMS, rtol=1e-12, atol=1e-12,
                             saveat=ts[1:-1] + 0.37).ys  # fmt: skip
    np.testing.assert_allclose(middle, expected, rtol=1e-4)


@pytest.mark.slow
def test_gradients_equal_across_adjoints_and_finite_differences():
    solver = odeckpt.Reversible(odeckpt.Tsit5())

    def loss(params, adjoint):
        sol = odeckpt.solve(lotka_volterra, Y0, (0.0, 5.0), params, rtol=1e-8, atol=1e-8,
                            solver=solver, adjoint=adjoint)  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    direct = jax.grad(loss)(PARAMS, "direct")
    recursive = jax.grad(loss)(PARAMS, "recursive")
    forward = jax.jacfwd(loss)(PARAMS, "forward")
    np.testing.assert_allclose(recursive, direct, rtol=1e-10)
    np.testing.assert_allclose(forward, direct, rtol=1e-10)
    h = 1e-6
    for k in range(4):
        e = jnp.zeros(4).at[k].set(h * PARAMS[k])
        difference = (loss(PARAMS + e, "direct") - loss(PARAMS - e, "direct")) / (2 * e[k])
        np.testing.assert_allclose(direct[k], difference, rtol=1e-5)


def test_vmap_lanes_equal_solo_lanes():
    solver = odeckpt.Reversible(odeckpt.Dopri5(), 0.99)
    params = jnp.stack([PARAMS, 1.1 * PARAMS, 0.9 * PARAMS])

    def one(p):
        sol = odeckpt.solve(lotka_volterra, Y0, (0.0, 5.0), p, solver=solver)
        return sol.ys[-1], sol.stats.num_steps

    ys, steps = jax.vmap(one)(params)
    for lane in range(3):
        y, n = one(params[lane])
        np.testing.assert_allclose(ys[lane], y, rtol=1e-12)
        assert int(steps[lane]) == int(n)


def test_pytree_float32_state_and_a_failing_vector_field():
    def field(t, y, args):
        dx = -y["x"] * jnp.where(t > 0.5, jnp.nan, 1.0)
        return {"x": dx, "v": -0.5 * y["v"]}

    y0 = {"x": jnp.ones(2, jnp.float32), "v": jnp.ones(3, jnp.float32)}
    solver = odeckpt.Reversible(odeckpt.Bosh3())
    ok = odeckpt.solve(lambda t, y, a: jax.tree.map(jnp.negative, y), y0, (0.0, 1.0),
                       solver=solver)  # fmt: skip
    assert ok.ys["v"].dtype == jnp.float32
    np.testing.assert_allclose(ok.ys["v"][-1], np.exp(-1.0), rtol=1e-4)
    sol = odeckpt.solve(field, y0, (0.0, 1.0), solver=solver, throw=False)
    assert sol.status == odeckpt.Status.nonfinite
    grad = jax.grad(
        lambda y: jnp.sum(
            odeckpt.solve(field, y, (0.0, 1.0), solver=solver, throw=False).ys["v"]
        )  # fmt: skip
    )(y0)
    assert bool(jnp.all(jnp.isnan(grad["v"])))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: odeckpt.Reversible(odeckpt.Tsit5(), coupling=0.0), r"\(0, 1\]"),
        (lambda: odeckpt.Reversible(odeckpt.Tsit5(), coupling=1.5), r"\(0, 1\]"),
        (lambda: odeckpt.Reversible(odeckpt.Kvaerno5()), "explicit one-step"),
        (lambda: odeckpt.Reversible(odeckpt.BDF()), "explicit one-step"),
        (lambda: odeckpt.Reversible("tsit5"), "needs a stepper"),
        (lambda: odeckpt.ReversibleAdjoint(max_drift=0.0), "positive, finite"),
        (lambda: odeckpt.ReversibleAdjoint(max_drift=float("nan")), "positive, finite"),
    ],
)
def test_bad_configuration_is_refused_with_the_fix(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def _reversible_loss(params, adjoint, t1=5.0, solver=None, throw=True):
    solver = solver or odeckpt.Reversible(odeckpt.Tsit5())
    sol = odeckpt.solve(
        lotka_volterra, Y0, (0.0, t1), params, rtol=1e-8, atol=1e-8, solver=solver,
        adjoint=adjoint, saveat=odeckpt.SaveAt(ts=jnp.linspace(0.0, t1, 5), t1=True),
        max_steps=16384, throw=throw,
    )  # fmt: skip
    return jnp.sum(sol.ys**2)


def test_the_reversible_adjoint_equals_direct_over_ten_thousand_steps():
    """A harmonic oscillator over t in [0, 1000] with coupling 0.9999: about 12,800 steps undone
    one by one. (On Lotka-Volterra the coupled scheme needs ever smaller steps to stay stable
    at a coupling close to 1, and a coupling far from 1 amplifies the reconstruction's
    round-off as `c**-n`: see docs/concepts.md.)"""

    def oscillator(t, y, w):
        return jnp.stack([w * y[1], -w * y[0]])

    def loss(w, adjoint):
        sol = odeckpt.solve(
            oscillator, jnp.array([1.0, 0.0]), (0.0, 1000.0), w, rtol=1e-8, atol=1e-8,
            solver=odeckpt.Reversible(odeckpt.Tsit5(), 0.9999), adjoint=adjoint,
            max_steps=16384,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1] * jnp.array([1.0, 2.0])), sol.stats.num_accepted_steps

    ours, steps = jax.grad(loss, has_aux=True)(1.3, "reversible")
    ref, _ = jax.grad(loss, has_aux=True)(1.3, "direct")
    assert int(steps) > 10_000
    np.testing.assert_allclose(ours, ref, rtol=1e-10)


def test_the_reversible_adjoint_differentiates_y0_the_span_and_save_times():
    def loss(y0, t1, ts, adjoint):
        sol = odeckpt.solve(
            lotka_volterra, y0, (0.0, t1), PARAMS, rtol=1e-8, atol=1e-8, saveat=ts,
            solver=odeckpt.Reversible(odeckpt.Dopri5(), 0.99), adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    ts = jnp.array([0.0, 1.5, 1.5, 3.0])
    ours = jax.grad(loss, argnums=(0, 1, 2))(Y0, 3.0, ts, "reversible")
    ref = jax.grad(loss, argnums=(0, 1, 2))(Y0, 3.0, ts, "direct")
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_a_complex_state_over_a_zero_length_span():
    """`y = y0 exp(i (t1 - t0))` at `t1 = t0`: the derivatives of `Re y + 2 Im y` in `t1` and
    `t0` are `+-(2 Re y0 - Im y0)`, from the exact solution (no step is taken to carry them)."""

    def loss(t0, t1):
        sol = odeckpt.solve(
            lambda t, y, args: 1j * y, jnp.array([1.0 + 0.5j]), (t0, t1),
            solver=odeckpt.Reversible(odeckpt.Tsit5()), adjoint="reversible",
        )  # fmt: skip
        return jnp.sum(jnp.real(sol.ys) + 2 * jnp.imag(sol.ys))

    d_t0, d_t1 = jax.grad(loss, argnums=(0, 1))(0.3, 0.3)
    np.testing.assert_allclose([d_t0, d_t1], [-1.5, 1.5], rtol=1e-12)


@pytest.mark.slow
def test_the_reversible_adjoint_under_vmap_equals_solo_lanes():
    params = jnp.stack([PARAMS, 1.1 * PARAMS, 0.8 * PARAMS])
    grad = jax.grad(_reversible_loss)
    batched = jax.vmap(lambda p: grad(p, "reversible"))(params)
    for lane in range(3):
        np.testing.assert_allclose(batched[lane], grad(params[lane], "reversible"), rtol=1e-12)


def test_the_drift_and_the_undone_steps_are_reported():
    records = []
    adjoint = odeckpt.ReversibleAdjoint(on_backward=records.append)
    solver = odeckpt.Reversible(odeckpt.Tsit5(), coupling=0.99)

    def loss(params):
        sol = odeckpt.solve(
            lotka_volterra, Y0, (0.0, 2.0), params, rtol=1e-8, atol=1e-8, solver=solver,
            adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys**2), sol.stats.num_accepted_steps

    _, steps = jax.grad(loss, has_aux=True)(PARAMS)
    jax.effects_barrier()
    (record,) = records
    assert record["num_undone_steps"] == int(steps) > 10
    assert record["succeeded"] is True
    assert 0 <= record["drift"] <= 100 * np.finfo(np.float64).eps ** 0.75


def test_a_drifting_reconstruction_is_a_nan_gradient_and_an_error():
    """A coupling of 0.5 doubles the round-off at every undone step: after a few dozen steps
    the reconstruction is garbage, and the gradient must not pretend otherwise."""
    solver = odeckpt.Reversible(odeckpt.Tsit5(), coupling=0.5)
    records = []
    adjoint = odeckpt.ReversibleAdjoint(on_backward=records.append)
    grad = jax.grad(_reversible_loss)(PARAMS, adjoint, 20.0, solver, False)
    jax.effects_barrier()
    assert bool(jnp.all(jnp.isnan(grad)))
    assert records[0]["succeeded"] is False
    assert not records[0]["drift"] <= 100 * np.finfo(np.float64).eps ** 0.75
    with pytest.raises(Exception, match="did not return to y0"):
        jax.block_until_ready(jax.grad(_reversible_loss)(PARAMS, "reversible", 20.0, solver))


@pytest.mark.slow
def test_the_reversible_adjoints_memory_does_not_grow_with_the_steps():
    """A 256-point heat equation: from 10^3 to 10^6 steps the compiled gradient's temporaries
    grow only by the ~30 bytes per step of records, where recursive checkpointing's grow by
    states (its default keeps more checkpoints for more steps) and DirectAdjoint's by a state
    per step."""

    def heat(t, u, k):
        return k * (jnp.roll(u, 1) + jnp.roll(u, -1) - 2 * u)

    u0 = jnp.sin(jnp.linspace(0.0, np.pi, 256))

    def temp(adjoint, max_steps):
        def loss(k):
            sol = odeckpt.solve(
                heat, u0, (0.0, 1.0), k, solver=odeckpt.Reversible(odeckpt.RK4()),
                controller=odeckpt.ConstantStep(), dt0=1e-3, adjoint=adjoint,
                max_steps=max_steps,
            )  # fmt: skip
            return jnp.sum(sol.ys**2)

        return odeckpt.compiled_memory(jax.grad(loss), jnp.array(0.1)).temp

    state = 256 * 8
    reversible = {n: temp("reversible", n) for n in (10**3, 10**6)}
    assert reversible[10**6] - reversible[10**3] <= 40 * (10**6 - 10**3)  # records, no states
    # Recursive checkpointing keeps records of its own, and more checkpoints for more steps.
    states = {n: temp("recursive", n) - reversible[n] for n in (10**3, 10**6)}
    assert states[10**6] - states[10**3] >= 100 * state
    direct = temp("direct", 16000) - temp("direct", 1000)
    assert direct >= 2 * state * 15000


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(solver="tsit5"), "is not one"),
        (dict(event=odeckpt.Event(lambda t, y, a: y[0] - 1.0)), "events"),
        (dict(jump_ts=jnp.array([0.5])), "jump_ts"),
    ],
)
def test_what_the_reversible_adjoint_cannot_undo_is_refused(keywords, match):
    keywords = dict(solver=odeckpt.Reversible(odeckpt.Tsit5())) | keywords
    solve = lambda p: odeckpt.solve(
        lotka_volterra, Y0, (0.0, 1.0), p, adjoint="reversible", **keywords
    ).ys.sum()
    with pytest.raises(ValueError, match=match):
        jax.grad(solve)(PARAMS)
    with pytest.raises(Exception, match="adjoint='forward'"):
        jax.jacfwd(_reversible_loss)(PARAMS, "reversible")


@pytest.mark.slow
def test_the_reversible_adjoint_equals_direct_on_a_small_neural_ode():
    """An MLP vector field (2 -> 16 -> 2, tanh), the gradient with respect to all its weights."""
    key = jax.random.PRNGKey(0)
    k1, k2 = jax.random.split(key)
    weights = {
        "w1": 0.5 * jax.random.normal(k1, (16, 2)), "b1": jnp.zeros(16),
        "w2": 0.5 * jax.random.normal(k2, (2, 16)), "b2": jnp.zeros(2),
    }  # fmt: skip

    def mlp(t, y, w):
        return w["w2"] @ jnp.tanh(w["w1"] @ y + w["b1"]) + w["b2"] - 0.1 * y

    def loss(w, adjoint):
        sol = odeckpt.solve(
            mlp, jnp.array([1.0, -0.5]), (0.0, 5.0), w, rtol=1e-8, atol=1e-8,
            saveat=jnp.linspace(0.0, 5.0, 6), adjoint=adjoint,
            solver=odeckpt.Reversible(odeckpt.Tsit5(), 0.99),
        )  # fmt: skip
        return jnp.sum(sol.ys**2)

    ours = jax.grad(loss)(weights, "reversible")
    ref = jax.grad(loss)(weights, "direct")
    for name in weights:
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-9, atol=1e-12)
