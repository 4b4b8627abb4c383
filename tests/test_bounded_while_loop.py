"""`bounded_while_loop` against an unrolled early-exit reference (float64, tolerance 1e-12)."""

import math
import re
import tracemalloc

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from selection import slow_unless

from odeckpt._autodiff import _tree, forward_only
from odeckpt.checkpointing import (
    bounded_while_loop,
    recomputed_steps,
    schedules,
    while_loop_plan,
)
from odeckpt.checkpointing._vmap import lane_running
from odeckpt.checkpointing.schedules import offline_schedule, online_schedule, simulate

_COUNT = [0]


def _bump():
    _COUNT[0] += 1


def _problem(theta, count=False):
    """A toy adaptive integrator: stop when y reaches 5; write (t, y) to slot `i`."""

    def cond(v):
        return v["y"][0] < 5.0

    def body(v):
        if count:
            jax.debug.callback(_bump)
        y, i = v["y"], v["i"]
        dy = jnp.stack([theta * jnp.exp(-0.1 * y[0]) + 0.05 * y[1], jnp.cos(theta * y[0])])
        y2 = y + 0.3 * dy
        write = (jnp.stack([i, i + 100]), {"y": jnp.stack([y2, y2]), "t": jnp.stack([y2[1]] * 2)})
        return {"y": y2, "i": i + 1}, write

    return cond, body


def _init(y0):
    return {"y": jnp.stack([y0, jnp.asarray(0.5)]), "i": jnp.asarray(0, jnp.int32)}


def _buffers():
    return {"y": jnp.full((30, 2), 0.25), "t": jnp.linspace(0.0, 1.0, 30)}


def _reference(theta, y0, buffers, max_steps):
    cond, body = _problem(theta)
    v = _init(y0)
    for _ in range(max_steps):
        if not cond(v):
            break
        v, (idx, values) = body(v)
        buffers = jax.tree.map(lambda b, x, i=idx: b.at[i].set(x, mode="drop"), buffers, values)
    return v, buffers


def _ours(theta, y0, buffers, max_steps, **kw):
    cond, body = _problem(theta)
    return bounded_while_loop(cond, body, _init(y0), max_steps=max_steps, outputs=buffers, **kw)


def _loss(run):
    w = {"y": jnp.arange(60.0).reshape(30, 2) / 50, "t": jnp.arange(30.0) / 9}

    def loss(theta, y0, buffers):
        v, b = run(theta, y0, buffers)
        return jnp.sum(v["y"] ** 2) + sum(jnp.sum(b[k] * w[k] ** 2) for k in b)

    return loss


def _assert_close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(v))))
        np.testing.assert_allclose(u, v, rtol=0, atol=1e-12 * scale)


def _grad(run, *args):
    return jax.value_and_grad(_loss(run), argnums=(0, 1, 2))(*args)


# stops early / hits max_steps; an early stop is also what every adaptive solve's gradient does
# in test_adjoints.py (recursive equals direct), so that case runs with -m slow.
@pytest.mark.parametrize("max_steps", [pytest.param(40, marks=pytest.mark.slow), 12])
def test_matches_unrolled_reference(max_steps):
    args = (jnp.asarray(0.8), jnp.asarray(0.1), _buffers())
    ref = _grad(lambda *a: _reference(*a, max_steps), *args)
    options = [{"checkpoints": c} for c in (1, 3, 40)] + [{}, {"memory_budget": 200}]
    for kw in [*options, {"checkpoints": 3, "pack_state": True}]:
        run = jax.jit(lambda *a, kw=kw: _ours(*a, max_steps, **kw))
        _assert_close(jax.tree.leaves(run(*args)), jax.tree.leaves(_reference(*args, max_steps)))
        _assert_close(_grad(run, *args), ref)


# A loop without outputs, by default: the nested vmap, forward mode and the recorded decisions.
@pytest.mark.slow
def test_without_outputs():
    cond, body = _problem(0.8)
    f = lambda v: body(v)[0]
    run = lambda y0: bounded_while_loop(cond, f, _init(y0), max_steps=50, checkpoints=3)["y"]
    ref = lambda y0: _reference(0.8, y0, _buffers(), 50)[0]["y"]
    _assert_close(run(0.1), ref(0.1))
    _assert_close(jax.jacrev(run)(0.1), jax.jacrev(ref)(0.1))


def test_zero_steps():
    cond = lambda v: v < 0.0
    out = bounded_while_loop(cond, lambda v: v + 1.0, 1.0, max_steps=5, checkpoints=2)
    assert out == 1.0
    g = jax.grad(lambda v: bounded_while_loop(cond, lambda v: v * 2, v, max_steps=5))(1.0)
    assert g == 1.0


# Lanes stopping apart under vmap, by default: the nested vmap's values and gradients and the
# step counts of the vmap in test_step_evaluations_match_simulator_and_vmap_does_not_double.
@pytest.mark.slow
def test_vmap_lockstep_matches_per_lane():
    y0s = jnp.array([0.1, 2.5, 4.0, 6.0])  # the last lane never runs
    args = (jnp.asarray(0.8), y0s, _buffers())
    for kw in ({"checkpoints": 3}, {}, {"checkpoints": 3, "pack_state": True}):
        run = lambda th, y0, b, kw=kw: _ours(th, y0, b, 40, **kw)
        batched = jax.jit(
            jax.vmap(jax.value_and_grad(_loss(run), argnums=(0, 1, 2)), (None, 0, None))
        )
        got = batched(*args)
        for lane, y0 in enumerate(y0s):
            ref = _grad(lambda *a: _reference(*a, 40), args[0], y0, args[2])
            _assert_close(jax.tree.map(lambda x, lane=lane: x[lane], got), ref)


