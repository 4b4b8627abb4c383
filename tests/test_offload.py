"""Host offload (`offload="host"`): the two-level plan, gradients equal to the single-level
engine's (float64, 1e-12), step counts equal to `simulate_offload`, and where the snapshots
live.

XLA:CPU has one memory: `device_put` to `jax.memory.Space.Host` lowers to nothing there and
`memory_analysis()` reports every `host_*` figure as 0 (the host buffers are counted in
`temp_size_in_bytes`). So the placement is checked in the program itself: the host buffers
carry the host memory space in the jaxpr, and the program lowered for CUDA (which needs no
GPU) moves each snapshot with an `annotate_device_placement` straight into a
`dynamic_update_slice` and out of a `dynamic_slice`, the copies XLA's host offloader handles.
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from selection import slow_unless

import odeckpt
from odeckpt.checkpointing import (
    bounded_while_loop,
    checkpointed_scan,
    scan_plan,
    while_loop_plan,
)
from odeckpt.checkpointing._host import check_host_memory
from odeckpt.checkpointing.schedules import (
    DEFAULT_HOST_MEMORY_BUDGET,
    DEFAULT_MIN_CHECKPOINTS,
    offload_cost,
    optimal_cost,
    plan,
    simulate_offload,
)

# One pytest-xdist worker runs the module: its tests share the fixture's gradient.
pytestmark = pytest.mark.xdist_group("test_offload")

_COUNT = [0]


def _bump():
    _COUNT[0] += 1


def _step(carry, x):
    return jnp.sin(carry) * x + 0.1 * carry, carry[0] * x


def _counted(carry, x):
    jax.debug.callback(_bump)
    return _step(carry, x)


def _loss(scan, n, **kw):
    xs = jnp.linspace(0.5, 1.5, n)

    def loss(y0, xs):
        carry, ys = scan(_step, y0, xs, **kw)
        return jnp.sum(carry**2) + jnp.sum(ys * jnp.arange(1.0, n + 1))

    return lambda y0: jax.grad(loss, argnums=(0, 1))(y0, xs)


def _assert_close(a, b, tol=1e-12):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(v))))
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * scale)


# The plan (pure Python)


def test_plan_splits_the_budgets():
    mib = 2**20
    p = plan(10_000, mib, memory_budget={"device": "4MiB", "host": "1GiB"}, offload="host")
    assert (p.checkpoints, p.host_checkpoints, p.segment) == (4, 1000, 10)
    assert (p.memory_bytes, p.host_bytes, p.transfers) == (4 * mib, 1000 * mib, 2000)
    assert p.forward_steps == offload_cost(10_000, 10, 4)
    assert p.offload == "host" and p.regime == "binomial"
    # a plain value is the host's; the device keeps the default slots
    q = plan(10_000, mib, memory_budget="1GiB", offload="host")
    assert (q.checkpoints, q.host_checkpoints) == (DEFAULT_MIN_CHECKPOINTS, 1000)
    q = plan(10_000, mib, checkpoints={"host": 100}, offload="host")
    assert (q.checkpoints, q.host_checkpoints, q.segment) == (DEFAULT_MIN_CHECKPOINTS, 100, 100)
    # defaults: the host budget (256 snapshots of 16 MiB: segments of 40 steps, 250 used)
    q = plan(10_000, 2**24, offload="host")
    assert DEFAULT_HOST_MEMORY_BUDGET // 2**24 == 256
    assert (q.segment, q.host_checkpoints) == (40, 250)
    q = plan(100, 8, offload="host")
    assert (q.segment, q.host_checkpoints, q.checkpoints, q.regime) == (1, 100, 1, "states")
    assert q.forward_steps == 99  # every state on the host: no recomputation
    # device slots beyond a segment's length are of no use
    q = plan(100, 8, checkpoints={"device": 50, "host": 10}, offload="host")
    assert (q.checkpoints, q.segment, q.regime) == (10, 10, "states")
    # host slots are spread evenly: ceil(steps / segment) of them are used
    q = plan(1000, 8, checkpoints={"device": 3, "host": 300}, offload="host")
    assert (q.segment, q.host_checkpoints) == (4, 250)
    assert "offload=host" in str(q) and "250 host snapshots every 4 steps" in str(q)


def test_offload_cost_matches_the_simulator_at_every_stop():
    for segment in (1, 2, 5, 13):
        for c in range(1, min(segment, 4) + 1):
            for n in range(1, 80):
                sim = simulate_offload(n, segment, c)
                assert sim.forward_steps == offload_cost(n, segment, c), (n, segment, c)
                assert sim.step_evaluations == sim.forward_steps + 1 + n
                assert sim.reversal_order == tuple(range(n - 1, -1, -1))
                assert sim.peak_snapshots <= c


def test_offload_cost_closed_form():
    # each full segment costs Revolve's t(m, c) from its restored start
    assert offload_cost(1000, 100, 4) == 999 + 9 * optimal_cost(100, 4) + optimal_cost(99, 4)
    # one segment is single-level Revolve from a start that is not held in hand
    assert offload_cost(50, 50, 3) == 49 + optimal_cost(49, 3)
    sim = simulate_offload(10, 4, 2, record=True)
    loads = [pos for action, pos in sim.actions if action == "load"]
    assert loads == [8, 4, 0]  # one copy from the host per segment, last segment first


def test_plan_errors_name_the_fix():
    with pytest.raises(ValueError, match="offload='host'"):
        plan(10, 8, offload="disk")
    with pytest.raises(ValueError, match="needs offload='host'"):
        plan(10, 8, memory_budget={"device": 64, "host": 640})
    with pytest.raises(ValueError, match="'device' and 'host'"):
        plan(10, 8, checkpoints={"gpu": 2}, offload="host")
    with pytest.raises(ValueError, match=r"memory_budget\['device'\].*at least 8 bytes"):
        plan(10, 8, memory_budget={"device": 4, "host": 640}, offload="host")
    with pytest.raises(ValueError, match=r"memory_budget\['host'\].*at least 8 bytes"):
        plan(10, 8, memory_budget={"host": 7}, offload="host")
    with pytest.raises(ValueError, match=r"checkpoints\['host'\] must be an int >= 1"):
        plan(10, 8, checkpoints={"host": 0}, offload="host")
    with pytest.raises(ValueError, match="not both"):
        plan(10, 8, checkpoints=2, memory_budget=64, offload="host")


# The engine


# By default a binomial split of the segments and the states regime in each.
@pytest.mark.parametrize(
    "checkpoints",
    slow_unless(
        [{"device": 1, "host": 1}, {"device": 2, "host": 5}, {"device": 1, "host": 37},
         {"device": 4, "host": 9}, {"device": 5, "host": 8}, 3],
        fast=[{"device": 2, "host": 5}, {"device": 5, "host": 8}],
    ),
)  # fmt: skip
def test_scan_gradients_equal_single_level(checkpoints, scan_reference):
    """`{"device": 5, "host": 8}`: segments of 5 steps with a device slot for each (the plan's
    "states" regime), whose reverse sweep must still advance from each segment's start."""
    got = jax.jit(_loss(checkpointed_scan, 37, checkpoints=checkpoints, offload="host"))
    _assert_close(got(_Y0), scan_reference)


