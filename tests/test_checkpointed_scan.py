"""`checkpointed_scan` against `jax.grad` of `lax.scan` (float64, tolerance 1e-12)."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from selection import slow_unless

from odeckpt.checkpointing import checkpointed_scan, scan_plan
from odeckpt.checkpointing.schedules import offline_schedule, simulate


def _step(theta):
    def f(carry, x):
        y, s = carry["y"], carry["s"]
        y2 = jnp.sin(y) * x["a"] + theta * jnp.roll(y, 1) + 0.1 * s
        s2 = 0.9 * s + 0.05 * jnp.sum(y2 * x["b"])
        return {"y": y2, "s": s2, "k": carry["k"] + 1}, (y2[0] * s2, {"z": y2 * x["b"]})

    return f


def _problem(n, dim, seed):
    rng = np.random.default_rng(seed)
    init = {"y": jnp.asarray(rng.normal(size=dim)), "s": jnp.asarray(0.3), "k": jnp.asarray(0)}
    xs = {"a": jnp.asarray(rng.uniform(0.5, 1.2, n)), "b": jnp.asarray(rng.normal(size=(n, dim)))}
    return init, xs, jnp.asarray(0.7)


def _loss(scan):
    def loss(init, xs, theta):
        carry, (y0, z) = scan(_step(theta), init, xs)
        w = jnp.arange(1, y0.shape[0] + 1)
        return jnp.sum(carry["y"] ** 2) + carry["s"] + jnp.sum(y0 * w) + jnp.sum(z["z"] ** 3)

    return loss


def _assert_close(a, b, tol=1e-12):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jnp.issubdtype(u.dtype, jnp.inexact):
            scale = max(1.0, float(jnp.max(jnp.abs(v))))
            np.testing.assert_allclose(u, v, rtol=0, atol=tol * scale)
        else:
            np.testing.assert_array_equal(u, v)


def _grads(scan, init, xs, theta):
    init_f = {"y": init["y"], "s": init["s"]}

    def loss(init_f, xs, theta):
        return _loss(scan)({**init_f, "k": init["k"]}, xs, theta)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(init_f, xs, theta)


def _check(n, dim, c, seed=0):
    init, xs, theta = _problem(n, dim, seed)
    ref = _grads(jax.lax.scan, init, xs, theta)
    got = _grads(lambda f, i, x: checkpointed_scan(f, i, x, checkpoints=c), init, xs, theta)
    # The step compiled inside another loop body may round differently (XLA fuses it
    # differently), and this problem amplifies rounding with n: seen 1.9e-12 relative at
    # n = 40, 1.3e-11 at n = 88 and 4.2e-11 at n = 62 against `lax.scan`. A wrong gradient is
    # off by far more.
    _assert_close(got, ref, tol=1e-12 if n <= 10 else 2e-10)


def test_outputs_equal_lax_scan():
    init, xs, theta = _problem(20, 3, 0)
    for c in (1, 3, 20):
        out = jax.jit(lambda i, x, c=c: checkpointed_scan(_step(theta), i, x, checkpoints=c))
        _assert_close(out(init, xs), jax.lax.scan(_step(theta), init, xs))


# Gradients against lax.scan's by default: each regime in
# test_a_plan_made_once_runs_the_scan_as_its_arguments_do, and test_single_step.
@pytest.mark.slow
def test_every_c_for_n_8():
    for c in range(1, 9):
        _check(8, 3, c)


@pytest.mark.slow
def test_every_c_for_n_40():
    """Every c gives the same numbers; they match lax.scan as closely as lax.scan's own variants.

    Over 40 steps, float64 rounding (XLA fuses the recomputed step differently) reaches ~1e-12
    relative: `lax.scan(..., unroll=40)` differs from `lax.scan` by as much. The tolerance is
    1e-12, or twice that spread where it is larger.
    """
    init, xs, theta = _problem(40, 2, 0)
    ref = _grads(jax.lax.scan, init, xs, theta)
    unrolled = _grads(lambda f, i, x: jax.lax.scan(f, i, x, unroll=40), init, xs, theta)
    spread = max(_rel_err(unrolled, ref), 0.5e-12)
    first = None
    for c in range(1, 41):
        got = _grads(
            lambda f, i, x, c=c: checkpointed_scan(f, i, x, checkpoints=c), init, xs, theta
        )
        assert _rel_err(got, ref) <= 2 * spread, c
        first = got if first is None else first
        assert _rel_err(got, first) <= 1e-15, c  # the schedule does not change the numerics


def _rel_err(a, b):
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(
        float(jnp.max(jnp.abs(u - v))) / max(1.0, float(jnp.max(jnp.abs(v)))) for u, v in pairs
    )


def test_single_step():
    _check(1, 2, 1)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 200), dim=st.integers(1, 4), frac=st.floats(0, 1), seed=st.integers(0, 99))
def test_random_lengths_and_checkpoints(n, dim, frac, seed):
    _random_case(n, dim, frac, seed)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 200), dim=st.integers(1, 4), frac=st.floats(0, 1), seed=st.integers(0, 99))
def test_random_lengths_and_checkpoints_many(n, dim, frac, seed):
    _random_case(n, dim, frac, seed)


def _random_case(n, dim, frac, seed):
    c = 1 + int(frac * (n - 1)) if n > 1 else 1
    if c == 1:
        n = min(n, 60)  # quadratic recomputation: keep the test fast
    _check(n, dim, c, seed)


# The same regimes, planned, by default: test_a_plan_made_once_runs_the_scan_as_its_arguments_do.
@pytest.mark.slow
def test_default_and_budget_regimes_agree():
    init, xs, theta = _problem(50, 3, 1)
    ref = _grads(jax.lax.scan, init, xs, theta)
    for kw in [{}, {"memory_budget": "1GB"}, {"memory_budget": 600}, {"memory_budget": 100}]:
        got = _grads(lambda f, i, x, kw=kw: checkpointed_scan(f, i, x, **kw), init, xs, theta)
        _assert_close(got, ref)


def test_plan_reports_regime():
    init, xs, theta = _problem(50, 3, 1)
    f = _step(theta)
    assert scan_plan(f, init, xs).regime == "residuals"
    assert scan_plan(f, init, xs, checkpoints=60).regime == "states"
    p = scan_plan(f, init, xs, checkpoints=5)
    assert (p.regime, p.checkpoints) == ("binomial", 5)
    assert scan_plan(f, init, xs, memory_budget=200).regime == "binomial"


@pytest.mark.slow
def test_a_plan_made_once_runs_the_scan_as_its_arguments_do():
    init, xs, theta = _problem(50, 3, 1)
    ref = _grads(jax.lax.scan, init, xs, theta)
    f = _step(theta)
    for kw in ({}, {"checkpoints": 5}, {"checkpoints": 60}, {"memory_budget": 200},
               {"checkpoints": {"device": 2, "host": 7}, "offload": "host"}):  # fmt: skip
        plan = scan_plan(f, init, xs, **kw)
        planned = lambda f, i, x, plan=plan: checkpointed_scan(f, i, x, plan=plan)
        _assert_close(_grads(planned, init, xs, theta), ref)


def test_plan_errors_name_the_fix():
    init, xs, theta = _problem(50, 3, 1)
    f = _step(theta)
    plan = scan_plan(f, init, xs, checkpoints=5)
    for kw in ({"checkpoints": 5}, {"memory_budget": "1MB"}, {"offload": "host"}):
        with pytest.raises(ValueError, match=f"plan= or {next(iter(kw))}, not both"):
            checkpointed_scan(f, init, xs, plan=plan, **kw)
    with pytest.raises(ValueError, match="made for 50 steps and this loop runs 40"):
        checkpointed_scan(f, init, jax.tree.map(lambda x: x[:40], xs), plan=plan)
    wider, _, _ = _problem(50, 4, 1)
    with pytest.raises(ValueError, match="snapshots of 40 bytes and this loop's hold 48"):
        checkpointed_scan(_step(theta), wider, xs | {"b": jnp.ones((50, 4))}, plan=plan)
    with pytest.raises(TypeError, match=r"plan must be a Plan, as scan_plan\(...\)"):
        checkpointed_scan(f, init, xs, plan=5)


_COUNT = [0]


def _bump():
    _COUNT[0] += 1


def _counted(carry, x):
    jax.debug.callback(_bump)
    return jnp.sin(carry) * x + 0.1 * carry, carry[0]


def _count(fn, *args):
    fn(*args)  # compile
    _COUNT[0] = 0
    jax.block_until_ready(fn(*args))
    return _COUNT[0]


@pytest.mark.parametrize(
    ("n", "c"), slow_unless([(30, 4), (100, 3), (64, 64), (50, 1), (7, 2)], fast={(64, 64), (7, 2)})
)
def test_step_evaluations_match_simulator(n, c):
    xs = jnp.linspace(0.5, 1.5, n)
    loss = lambda y0: checkpointed_scan(_counted, y0, xs, checkpoints=c)[0].sum()
    count = _count(jax.jit(jax.grad(loss)), jnp.ones(3))
    assert count == simulate(offline_schedule(n, c), n).step_evaluations
    batched = _count(jax.jit(jax.vmap(jax.grad(loss))), jnp.ones((4, 3)))
    assert batched == count  # lockstep: no select evaluating both branches


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _scan_memory(n, c, dim=1000):
    def f(y, _):
        return jnp.sin(y) * 1.01 + 0.1, None

    loss = lambda y0: checkpointed_scan(f, y0, length=n, checkpoints=c)[0].sum()
    return _temp_bytes(jax.grad(loss), jnp.ones(dim))


def test_memory_flat_in_n():
    m3, m4, m5 = (_scan_memory(n, 8) for n in (10**3, 10**4, 10**5))
    assert m4 <= 1.1 * m3 and m5 <= 1.1 * m3, (m3, m4, m5)


def test_memory_about_linear_in_c():
    dim = 2**14
    m = {c: _scan_memory(1000, c, dim) for c in (4, 8, 16, 32)}
    per_snapshot = dim * 8
    slopes = [(m[b] - m[a]) / ((b - a) * per_snapshot) for a, b in [(4, 8), (8, 16), (16, 32)]]
    assert all(0.9 <= s <= 1.1 for s in slopes), (m, slopes)


def _user_report(scan, n, **kw):
    """ "jax.grad of my lax.scan stores every (y + z): 557 MB for 5 steps, 908 MB for 10"."""
    z = jnp.ones((1000, 1000))

    def f(y, x):
        return y + x * (y + z) * 1e-3, None

    def loss(xs):
        return scan(f, jnp.zeros((1000, 1000)), xs, **kw)[0].sum()

    return _temp_bytes(jax.grad(loss), jnp.ones(n))


# The same claim by default: test_memory_report.py's lax.scan against checkpointed_scan.
@pytest.mark.slow
def test_user_report_memory_flat_with_checkpointed_scan():
    plain = [_user_report(jax.lax.scan, n) for n in (5, 10, 20)]
    ours = [_user_report(checkpointed_scan, n, checkpoints=2) for n in (5, 10, 20)]
    state = 1000 * 1000 * 8
    assert plain[2] - plain[1] >= 9 * state  # lax.scan: one (y + z) per step
    assert ours[2] <= 1.1 * ours[0], ours
    assert ours[2] < plain[1]


def test_errors_name_the_fix():
    xs = jnp.ones((5, 2))
    with pytest.raises(ValueError, match="checkpoints=1"):
        checkpointed_scan(lambda c, x: (c, None), jnp.ones(2), xs, checkpoints=0)
    with pytest.raises(TypeError, match="same structure, shapes and dtypes"):
        checkpointed_scan(lambda c, x: (c[:1], None), jnp.ones(2), xs, checkpoints=2)
    with pytest.raises(TypeError, match="same structure, shapes and dtypes"):
        checkpointed_scan(lambda c, x: (c.astype(jnp.float32), None), jnp.ones(2), xs)
    with pytest.raises(TypeError, match="pytree structure"):
        checkpointed_scan(lambda c, x: ((c, c), None), jnp.ones(2), xs)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        checkpointed_scan(lambda c, x: (c * x, None), jnp.ones(2), xs, memory_budget=8)
    with pytest.raises(ValueError, match="memory_budget"):
        checkpointed_scan(lambda c, x: (c * x, None), jnp.ones(2), xs, memory_budget="lots")
    with pytest.raises(ValueError, match="one length"):
        checkpointed_scan(lambda c, x: (c, None), jnp.ones(2), xs, length=3)


@pytest.mark.parametrize("c", [2, 20])
def test_forward_mode(c):
    init, xs, theta = _problem(20, 3, 2)
    init = {"y": init["y"], "s": init["s"], "k": init["k"]}
    tangents = (
        jax.tree.map(jnp.ones_like, {"y": init["y"], "s": init["s"]}),
        jax.tree.map(lambda x: 0.1 * x, xs),
    )

    def run(scan):
        def g(init_f, xs):
            return scan(_step(theta), {**init_f, "k": init["k"]}, xs)

        return jax.jit(lambda t: jax.jvp(g, ({"y": init["y"], "s": init["s"]}, xs), t))

    got = run(lambda f, i, x: checkpointed_scan(f, i, x, checkpoints=c))(tangents)
    _assert_close(got, run(jax.lax.scan)(tangents))


# vmap of the gradient by default: the step counts of test_step_evaluations_match_simulator,
# test_forward_mode_of_a_closed_over_python_float_under_vmap and test_layers.py's
# test_checkpointed_scan_keeps_unbatched_outputs_unbatched_under_vmap (against lax.scan).
@pytest.mark.slow
def test_vmap_of_grad_and_jacfwd():
    xs = jnp.linspace(0.5, 1.5, 20)
    loss = lambda y0, c: checkpointed_scan(_counted_free, y0, xs, checkpoints=c)[0]
    ref = lambda y0: jax.lax.scan(_counted_free, y0, xs)[0]
    y0s = jnp.stack([jnp.ones(3), 2 * jnp.ones(3)])
    got = jax.vmap(jax.grad(lambda y: loss(y, 3).sum()))(y0s)
    _assert_close(got, jax.vmap(jax.grad(lambda y: ref(y).sum()))(y0s))
    _assert_close(jax.jacfwd(lambda y: loss(y, 3))(y0s[0]), jax.jacrev(ref)(y0s[0]))


def _counted_free(carry, x):
    return jnp.sin(carry) * x + 0.1 * carry, carry[0]


def test_program_size_independent_of_n_and_c():
    """One loop body with one step and one VJP: the traced program does not grow with n or c."""

    def f(carry, _):
        return jnp.sin(carry) * 1.01, carry[0]

    def lines(n, c):
        loss = lambda y0: checkpointed_scan(f, y0, length=n, checkpoints=c)[0].sum()
        return str(jax.make_jaxpr(jax.grad(loss))(jnp.ones(3))).count(" = ")  # equations

    assert lines(100, 3) == lines(10_000, 3) == lines(10_000, 40)


def _closing_over(x, checkpoints):
    """A scan whose body closes over `x` (the differentiated input), a Python int and a
    Python float."""
    k, c = 3, 2.5

    def body(carry, _):
        return jnp.sin(carry) * c + x * k, None

    return checkpointed_scan(body, jnp.full(2, 0.5), None, length=6, checkpoints=checkpoints)[0]


def _assert_derivatives_agree(loss, x):
    """`jacfwd == jacrev`, both equal to central finite differences and nonzero."""
    fwd, rev = jax.jacfwd(loss)(x), jax.jacrev(loss)(x)
    _assert_close(fwd, rev)
    h, basis = 1e-6, jnp.eye(jnp.size(x)).reshape(-1, *jnp.shape(x))
    fd = jnp.stack([(loss(x + h * e) - loss(x - h * e)) / (2 * h) for e in basis], -1)
    np.testing.assert_allclose(fwd, fd.reshape(jnp.shape(fwd)), rtol=1e-7)
    assert float(jnp.max(jnp.abs(fwd))) > 1.0


# jacfwd runs no schedule; the states regime's reverse sweep (6) is checked against lax.scan
# by test_a_plan_made_once_runs_the_scan_as_its_arguments_do: 6 runs with -m slow.
@pytest.mark.parametrize("checkpoints", slow_unless([2, 6], fast={2}))
@pytest.mark.parametrize(
    "x", [1.3, pytest.param(jnp.asarray(1.3), marks=pytest.mark.slow),
          pytest.param(np.float64(1.3), marks=pytest.mark.slow), jnp.array([1.3, 0.4])],
    ids=["python float", "weak scalar", "numpy scalar", "array"],
)  # fmt: skip
def test_forward_mode_of_a_closed_over_value(x, checkpoints):
    """The tangent of a closed-over input reaches the forward-mode loop, whatever its type (a
    Python float reaches the custom JVP rule as the float itself)."""
    loss = lambda x: jnp.sum(_closing_over(x, checkpoints) * jnp.array([1.0, -0.5]))
    _assert_derivatives_agree(loss, x)


def test_forward_mode_of_a_closed_over_python_float_under_vmap():
    loss = lambda x: jnp.sum(_closing_over(x, 2) * jnp.array([1.0, -0.5]))
    ts = jnp.array([1.0, -2.0])  # a batch of tangents of one Python float
    jvps = jax.vmap(lambda t: jax.jvp(loss, (1.3,), (t,))[1])(ts)
    _assert_close(jvps, ts * jax.grad(loss)(1.3))
    xs = jnp.array([1.3, 0.2])
    _assert_close(jax.vmap(jax.jacfwd(loss))(xs), jax.vmap(jax.grad(loss))(xs))