def test_lane_running():
    """Outside `vmap` a step is always real (the constant `True`); wherever a `vmap` batches the
    predicate, nested ones included, the predicate itself."""
    assert bool(lane_running(jnp.array(False)))
    preds = jnp.array([True, False])
    assert jax.vmap(lane_running)(preds).tolist() == [True, False]
    inner = jax.vmap(lambda p, x: lane_running(p) & (x == x), in_axes=(None, 0))
    nested = jax.vmap(inner, in_axes=(0, None))(preds, jnp.zeros(3))
    assert nested.tolist() == [[True] * 3, [False] * 3]


def test_nested_vmap_with_the_predicate_batched_by_the_outer_one():
    """The inner `vmap` leaves the predicate unbatched, the outer one batches it: lanes that
    finish early keep their values while the others step on."""

    def run(start, scale):
        cond = lambda v: v[0] < 3.0
        body = lambda v: (v[0] + 1.0, v[1] * scale)
        return bounded_while_loop(cond, body, (start, 1.0), max_steps=10, checkpoints=2)[1]

    starts, scales = jnp.array([0.0, 2.0]), jnp.array([1.5, 2.0, 3.0])
    nested = jax.vmap(jax.vmap(run, in_axes=(None, 0)), in_axes=(0, None))(starts, scales)
    expected = [[float(s) ** 3 for s in scales], [float(s) for s in scales]]
    np.testing.assert_allclose(nested, expected)
    grads = jax.vmap(jax.vmap(jax.grad(run, argnums=1), in_axes=(None, 0)), in_axes=(0, None))
    expected = [[3 * float(s) ** 2 for s in scales], [1.0] * 3]
    np.testing.assert_allclose(grads(starts, scales), expected)


def _count(fn, *args):
    fn(*args)
    _COUNT[0] = 0
    jax.block_until_ready(fn(*args))
    return _COUNT[0]


def _steps_taken(y0, max_steps=60):
    return int(_reference(0.8, y0, _buffers(), max_steps)[0]["i"])


@pytest.mark.parametrize("c", slow_unless([2, 3, 6], fast={3}))
def test_step_evaluations_match_simulator_and_vmap_does_not_double(c):
    def loss(y0):
        cond, body = _problem(0.8, count=True)
        v, b = bounded_while_loop(
            cond, body, _init(y0), max_steps=60, checkpoints=c, outputs=_buffers()
        )
        return jnp.sum(v["y"]) + jnp.sum(b["t"])

    schedule = online_schedule(60, c)
    for y0 in (0.1, 3.0):
        count = _count(jax.jit(jax.grad(loss)), jnp.asarray(y0))
        assert count == simulate(schedule, _steps_taken(y0)).step_evaluations
    y0s = jnp.array([0.1, 3.0, 2.0])
    batched = _count(jax.jit(jax.vmap(jax.grad(loss))), y0s)
    assert batched == simulate(schedule, _steps_taken(0.1)).step_evaluations  # the longest lane


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


# Also what test_gradient_memory.py checks of a solve (max_steps = n): -m slow here.
@pytest.mark.slow
def test_memory_flat_in_max_steps():
    def loss(y0, max_steps):
        f = lambda y: jnp.sin(y) * 1.01 + 0.1
        y = bounded_while_loop(lambda y: y[0] < 1e9, f, y0, max_steps=max_steps, checkpoints=8)
        return y.sum()

    m = [
        _temp_bytes(jax.grad(lambda y, s=s: loss(y, s)), jnp.ones(1000))
        for s in (10**3, 10**4, 10**5)
    ]
    assert m[1] <= 1.1 * m[0] and m[2] <= 1.1 * m[0], m


def test_buffers_are_not_snapshotted():
    def loss(y0, buffers, c):
        cond, body = _problem(0.8)
        v, b = bounded_while_loop(
            cond, body, _init(y0), max_steps=40, checkpoints=c, outputs=buffers
        )
        return jnp.sum(b["y"])

    big = {"y": jnp.zeros((20_000, 2)), "t": jnp.zeros(20_000)}
    m2, m8 = (_temp_bytes(jax.grad(lambda y, b, c=c: loss(y, b, c)), 0.1, big) for c in (2, 8))
    assert m8 - m2 < 20_000 * 8  # snapshots hold the 2-vector state, not the buffers


