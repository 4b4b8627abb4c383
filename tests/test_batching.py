"""`solve` under `jax.vmap`: each lane takes its own step sizes, stops on its own (finished lanes
are masked, their state frozen), and reports its own stats, exactly as if it were solved alone.

Two kinds of check:

- In this process: a lane of a mixed batch equals the same lane in a batch of copies of it (the
  same compiled program, so the comparison is bitwise: nothing leaks between lanes, and a lane
  that finishes early stops counting and writing).
- In a fresh process with FMA contraction unavailable (`batching_checks.py`; `-m slow`): each
  lane under `vmap` takes exactly the steps of the unbatched solve, with the same `ys` and
  derivatives.
  With FMA available, XLA:CPU may round the batched and the unbatched programs differently (see
  `batching_checks.py` and docs/scaling.md), so there the equality holds to rounding only.
"""

import functools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from batching_checks import (
    ADJOINTS,
    BASE_PARAMS,
    BASE_Y0,
    LANE_PARAMS,
    LANE_Y0,
    MAX_STEPS,
    derivative,
    solve,
    step_counts,
)
from problems import lotka_volterra
from selection import slow_unless

import odeckpt

# One pytest-xdist worker runs the module: its tests share compiled batched solves.
pytestmark = pytest.mark.xdist_group("test_batching")

HERE = Path(__file__).resolve().parent


def batch(over: str):
    """`(y0, params, in_axes)` of a mixed batch of 4 lanes, `vmap`-ped over `over`."""
    if over == "y0":
        return jnp.asarray(LANE_Y0), jnp.asarray(BASE_PARAMS), (0, None)
    if over == "args":
        return jnp.asarray(BASE_Y0), jnp.asarray(LANE_PARAMS), (None, 0)
    return jnp.asarray(LANE_Y0), jnp.asarray(LANE_PARAMS), (0, 0)


@functools.cache
def batched_solve(adjoint: str, in_axes: tuple, max_steps: int = MAX_STEPS, throw: bool = True):
    """`jit(vmap(solve))`, cached so that tests share compiled programs."""
    run = lambda y, p: solve(y, p, adjoint, max_steps=max_steps, throw=throw)
    return jax.jit(jax.vmap(run, in_axes=in_axes))


def copies_of_lane(y0, params, in_axes, lane: int):
    """The batch made of copies of one lane: the same shapes, so the same compiled program."""
    pick = lambda x, axis: x if axis is None else jnp.broadcast_to(x[lane], x.shape)
    return pick(y0, in_axes[0]), pick(params, in_axes[1])


def assert_trees_equal(a, b, lane: int):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x)[lane], np.asarray(y)[lane])


@pytest.mark.parametrize("over", ["y0", "args"])
@pytest.mark.parametrize("adjoint", slow_unless(ADJOINTS, fast={"recursive"}))
def test_each_lane_solves_as_if_alone(adjoint, over):
    """Each lane's `ys`, `ts` and stats (steps, accepted, rejected, ...) in a mixed batch equal
    those of a batch of copies of it, bitwise."""
    y0, params, in_axes = batch(over)
    batched = batched_solve(adjoint, in_axes)
    sol = batched(y0, params)
    steps = np.asarray(sol.stats.num_steps)
    # The lanes really differ: the slowest takes well over twice the steps of the fastest, so
    # the others finish early and must stop counting and writing while it goes on.
    assert steps.max() > 2 * steps.min()
    assert np.all(np.asarray(sol.status == odeckpt.Status.successful))
    for lane in range(steps.shape[0]):
        alone = batched(*copies_of_lane(y0, params, in_axes, lane))
        assert step_counts(sol.stats)[lane] == step_counts(alone.stats)[lane]
        assert_trees_equal((sol.ys, sol.ts, sol.stats), (alone.ys, alone.ts, alone.stats), lane)


def test_dense_output_and_steps_per_lane():
    """`SaveAt(steps=True, dense=True)` buffers are written per lane, up to each lane's own
    number of accepted steps."""
    saveat = odeckpt.SaveAt(t1=True, steps=True, dense=True)
    y0, params, in_axes = batch("args")

    def run(y, p):
        sol = odeckpt.solve(lotka_volterra, y, (0.0, 20.0), p, saveat=saveat, max_steps=1024)
        return sol.ts, sol.ys, sol.stats.num_accepted_steps, sol.evaluate(7.5)

    batched = jax.jit(jax.vmap(run, in_axes=in_axes))
    ts, ys, accepted, at_7_5 = batched(y0, params)
    for lane in range(ts.shape[0]):
        # each lane's saved steps: exactly its accepted steps (then inf), ending at t1
        finite = np.isfinite(np.asarray(ts[lane, :-1]))
        assert finite.sum() == int(accepted[lane])
        assert float(ts[lane, int(accepted[lane]) - 1]) == 20.0
        alone = batched(*copies_of_lane(y0, params, in_axes, lane))
        assert_trees_equal((ts, ys, at_7_5), alone[:2] + alone[3:], lane)