_Y0 = jnp.array([0.3, 0.7, 1.1])


@pytest.fixture(scope="module")
def scan_reference():
    """The single-level engine's gradient, checked against `lax.scan`'s."""
    ref = jax.jit(_loss(checkpointed_scan, 37, checkpoints=4))(_Y0)
    _assert_close(ref, jax.jit(_loss(jax.lax.scan, 37))(_Y0))
    return ref


def test_scan_vmap_and_forward_over_reverse():
    kw = dict(checkpoints={"device": 2, "host": 5}, offload="host")
    y0s = jnp.array([[0.3, 0.7, 1.1], [1.0, -0.5, 0.2]])
    got = jax.jit(jax.vmap(_loss(checkpointed_scan, 20, **kw)))(y0s)
    _assert_close(got, jax.jit(jax.vmap(_loss(checkpointed_scan, 20, checkpoints=3)))(y0s))
    xs = jnp.linspace(0.5, 1.5, 20)
    grad = lambda **kw: jax.grad(lambda y: checkpointed_scan(_step, y, xs, **kw)[0].sum())
    hvp = lambda **kw: jax.jit(lambda y, t: jax.jvp(grad(**kw), (y,), (t,))[1])
    _assert_close(hvp(**kw)(y0s[0], jnp.arange(3.0)), hvp(checkpoints=3)(y0s[0], jnp.arange(3.0)))