def test_plan_and_errors():
    cond, body = _problem(0.8)
    init = _init(jnp.asarray(0.1))
    default = while_loop_plan(cond, body, init, max_steps=100, outputs=_buffers())
    # the fewest snapshots c with C(c+2, 2) >= 100: C(15, 2) = 105
    assert default.regime == "binomial" and default.checkpoints == 13
    plan = while_loop_plan(cond, body, init, max_steps=100, checkpoints=4, outputs=_buffers())
    assert plan.online and plan.checkpoints == 4
    with pytest.raises(ValueError, match="max_steps must be a Python int >= 1"):
        bounded_while_loop(cond, body, init, max_steps=0, outputs=_buffers())
    with pytest.raises(ValueError, match="checkpoints=1"):
        bounded_while_loop(cond, body, init, max_steps=10, checkpoints=0, outputs=_buffers())
    with pytest.raises(ValueError, match="at least 20 bytes"):
        bounded_while_loop(cond, body, init, max_steps=10, memory_budget=8, outputs=_buffers())
    with pytest.raises(TypeError, match="body_fun must return"):
        bounded_while_loop(cond, lambda v: body(v)[0], init, max_steps=10, outputs=_buffers())
    bad_index = lambda v: (body(v)[0], (jnp.zeros((2, 1), jnp.int32), body(v)[1][1]))
    with pytest.raises(TypeError, match="index an int32 array"):
        bounded_while_loop(cond, bad_index, init, max_steps=10, outputs=_buffers())
    bad_values = lambda v: (body(v)[0], (jnp.zeros(3, jnp.int32), body(v)[1][1]))
    with pytest.raises(TypeError, match=r"k = 3"):
        bounded_while_loop(cond, bad_values, init, max_steps=10, outputs=_buffers())
    with pytest.raises(TypeError, match="same structure, shapes and dtypes as init_val"):
        bounded_while_loop(cond, lambda v: {**v, "i": 1.0}, init, max_steps=10)


# Every RecursiveCheckpointAdjoint solve runs its loop with plan=: -m slow here.
@pytest.mark.slow
def test_a_plan_made_once_runs_the_loop_as_its_arguments_do():
    """`bounded_while_loop(..., plan=while_loop_plan(...))` gives the values, gradients and
    statistics of the same loop given the budget, in every regime, also under `vmap`."""
    cond, body = _problem(0.8)
    theta, y0 = jnp.asarray(0.8), jnp.asarray(0.1)
    for kw in ({"checkpoints": 4}, {"checkpoints": 30}, {"memory_budget": "1MB", "online": False},
               {}, {"checkpoints": {"device": 2, "host": 5}, "offload": "host"}):  # fmt: skip
        plan = while_loop_plan(cond, body, _init(y0), max_steps=30, outputs=_buffers(), **kw)
        planned = jax.jit(_loss(lambda *a, plan=plan: _ours_planned(*a, plan)))
        ref = jax.jit(_loss(lambda *a, kw=kw: _ours(*a, max_steps=30, **kw)))
        _assert_close(planned(theta, y0, _buffers()), ref(theta, y0, _buffers()))
        thetas = jnp.array([0.8, 1.3])
        batched = jax.vmap(planned, in_axes=(0, None, None))(thetas, y0, _buffers())
        _assert_close(batched, jax.vmap(ref, in_axes=(0, None, None))(thetas, y0, _buffers()))
    assert plan.regime == "binomial" and plan.slots == 2 + 5


def _ours_planned(theta, y0, buffers, plan):
    cond, body = _problem(theta)
    return bounded_while_loop(cond, body, _init(y0), outputs=buffers, plan=plan)


def test_plan_errors_name_the_fix():
    cond, body = _problem(0.8)
    init = _init(jnp.asarray(0.1))
    plan = while_loop_plan(cond, body, init, max_steps=30, checkpoints=4, outputs=_buffers())
    run = lambda plan, init=init, **kw: bounded_while_loop(
        cond, body, init, outputs=_buffers(), plan=plan, **kw
    )
    for kw in ({"max_steps": 30}, {"checkpoints": 4}, {"memory_budget": "1MB"},
               {"online": False}, {"offload": "host"}):  # fmt: skip
        with pytest.raises(ValueError, match=f"plan= or {next(iter(kw))}, not both"):
            run(plan, **kw)
    with pytest.raises(TypeError, match=r"plan must be a Plan, as while_loop_plan\(...\)"):
        run({"checkpoints": 4})
    wider = {"y": jnp.zeros(3), "i": jnp.asarray(0, jnp.int32)}
    with pytest.raises(ValueError, match="snapshots of 20 bytes and this loop's hold 28"):
        bounded_while_loop(lambda v: v["i"] < 3, lambda v: v, wider, plan=plan)
    with pytest.raises(ValueError, match=r"max_steps .* or plan=while_loop_plan"):
        bounded_while_loop(cond, body, init, outputs=_buffers())


@pytest.mark.slow
def test_planning_an_online_loop_traces_nothing():
    """`while_loop_plan` traces the functions only to size the step's residuals: planning an
    online loop (the adaptive solve's plan) and running it with `plan=` traces them as often
    as running it with the budget, with or without recorded decisions, also differentiated."""
    traces = [0]

    def body(v, recorded=None):
        traces[0] += 1
        return (v * 0.9, v) if record else v * 0.9

    cond = lambda v: v > 0.5
    for record in (False, True):
        kw = dict(max_steps=20, checkpoints=3, record_decisions=record)
        alone = lambda x, kw=kw: bounded_while_loop(cond, body, x, **kw)
        traces[0] = 0
        jax.grad(alone)(1.0)
        expected = traces[0]
        traces[0] = 0
        plan = while_loop_plan(cond, body, 1.0, **kw)
        assert traces[0] == 0
        planned = lambda x, plan=plan, record=record: bounded_while_loop(
            cond, body, x, plan=plan, record_decisions=record
        )
        jax.grad(planned)(1.0)
        assert traces[0] == expected, (record, traces[0], expected)