def test_failed_lane_does_not_stop_the_others():
    """With `throw=False`, a lane that runs out of steps reports it in its own `status`; the
    others finish normally with their own stats."""
    y0, params, in_axes = batch("args")
    sols = batched_solve("recursive", in_axes, max_steps=300, throw=False)(y0, params)
    full = batched_solve("recursive", in_axes)(y0, params)
    ok = np.asarray(sols.status == odeckpt.Status.successful)
    ran_out = np.asarray(sols.status == odeckpt.Status.max_steps_reached)
    assert ok.tolist() == [True, True, True, False] and bool(ran_out[3])
    assert int(sols.stats.num_steps[3]) == 300
    counts, full_counts = step_counts(sols.stats), step_counts(full.stats)
    assert counts[:3] == full_counts[:3]
    np.testing.assert_array_equal(np.asarray(sols.ys[:3]), np.asarray(full.ys[:3]))


def test_throw_raises_for_a_failed_lane():
    """With `throw=True` (the default) one failed lane raises, also when only `ys` is used
    under an outer `jit` (the check is threaded into `ys`, so it cannot be left out)."""
    y0, params, in_axes = batch("args")
    only_ys = jax.jit(jax.vmap(lambda y, p: solve(y, p, "recursive", max_steps=300).ys, in_axes))
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(only_ys(y0, params))
    # without the slow lane, nothing fails
    jax.block_until_ready(only_ys(y0, params.at[3].set(params[0])))


@pytest.mark.parametrize("adjoint", slow_unless(["recursive", "forward"], fast={"recursive"}))
def test_derivatives_per_lane(adjoint):
    """`vmap(grad)` (`vmap(jacfwd)` for forward mode) of a mixed batch: each lane's derivative is
    that of a batch of copies of it."""
    y0, params, in_axes = batch("both")
    d = jax.jit(jax.vmap(derivative(adjoint), in_axes=in_axes))
    mixed = d(y0, params)
    for lane in range(y0.shape[0]):
        assert_trees_equal(mixed, d(*copies_of_lane(y0, params, in_axes, lane)), lane)


def run_checks(*options: str) -> dict:
    """`batching_checks.py` in a fresh process with FMA contraction unavailable."""
    env = os.environ | {"XLA_FLAGS": "--xla_cpu_max_isa=AVX", "JAX_PLATFORMS": "cpu"}
    completed = subprocess.run(
        [sys.executable, str(HERE / "batching_checks.py"), *options], env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


x86_only = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="--xla_cpu_max_isa=AVX (no FMA) is an x86 setting",
)


@x86_only
@pytest.mark.slow
def test_vmap_equals_unbatched_without_fma():
    """Every lane under `vmap` takes exactly the steps of the unbatched solve (accepted and
    rejected), with the same `ys`, with the default adjoint; and its `vmap(grad)` equals
    per-lane `grad`."""
    results = run_checks("--solve", "recursive", "--derivative", "recursive")
    assert sorted(results) == ["recursive"]
    _assert_lanes_take_the_unbatched_steps(results)
    assert results["recursive"]["derivative_rel_diff"] <= 1e-12


@x86_only
@pytest.mark.slow
def test_vmap_equals_unbatched_without_fma_for_every_adjoint():
    """The same for every adjoint's solve."""
    results = run_checks("--solve", *ADJOINTS)
    assert sorted(results) == sorted(ADJOINTS)
    _assert_lanes_take_the_unbatched_steps(results)


def _assert_lanes_take_the_unbatched_steps(results: dict) -> None:
    for adjoint, result in results.items():
        assert result["batched_steps"] == result["alone_steps"], adjoint
        assert result["ys_rel_diff"] <= 1e-12, adjoint


@x86_only
@pytest.mark.slow
def test_vmap_derivatives_equal_unbatched_without_fma():
    """`vmap(grad)` with `DirectAdjoint` and `vmap(jacfwd)` with `ForwardMode` equal the
    per-lane derivatives."""
    results = run_checks("--derivative", "direct", "forward")
    for adjoint in ("direct", "forward"):
        assert results[adjoint]["derivative_rel_diff"] <= 1e-12, adjoint