def _while(**kw):
    def run(a, y0, stop):
        def body(v):
            i, y = v
            y = y + 0.05 * jnp.sin(a * y + i)
            return (i + 1, y), (i[None], y[None])

        out = jnp.zeros((30, 3))
        init = (jnp.array(0), y0)
        (_, y), out = bounded_while_loop(
            lambda v: v[0] < stop, body, init, max_steps=25, outputs=out, **kw
        )
        return jnp.sum(y**2) + jnp.sum(out * jnp.arange(30.0)[:, None])

    return jax.jit(jax.grad(run, argnums=(0, 1)))


# An offloaded while loop's gradient by default: the adaptive solve in
# test_solve_gradients_equal_without_offload, and jacrev in
# test_forward_mode_of_a_closed_over_python_float.
@pytest.mark.slow
def test_while_loop_gradients_equal_single_level_at_every_kind_of_stop():
    y0 = jnp.array([0.1, 0.5, 0.9])
    got = _while(checkpoints={"device": 2, "host": 3}, offload="host")  # segments of 9 steps
    ref = _while(checkpoints=25)
    for stop in (0, 1, 8, 9, 10, 24, 25, 40):  # none, inside, at and across segment bounds
        _assert_close(got(1.3, y0, stop), ref(1.3, y0, stop))
    a, stops = jnp.array([1.3, 0.7, 1.0]), jnp.array([12, 3, 25])  # lanes stop apart
    batched = jax.vmap(got, in_axes=(0, None, 0))(a, y0, stops)
    _assert_close(batched, jax.vmap(ref, in_axes=(0, None, 0))(a, y0, stops))


@pytest.mark.parametrize(
    ("n", "segment_slots", "c"),
    slow_unless([(30, 4, 3), (17, 17, 1), (40, 3, 1), (30, 4, 8)], fast={(40, 3, 1)}),
)
def test_step_evaluations_match_simulator(n, segment_slots, c):
    xs = jnp.linspace(0.5, 1.5, n)
    kw = dict(checkpoints={"device": c, "host": segment_slots}, offload="host")
    loss = lambda y0: checkpointed_scan(_counted, y0, xs, **kw)[0].sum()
    p = scan_plan(_step, jnp.ones(3), xs, **kw)
    expected = simulate_offload(n, p.segment, p.checkpoints).step_evaluations
    for fn, arg in ((jax.grad(loss), jnp.ones(3)), (jax.vmap(jax.grad(loss)), jnp.ones((4, 3)))):
        jitted = jax.jit(fn)
        jitted(arg)
        _COUNT[0] = 0
        jax.block_until_ready(jitted(arg))
        assert _COUNT[0] == expected  # batched: lockstep, no select running both branches


def test_program_size_independent_of_n_and_split():
    def equations(n, checkpoints):
        loss = lambda y0: checkpointed_scan(
            _step, y0, jnp.ones(n), checkpoints=checkpoints, offload="host"
        )[0].sum()
        return str(jax.make_jaxpr(jax.grad(loss))(jnp.ones(3))).count(" = ")

    small = equations(100, {"device": 2, "host": 5})
    assert small == equations(10_000, {"device": 2, "host": 5})
    assert small == equations(10_000, {"device": 30, "host": 300})


# Where the snapshots live


def _offloaded_grad(dim=4, n=40):
    xs = jnp.ones(n)
    kw = dict(checkpoints={"device": 2, "host": 5}, offload="host")
    return jax.grad(lambda y0: checkpointed_scan(_step, y0, xs, **kw)[0].sum()), jnp.ones(dim)


def test_host_buffers_carry_the_host_memory_space():
    grad, y0 = _offloaded_grad()
    jaxpr = str(jax.make_jaxpr(grad)(y0))
    assert "f64<host>[5,4]" in jaxpr  # the 5 host snapshots
    assert "f64<host>[2,4]" not in jaxpr  # the device slots stay on the device
    batched = str(jax.make_jaxpr(jax.vmap(grad))(jnp.ones((3, 4))))
    assert "f64<host>[3,5,4]" in batched  # batch axis in front of the slot axis