# Forward mode against reverse mode by default: test_forward_mode_of_a_closed_over_value.
@pytest.mark.slow
def test_forward_mode_matches_reverse():
    args = (jnp.asarray(0.8), jnp.asarray(0.1), _buffers())
    for kw in ({"checkpoints": 3}, {}):
        loss = _loss(lambda *a, kw=kw: _ours(*a, 40, **kw))
        fwd = jax.jacfwd(loss, argnums=(0, 1))(*args)
        _assert_close(fwd, jax.grad(loss, argnums=(0, 1))(*args))


def _random_case(stop, c, y0, theta):
    def cond(v):
        return v["t"] < stop

    def body(v):
        y, t = v["y"], v["t"]
        y2 = y + 0.1 * jnp.stack([jnp.sin(theta * y[1]), -y[0] + 0.3 * y[1] ** 2])
        return {"y": y2, "t": t + 0.1 + 0.01 * jnp.tanh(y2[0])}

    init = {"y": jnp.stack([y0, 0.2]), "t": jnp.asarray(0.0)}

    def ours(theta_y0):
        v = bounded_while_loop(cond, body, {**init, "y": theta_y0}, max_steps=80, checkpoints=c)
        return v["y"].sum() + v["t"]

    def reference(theta_y0):
        v = {**init, "y": theta_y0}
        for _ in range(80):
            if not cond(v):
                break
            v = body(v)
        return v["y"].sum() + v["t"]

    got = jax.jit(jax.value_and_grad(ours))(init["y"])
    _assert_close(got, jax.value_and_grad(reference)(init["y"]))


# By default the stops and checkpoints of test_matches_unrolled_reference.
@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(
    stop=st.floats(0.05, 9.0), c=st.integers(1, 12), y0=st.floats(-1, 1), theta=st.floats(0.5, 2)
)
def test_random_stops_and_checkpoints(stop, c, y0, theta):
    _random_case(stop, c, y0, theta)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    stop=st.floats(0.05, 9.0), c=st.integers(1, 12), y0=st.floats(-1, 1), theta=st.floats(0.5, 2)
)
def test_random_stops_and_checkpoints_many(stop, c, y0, theta):
    _random_case(stop, c, y0, theta)


def _cached_problem(count_unpack=False):
    """A loop whose state carries a derivative cache `g = sin(y)`: `snapshot=` drops it."""
    cond = lambda v: v["t"] < 3.0

    def body(v):
        y = v["y"] + 0.1 * v["g"]
        return {"y": y, "g": jnp.sin(y), "t": v["t"] + 0.1}

    pack = lambda v: {"y": v["y"], "t": v["t"]}

    def unpack(p):
        if count_unpack:
            jax.debug.callback(_bump)
        return {**p, "g": jnp.sin(p["y"])}

    return cond, body, (pack, unpack)


@pytest.mark.parametrize("c", slow_unless([2, 5], fast={5}))
def test_snapshot_codec_gradients_and_restores(c):
    def loss(y0, snapshot):
        cond, body, codec = _cached_problem(count_unpack=True)
        init = {"y": y0, "g": jnp.sin(y0), "t": jnp.asarray(0.0)}
        v = bounded_while_loop(
            cond, body, init, max_steps=60, checkpoints=c, snapshot=codec if snapshot else None
        )
        return jnp.sum(v["y"] ** 2)

    y0 = jnp.linspace(0.1, 1.0, 4)
    plain = jax.grad(lambda y: loss(y, False))(y0)
    packed = jax.grad(lambda y: loss(y, True))(y0)
    np.testing.assert_allclose(packed, plain, rtol=0, atol=1e-13)
    # unpack runs once per restore of the reverse sweep, as the simulator says
    cond, body, _ = _cached_problem()
    v, steps = {"y": y0, "g": jnp.sin(y0), "t": jnp.asarray(0.0)}, 0
    while cond(v):
        v, steps = body(v), steps + 1
    restores = sum(
        a == "restore" for a, _ in simulate(online_schedule(60, c), steps, record=True).actions
    )
    assert _count(jax.jit(jax.grad(lambda y: loss(y, True))), y0) == restores


# What a solve's snapshots of a large state save, test_gradient_memory.py checks: -m slow here.
@pytest.mark.slow
def test_snapshot_codec_saves_memory():
    def loss(y0, c, snapshot):
        cond, body, codec = _cached_problem()
        init = {"y": y0, "g": jnp.sin(y0), "t": jnp.asarray(0.0)}
        v = bounded_while_loop(
            cond, body, init, max_steps=60, checkpoints=c, snapshot=codec if snapshot else None
        )
        return jnp.sum(v["y"])

    y0, state = jnp.ones(50_000), 50_000 * 8
    m = {
        (c, s): _temp_bytes(jax.grad(lambda y, c=c, s=s: loss(y, c, s)), y0)
        for c in (2, 10)
        for s in (False, True)
    }
    # eight more checkpoints hold 8 states (y) with the codec, 16 (y and g) without
    assert m[10, True] - m[2, True] == pytest.approx(8 * state, rel=0.1), m
    assert m[10, False] - m[2, False] == pytest.approx(16 * state, rel=0.1), m


def test_snapshot_codec_errors():
    cond, body, (pack, unpack) = _cached_problem()
    init = {"y": jnp.ones(3), "g": jnp.ones(3), "t": jnp.asarray(0.0)}
    with pytest.raises(TypeError, match=r"snapshot=\(pack, unpack\) takes two functions"):
        bounded_while_loop(cond, body, init, max_steps=10, snapshot=pack)
    with pytest.raises(TypeError, match="unpack\\(pack\\(val\\)\\)"):
        bounded_while_loop(cond, body, init, max_steps=10, snapshot=(pack, lambda p: p))


def _noisy_loop(record, steps=5, vmap_method=None, budget=None, throw=False):
    """`y <- y * (2 + i or 1 / (3 + i))` for i < `steps`; which factor is decided by host noise
    that differs on every call, like rounding that differs between the forward run and a
    recomputation. A lane with `calm` set decides by `i` alone. `record`: as
    `bounded_while_loop`'s `record_decisions`."""
    calls = [0]

    def noise(i):
        calls[0] += 1
        return np.full(np.shape(i), (calls[0] * 0.618) % 1.0)

    def body(v, recorded=None):
        y, i, calm = v
        shape = jax.ShapeDtypeStruct(jnp.shape(i), jnp.float64)
        draw = jax.pure_callback(noise, shape, i, vmap_method=vmap_method)
        fresh = jnp.where(calm, i % 2 == 0, draw > 0.5)
        up = fresh if recorded is None else recorded
        new = (y * jnp.where(up, 2.0 + i, 1.0 / (3.0 + i)), i + 1, calm)
        return (new, up) if record else new

    def loss(y0, calm=False):
        cond = lambda v: v[1] < steps
        return bounded_while_loop(
            cond, body, (y0, 0, calm), max_steps=steps + 3, record_decisions=record,
            throw=throw, **(budget or dict(checkpoints=2)),
        )[0]  # fmt: skip

    return loss


@pytest.mark.parametrize("record", [False, True])
def test_recomputation_follows_recorded_decisions(record):
    # With 2 snapshots for 5 steps the reverse sweep recomputes steps, drawing new noise. The
    # gradient is the product of the factors the forward run chose (y is linear in y0) only if
    # the recomputation follows the recorded choices.
    y, vjp = jax.vjp(_noisy_loop(record), 2.0)
    (grad,) = vjp(1.0)
    if record:
        assert float(grad) == pytest.approx(float(y) / 2.0, rel=1e-15)
    else:
        assert float(grad) != pytest.approx(float(y) / 2.0, rel=1e-3)


# The host-offload sweep shares the reverse body: -m slow.
@pytest.mark.parametrize("offload", slow_unless([False, True], fast={False}))
def test_a_recomputation_past_the_record_that_decides_otherwise_has_nan_cotangents(offload):
    # Only the first 2 of 9 steps' decisions are recorded: the recomputations of the others
    # draw new noise, take other factors, and so do not end where the next step began.
    budget = dict(offload="host", checkpoints={"device": 2, "host": 4}) if offload else None
    y, vjp = jax.vjp(_noisy_loop(2, steps=9, budget=budget), 2.0)
    (grad,) = vjp(1.0)
    assert np.isfinite(float(y)) and np.isnan(float(grad))
    # with throw=True it raises, naming the fix
    _, vjp = jax.vjp(_noisy_loop(2, steps=9, budget=budget, throw=True), 2.0)
    with pytest.raises(Exception, match=r"record more steps \(bounded_while_loop"):
        jax.block_until_ready(vjp(1.0))


def test_a_recomputation_past_the_record_has_nan_cotangents_per_lane():
    # As above under vmap: a lane deciding by i alone keeps its exact derivative.
    loss = _noisy_loop(2, steps=9, vmap_method="expand_dims")
    y, vjp = jax.vjp(jax.vmap(loss), jnp.array([2.0, 2.0]), jnp.array([False, True]))
    grad, _ = vjp(jnp.ones(2))
    assert np.isnan(float(grad[0]))
    assert float(grad[1]) == pytest.approx(float(y[1]) / 2.0, rel=1e-15)


@pytest.mark.parametrize("recorded", slow_unless([1, 4], fast={1}))
def test_a_recomputation_past_the_record_that_decides_alike_is_exact(recorded):
    # The decisions depend on the state alone, so the recomputations past the record take
    # the forward run's: the gradient is the record's, bitwise (checked along the chain, which
    # takes the state's NaN and infinities alike).
    odd = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1e-300])

    def loss(y0, record):
        def body(v, made=None):
            y, i, odd = v
            up = (y < 1.5) if made is None else made
            return (jnp.where(up, y * 1.3 + jnp.sin(y), y * 0.6), i + 1, odd), up

        cond = lambda v: v[1] < 12
        kw = dict(max_steps=20, checkpoints=3, record_decisions=record)
        return bounded_while_loop(cond, body, (y0, 0, odd), **kw)[0]

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    full = grad(0.3, True)
    assert np.isfinite(float(full)) and float(full) != 0.0
    assert float(grad(0.3, recorded)) == float(full)