def _cuda_moves(fn, *args):
    """The (placement, consumer or producer op) of each `annotate_device_placement` in the
    program lowered for CUDA: what a snapshot moved to the host flows into, and what one moved
    to the device comes from."""
    lines = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().splitlines()
    defining = re.compile(r"^\s*(%[\w#:]+) = ([\w.\"]+)")
    moves = []
    for i, line in enumerate(lines):
        match = re.search(r"(%\w+) = stablehlo.custom_call @annotate_device_placement\((%\w+)\)"
                          r".*_xla_buffer_placement = \"(\w+)\"", line)  # fmt: skip
        if match is None:
            continue
        result, operand, place = match.groups()
        if place == "pinned_host":  # the op that uses it next
            use = next(x for x in lines[i + 1 :] if re.search(rf"{result}\b", x))
            moves.append((place, defining.match(use).group(2) if defining.match(use) else use))
        else:  # the ops that produced it: a reshape of a dynamic slice
            prior = [defining.match(x) for x in lines[:i]]
            ops = {m.group(1): m.group(2) for m in prior if m}
            source = next(x for x in reversed(lines[:i]) if x.strip().startswith(operand + " "))
            sliced = re.search(r"stablehlo.reshape (%\w+)", source).group(1)
            moves.append((place, f"{ops[operand]}({ops[sliced]})"))
    return moves


def test_cuda_lowering_moves_snapshots_by_slices():
    grad, y0 = _offloaded_grad()
    for fn, arg in ((grad, y0), (jax.vmap(grad), jnp.ones((3, 4)))):
        moves = _cuda_moves(fn, arg)
        # the host buffer (allocated once, it enters the forward loop), one store, one load
        assert sorted(moves) == [
            ("device", "stablehlo.reshape(stablehlo.dynamic_slice)"),
            ("pinned_host", "stablehlo.dynamic_update_slice"),
            ("pinned_host", "stablehlo.while"),
        ], moves


def test_memory_analysis_counts_each_host_slot_once():
    """XLA:CPU has one memory (`host_*` are 0): the host slots are loop carries in it, so the
    temporary memory grows by one snapshot per host slot. A GPU keeps them in pinned host
    memory: host temporaries are exactly the slots' snapshots, device memory does not grow."""
    dim, n = 2**12, 256
    snapshot = dim * 8

    def analysis(host):
        xs = jnp.ones(n)
        kw = dict(checkpoints={"device": 2, "host": host}, offload="host")
        loss = lambda y0: checkpointed_scan(_step, y0, xs, **kw)[0].sum()
        return jax.jit(jax.grad(loss)).lower(jnp.ones(dim)).compile().memory_analysis()

    few, many = analysis(8), analysis(64)
    if jax.default_backend() == "cpu":
        assert few.host_temp_size_in_bytes == many.host_temp_size_in_bytes == 0
        slope = (many.temp_size_in_bytes - few.temp_size_in_bytes) / (56 * snapshot)
        assert 0.9 <= slope <= 1.1, slope
    else:
        assert few.host_temp_size_in_bytes == 8 * snapshot
        assert many.host_temp_size_in_bytes == 64 * snapshot
        assert abs(many.temp_size_in_bytes - few.temp_size_in_bytes) < snapshot


def test_one_host_slot():
    """One host snapshot lives in a two-slot buffer (`MIN_HOST_SLOTS`), which the plan counts."""
    checkpoints = {"device": 1, "host": 1}
    jaxpr = str(jax.make_jaxpr(_loss(checkpointed_scan, 37, checkpoints=checkpoints,
                                     offload="host"))(_Y0))  # fmt: skip
    assert "f64<host>[2,3] = dynamic_update_slice" in jaxpr
    p = plan(37, 24, checkpoints=checkpoints, offload="host")
    assert (p.host_checkpoints, p.host_bytes) == (1, 2 * 24)


def test_backend_without_host_memory_raises_naming_the_fix():
    memories = [types.SimpleNamespace(kind="device")]
    device = types.SimpleNamespace(platform="metal", addressable_memories=lambda: memories)
    with pytest.raises(ValueError, match="leave out offload"):
        check_host_memory("checkpointed_scan", device)
    check_host_memory("checkpointed_scan")  # this backend (CPU) has pinned_host