def test_a_recomputation_past_the_record_is_checked_element_by_element():
    # A decision that moves a small element of a leaf whose largest element is 1e6 (by far
    # less than sqrt(eps) of the leaf's largest magnitude) is still seen: NaN, not the
    # derivative of another trajectory.
    calls = [0]

    def noise(i):
        calls[0] += 1
        return np.asarray((calls[0] * 0.618) % 1.0 > 0.5)

    def loss(pq):
        def body(v, made=None):
            y, i = v
            draw = jax.pure_callback(noise, jax.ShapeDtypeStruct((), jnp.bool_), i)
            up = draw if made is None else made
            return (y.at[1].add(1e-3 * jnp.where(up, pq[0], pq[1])), i + 1), up

        init = (jnp.array([1e6, 0.0]), 0)
        kw = dict(max_steps=8, checkpoints=2, record_decisions=1)
        return bounded_while_loop(lambda v: v[1] < 8, body, init, **kw)[0][1]

    y, vjp = jax.vjp(loss, jnp.array([2.0, 3.0]))
    assert np.isfinite(float(y)) and np.all(np.isnan(vjp(1.0)[0]))


def test_a_recomputation_past_the_record_may_differ_where_no_derivative_flows():
    # `rate` only steers decisions (like a Newton iteration's convergence rate) and differs on
    # every recomputation; no derivative flows through it, so the chain check lets it differ
    # and the gradient past the record is exact.
    calls = [0]

    def noise(i):
        calls[0] += 1
        return np.asarray(calls[0] * 0.618 % 1.0)

    def loss(y0):
        def body(v, made=None):
            y, rate, i = v
            draw = jax.pure_callback(noise, jax.ShapeDtypeStruct((), jnp.float64), i)
            up = (y < 1.5) if made is None else made
            y = jnp.where(up & (rate < 2.0), y * 1.3 + jnp.sin(y), y * 0.6)
            return (y, jax.lax.stop_gradient(draw), i + 1), up

        kw = dict(max_steps=12, checkpoints=3, record_decisions=1)
        return bounded_while_loop(lambda v: v[2] < 10, body, (y0, 0.0, 0), **kw)[0]

    ref = jax.grad(lambda y: jax.lax.fori_loop(
        0, 10, lambda _, y: jnp.where(y < 1.5, y * 1.3 + jnp.sin(y), y * 0.6), y
    ))(0.3)  # fmt: skip
    assert float(jax.grad(loss)(0.3)) == pytest.approx(float(ref), rel=1e-14)


def test_the_record_of_decisions_is_bounded_whatever_max_steps():
    # The record keeps 2**20 steps' decisions (here 8 bytes each): the compiled gradient's
    # temporary memory is the same for max_steps of 2**21 and 2**24, and smaller than 2**21
    # steps' records would take.
    def loss(y0, max_steps):
        def body(v, made=None):
            y, i = v
            return (y * 0.99 + 0.01, i + 1), (y < 0.5 if made is None else made).astype(float)

        cond = lambda v: v[1] < 10
        kw = dict(max_steps=max_steps, checkpoints=4, record_decisions=True)
        return bounded_while_loop(cond, body, (y0, 0), **kw)[0]

    temps = [_temp_bytes(jax.grad(lambda y, s=s: loss(y, s)), 1.0) for s in (2**21, 2**24)]
    assert temps[0] == temps[1] < 2**21 * 8, temps
    ref = jax.grad(lambda y: jax.lax.fori_loop(0, 10, lambda _, y: y * 0.99 + 0.01, y))(1.0)
    assert float(jax.jit(jax.grad(lambda y: loss(y, 2**24)))(1.0)) == pytest.approx(float(ref))


def test_recorded_decisions_errors():
    body = lambda v, recorded: (v + 1.0, jnp.zeros(2) if recorded is None else jnp.zeros(3))
    with pytest.raises(TypeError, match="record_decisions=True"):
        bounded_while_loop(lambda v: v < 3.0, body, 0.0, max_steps=4, record_decisions=True)
    with pytest.raises(TypeError, match="record_decisions=True"):
        bounded_while_loop(lambda v: v < 3.0, lambda v, r: v, 0.0, max_steps=4,
                           record_decisions=True)  # fmt: skip
    with pytest.raises(TypeError, match="throw must be True or False"):
        bounded_while_loop(lambda v: v < 3.0, lambda v: v + 1.0, 0.0, max_steps=4, throw=None)
    for wrong in ("yes", 0, -2, 1.5):
        with pytest.raises(TypeError, match="record_decisions must be True, False or an int"):
            bounded_while_loop(lambda v: v < 3.0, lambda v: v + 1.0, 0.0, max_steps=4,
                               record_decisions=wrong)  # fmt: skip