def test_engine_errors_name_the_fix():
    xs = jnp.ones((5, 2))
    with pytest.raises(ValueError, match="offload='host'"):
        checkpointed_scan(lambda c, x: (c, None), jnp.ones(2), xs, offload="disk")
    with pytest.raises(ValueError, match="needs offload='host'"):
        checkpointed_scan(lambda c, x: (c, None), jnp.ones(2), xs, checkpoints={"host": 2})
    body, cond = (lambda v: v + 1.0), (lambda v: v < 3.0)
    with pytest.raises(ValueError, match=r"memory_budget\['device'\]"):
        bounded_while_loop(cond, body, 0.0, max_steps=8, offload="host",
                           memory_budget={"device": 1, "host": "1MB"})  # fmt: skip
    p = while_loop_plan(cond, body, 0.0, max_steps=8, offload="host", checkpoints=2)
    assert (p.segment, p.host_checkpoints) == (4, 2)
    with pytest.raises(ValueError, match="offload must be None or 'host'"):
        odeckpt.RecursiveCheckpointAdjoint(offload="device")
    with pytest.raises(ValueError, match="needs offload='host'"):
        odeckpt.RecursiveCheckpointAdjoint(memory_budget={"device": "1GB", "host": "8GB"})


# Through `solve`


def _solve_loss(adjoint, **kw):
    def vector_field(t, y, a):
        return -a * y + jnp.sin(t) * jnp.roll(y, 1)

    def loss(a):
        sol = odeckpt.solve(vector_field, jnp.linspace(0.1, 1.0, 6), (0.0, 2.0), a,
                            adjoint=adjoint, **kw)  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


@pytest.mark.parametrize(
    ("kw", "batched"),
    [pytest.param(dict(solver="rk4", dt0=0.02), True, marks=pytest.mark.slow),
     (dict(max_steps=64), False)],
    ids=["rk4-vmap", "adaptive"],
)  # fmt: skip
def test_solve_gradients_equal_without_offload(kw, batched):
    offloaded = odeckpt.RecursiveCheckpointAdjoint(
        checkpoints={"device": 2, "host": 7}, offload="host"
    )
    plain = odeckpt.RecursiveCheckpointAdjoint(checkpoints=5)
    grad = lambda adjoint: jax.grad(_solve_loss(adjoint, **kw))
    a = jnp.array([0.7, 1.1]) if batched else jnp.array(0.7)
    wrap = (lambda f: jax.jit(jax.vmap(f))) if batched else jax.jit
    _assert_close(wrap(grad(offloaded))(a), wrap(grad(plain))(a))


def test_solve_stats_count_both_levels():
    adjoint = odeckpt.RecursiveCheckpointAdjoint(
        checkpoints={"device": 2, "host": 7}, offload="host"
    )

    def vector_field(t, y, a):
        return -a * y

    sol = odeckpt.solve(vector_field, jnp.ones(2), (0.0, 1.0), 1.0, adjoint=adjoint,
                        solver="rk4", dt0=0.01)  # fmt: skip
    n = int(sol.stats.num_steps)
    assert n == 100
    segment = -(-101 // 7)  # max_steps = n + 1 (one spare step)
    assert int(sol.stats.num_checkpoints) == 2 + 7
    assert int(sol.stats.num_recomputed_steps) == offload_cost(n, segment, 2) - (n - 1)


def test_forward_mode_of_a_closed_over_python_float():
    """The offloaded loops keep the tangent of a closed-over Python float (which reaches the
    custom JVP rule as the float itself): `jacfwd == jacrev`."""
    levels = dict(checkpoints={"device": 2, "host": 3}, offload="host")

    def scanned(x):
        body = lambda carry, _: (jnp.sin(carry) * 2.5 + 3 * x, None)
        return checkpointed_scan(body, jnp.full(2, 0.5), None, length=8, **levels)[0].sum()

    def looped(x):
        body = lambda v: (jnp.sin(v[0]) * 2.5 + 3 * x, v[1] + 1)
        return bounded_while_loop(lambda v: v[1] < 7, body, (0.5, 0), max_steps=9, **levels)[0]

    for loss in (scanned, looped):
        fwd = jax.jacfwd(loss)(1.3)
        _assert_close(fwd, jax.jacrev(loss)(1.3))
        assert abs(float(fwd)) > 1.0