def test_snapshots_ravel_small_leaves():
    """A snapshot keeps small leaves as one vector per dtype and large ones whole, and
    rebuilds the tree exactly."""
    tree = {
        "a": jnp.arange(3.0),
        "b": jnp.asarray(2.5),
        "big": jnp.arange(100.0).reshape(10, 10),
        "flags": jnp.array([True, False]),
        "i": jnp.arange(4, dtype=jnp.int32).reshape(2, 2),
        "j": jnp.asarray(7, jnp.int32),
    }
    raveled = _tree.ravel(tree)
    shapes = sorted((p.shape, p.dtype.name) for p in raveled.parts)
    assert shapes == [((2,), "bool"), ((4,), "float64"), ((5,), "int32"), ((10, 10), "float64")]
    for a, b in zip(jax.tree.leaves(raveled.unravel()), jax.tree.leaves(tree), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_snapshot_of_many_small_leaves_is_one_write_per_dtype():
    """Snapshot stores cost one write per dtype, not one per leaf: the compiled gradient of a
    loop with 12 small leaves (two dtypes) has few `dynamic-update-slice`s."""

    def loss(x):
        init = {"x": [x * k for k in range(1, 11)], "i": jnp.asarray(0, jnp.int32),
                "n": jnp.zeros(3, jnp.int32)}  # fmt: skip

        def body(v):
            x = [jnp.sin(a) + 0.1 * b for a, b in zip(v["x"], v["x"][1:] + v["x"][:1], strict=True)]
            return {"x": x, "i": v["i"] + 1, "n": v["n"] + 1}

        v = bounded_while_loop(lambda v: v["i"] < 20, body, init, max_steps=50, checkpoints=4)
        return sum(v["x"])

    text = jax.jit(jax.grad(loss)).lower(jnp.asarray(0.3)).compile().as_text()
    # the forward store and the reverse sweep's push, one per dtype: 4 (12 per leaf: 24)
    assert text.count("dynamic-update-slice(") <= 8, text.count("dynamic-update-slice(")


def _closing_over(x, **kw):
    """A while loop (7 steps of at most 20) whose body closes over `x` (the differentiated
    input), a Python int and a Python float."""
    k, c = 3, 2.5
    cond = lambda v: v["i"] < 7
    body = lambda v: {"y": jnp.sin(v["y"]) * c + x * k, "i": v["i"] + 1}
    init = {"y": jnp.full(2, 0.5), "i": jnp.asarray(0, jnp.int32)}
    v = bounded_while_loop(cond, body, init, max_steps=20, **kw)
    return jnp.sum(v["y"] * jnp.array([1.0, -0.5]))


def _assert_derivatives_agree(loss, x):
    """`jacfwd == jacrev`, both equal to central finite differences and nonzero."""
    fwd, rev = jax.jacfwd(loss)(x), jax.jacrev(loss)(x)
    _assert_close(fwd, rev)
    h, basis = 1e-6, jnp.eye(jnp.size(x)).reshape(-1, *jnp.shape(x))
    fd = jnp.stack([(loss(x + h * e) - loss(x - h * e)) / (2 * h) for e in basis], -1)
    np.testing.assert_allclose(fwd, fd.reshape(jnp.shape(fwd)), rtol=1e-7)
    assert float(jnp.max(jnp.abs(fwd))) > 1.0


# The default plan of 20 steps is binomial; the states regime's reverse sweep, and a body
# closing over what is differentiated, are test_matches_unrolled_reference's (checkpoints=40).
@pytest.mark.parametrize(
    "kw", [pytest.param({"checkpoints": 2}, marks=pytest.mark.slow),
           pytest.param({"checkpoints": 20}, marks=pytest.mark.slow), {}],
    ids=["binomial", "states", "default"],
)  # fmt: skip
@pytest.mark.parametrize(
    "x", [1.3, pytest.param(jnp.asarray(1.3), marks=pytest.mark.slow),
          pytest.param(np.float64(1.3), marks=pytest.mark.slow), jnp.array([1.3, 0.4])],
    ids=["python float", "weak scalar", "numpy scalar", "array"],
)  # fmt: skip
def test_forward_mode_of_a_closed_over_value(x, kw):
    """The tangent of a closed-over input reaches the forward-mode loop, whatever its type (a
    Python float reaches the custom JVP rule as the float itself)."""
    _assert_derivatives_agree(lambda x: _closing_over(x, **kw), x)


def test_forward_mode_of_a_closed_over_python_float_under_vmap():
    loss = lambda x: _closing_over(x, checkpoints=2)
    ts = jnp.array([1.0, -2.0])  # a batch of tangents of one Python float
    jvps = jax.vmap(lambda t: jax.jvp(loss, (1.3,), (t,))[1])(ts)
    _assert_close(jvps, ts * jax.grad(loss)(1.3))
    xs = jnp.array([1.3, 0.2])
    _assert_close(jax.vmap(jax.jacfwd(loss))(xs), jax.vmap(jax.grad(loss))(xs))


@pytest.mark.parametrize(
    ("online", "steps", "c"),
    slow_unless(
        [(True, 150, 1), (True, 400, 2), (True, 400, 3), (True, 400, 6), (True, 30, 4),
         (False, 150, 1), (False, 150, 3), (False, 150, 5), (False, 150, 9), (False, 20, 30)],
        fast={(True, 150, 1), (True, 400, 6), (False, 150, 3), (False, 20, 30)},
    ),
)  # fmt: skip
def test_recomputed_steps_in_the_graph_match_the_simulator_at_every_stop(online, steps, c):
    """`recomputed_steps(plan, n)` (`sol.stats.num_recomputed_steps`) as computed at run time
    (from the schedule's small tables, the online rule replayed over the phase of the stop) at
    every stop, also for an offline schedule (a constant-step solve stops one step short of its
    spare step, or at an event), and with a slot for every step (nothing recomputed)."""
    plan = schedules.plan(steps, 8, checkpoints=c, online=online)
    schedule = (online_schedule if online else offline_schedule)(steps, c)
    ns = jnp.arange(1, steps + 1)
    got = jax.jit(jax.vmap(lambda n: recomputed_steps(plan, n)))(ns)
    expected = [simulate(schedule, n).forward_steps - (n - 1) for n in range(1, steps + 1)]
    np.testing.assert_array_equal(got, expected)
    assert got.dtype == jnp.int32 and plan.slots == min(c, steps)


def test_recomputed_steps_of_the_other_regimes():
    """Nothing is recomputed with stored residuals; the two-level count with offload (at
    every stop, also with a device slot for every step of a segment); and
    `Plan.slots` counts the slots of both levels."""
    cond, body = (lambda v: v[1] < 7.0), (lambda v: (jnp.sin(v[0]), v[1] + 1.0))
    residuals = while_loop_plan(cond, body, (1.0, 0.0), max_steps=50, memory_budget="1MB",
                                online=False)  # fmt: skip
    assert residuals.regime == "residuals" and residuals.slots == 0
    assert int(recomputed_steps(residuals, 50)) == 0
    for device, host in ((3, 10), (5, 10)):  # segments of 5 steps: binomial, then states
        plan = schedules.plan(50, 16, checkpoints={"device": device, "host": host},
                              offload="host")  # fmt: skip
        ns = jnp.arange(0, 51)
        got = jax.jit(jax.vmap(lambda n, plan=plan: recomputed_steps(plan, n)))(ns)
        expected = [0] + [
            schedules.simulate_offload(n, plan.segment, device).forward_steps - (n - 1)
            for n in range(1, 51)
        ]
        np.testing.assert_array_equal(got, expected)
        assert plan.slots == device + host
    with pytest.raises(TypeError, match="takes a Plan"):
        recomputed_steps(online_schedule(10, 3), 5)


def test_forward_only_passes_forward_mode_and_raises_in_reverse_mode():
    error = TypeError("forward mode only; use jax.jvp")
    f = lambda x: forward_only({"y": jnp.sin(x) * x, "n": jnp.arange(3)}, error)
    x = jnp.array([0.3, 1.2])
    out = f(x)
    assert out["n"].dtype == jnp.arange(3).dtype and out["n"].tolist() == [0, 1, 2]
    ref = lambda x: jnp.sin(x) * x
    _assert_close(jax.jacfwd(lambda x: f(x)["y"])(x), jax.jacfwd(ref)(x))
    jvp = jax.jit(lambda x, t: jax.jvp(lambda x: f(x)["y"], (x,), (t,)))
    _assert_close(jvp(x, x), jax.jvp(ref, (x,), (x,)))
    batched = jax.vmap(jax.jacfwd(lambda x: f(x)["y"]))(jnp.stack([x, 2 * x]))
    _assert_close(batched, jax.vmap(jax.jacfwd(ref))(jnp.stack([x, 2 * x])))
    for reverse in (jax.grad, jax.jacrev):
        with pytest.raises(TypeError, match="forward mode only; use jax.jvp"):
            reverse(lambda x: f(x)["y"].sum())(x)


def _largest_constant(lowered) -> int:
    """Elements of the largest constant array in a lowered (StableHLO) program."""
    shapes = re.findall(r"stablehlo\.constant dense<.*?> : tensor<([0-9x]*)[a-z]", lowered)
    return max(math.prod(int(d) for d in s.split("x") if d) for s in shapes)


@pytest.mark.parametrize("max_steps", slow_unless([10**6, 10**9], fast={10**9}))
# None: the default, 1414 and 44721
@pytest.mark.parametrize("checkpoints", slow_unless([3, 16, None], fast={None}))
def test_a_large_max_steps_costs_no_table_over_the_steps(max_steps, checkpoints):
    """The schedule (run as the forward loop steps), the reverse sweep's table of binomials and
    the statistics are `O(c r)` integers: the lowered gradient and the statistics hold no
    constant larger than that table, and tracing them allocates a few MiB, for `max_steps`
    of a million or a billion. The gradient of the 7 steps run is exact."""
    cond = lambda v: v[1] < 7.0
    body = lambda v: (jnp.sin(v[0]) * 1.1, v[1] + 1.0)
    kw = dict(max_steps=max_steps, checkpoints=checkpoints)
    loss = lambda x: bounded_while_loop(cond, body, (x, 0.0), **kw)[0]
    plan = while_loop_plan(cond, body, (1.0, 0.0), **kw)
    schedule = plan.schedule
    tracemalloc.start()
    lowered = jax.jit(jax.grad(loss)).lower(1.0).as_text()
    stats = jax.jit(lambda n: recomputed_steps(plan, n)).lower(7).as_text()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    table = schedule.binomials.size  # (c + 2) x (r + 3), r the repetition number
    assert max(_largest_constant(lowered), _largest_constant(stats)) <= table < max_steps // 100
    assert peak < 32 * 2**20, peak
    ref = jax.grad(lambda x: jax.lax.fori_loop(0, 7, lambda _, y: jnp.sin(y) * 1.1, x))(1.0)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(1.0), ref, rtol=1e-14)


def test_pack_state_must_be_a_bool():
    with pytest.raises(TypeError, match="pack_state='yes' must be True or False"):
        bounded_while_loop(lambda v: v < 1.0, lambda v: v + 1.0, 0.0, max_steps=3, pack_state="yes")
