"""Sharded solves and gradients on 4 CPU devices equal the unsharded ones and keep the inputs'
sharding; the same across two processes joined by `jax.distributed`.

The device count must be set before JAX starts its backend, so the checks run in fresh processes
(`sharded_checks.py`) with `XLA_FLAGS=--xla_force_host_platform_device_count=4`; this file
asserts on the figures they print. The default run checks the ensemble (about 30 s of CPU
time); the grids (constant and adaptive steps, their checkpoints sharded; also over an
`Explicit` mesh axis) and the two-process run (each process compiling the solve and its
gradient twice) are `slow`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# One pytest-xdist worker runs the module: its fixture runs the sharded checks once.
pytestmark = pytest.mark.xdist_group("test_sharding")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "sharded_checks.py"
NO_GATHER = {"all-gather": 0, "all-to-all": 0}


def environment(devices: int) -> dict[str, str]:
    flags = f"--xla_force_host_platform_device_count={devices}"
    return os.environ | {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}


def run_checks(*arguments: str, devices: int = 4) -> dict:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], env=environment(devices),
        capture_output=True, text=True,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def assert_no_gathers(counts: dict[str, int]) -> None:
    assert {name: counts[name] for name in NO_GATHER} == NO_GATHER, counts


@pytest.fixture(scope="module")
def default_checks() -> dict:
    """The ensemble, in one process."""
    return run_checks("ensemble")


def test_sharded_ensemble(default_checks):
    """8 lanes (per-lane y0 and parameters) sharded `P('lanes')` over 4 devices:
    `jit(vmap(solve))` and `jit(vmap(grad))` equal the unsharded results, and `ys`, the stats
    and the gradients come back sharded over the lanes."""
    result = default_checks["ensemble"]
    assert result["devices"] == 4 and result["input_sharded"]
    assert result["steps_equal"] and len(set(result["steps"])) > 1
    assert result["ys_rel_diff"] <= 1e-12
    assert result["grad_rel_diff"] <= 1e-12
    assert result["ys_sharded"] and result["stats_sharded"]
    assert result["grad_sharded"] == [True, True]
    # Lanes never move between devices; the lockstep predicate is one all-reduce of a bool.
    assert_no_gathers(result["solve_collectives"])
    assert_no_gathers(result["grad_collectives"])
    assert result["solve_collectives"]["collective-permute"] == 0


def check_grid(result: dict, tolerance: float) -> None:
    assert result["steps"][0] == result["steps"][1]
    assert result["ys_rel_diff"] <= tolerance
    assert result["grad_rel_diff"] <= tolerance
    assert result["ys_sharded"], result["ys_spec"]  # [1, 64, 64]: P(None, 'x', None)
    assert result["grad_sharded"], result["grad_spec"]  # [64, 64]: P('x', None)
    assert_no_gathers(result["solve_collectives"])
    assert_no_gathers(result["grad_collectives"])
    # The checkpoints stay sharded: each device keeps [8, 16, 64] snapshots, never [8, 64, 64].
    assert result["per_device_snapshots"] and not result["full_snapshots"]


@pytest.mark.slow
def test_sharded_grid_constant_steps():
    """A 64x64 state sharded `P('x', None)`, RK4 with constant steps, and its gradient with
    `RecursiveCheckpointAdjoint(checkpoints=8)`: equal to the unsharded solve, sharding kept."""
    check_grid(run_checks("grid", "--solvers", "rk4")["grid"]["rk4"], 1e-12)


@pytest.mark.slow
def test_sharded_grid_adaptive_steps():
    """The same with Tsit5 and adaptive steps. The error norm sums over the grid shard by shard,
    in another order than on one device, so the step sizes (hence `ys`) agree to rounding."""
    check_grid(run_checks("grid", "--solvers", "tsit5")["grid"]["tsit5"], 1e-9)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ensemble_across_processes(tmp_path):
    """Two processes with 2 CPU devices each, joined by `jax.distributed.initialize` (gloo
    collectives): the ensemble sharded over the 4-device global mesh; each process's lanes and
    their gradients equal an unsharded solve of them, and come back sharded; a failing lane
    with `throw=True` makes both processes raise, naming it, and neither hangs."""
    port, workers, logs = free_port(), [], []
    for i in range(2):
        # Files, not pipes: a worker blocked on a full pipe would stall the other's collectives.
        logs.append((open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")))
        options = f"--process-id {i} --num-processes 2 --port {port}".split()
        workers.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), "worker", *options],
                env=environment(2),
                stdout=logs[i][0],
                stderr=logs[i][1],
                text=True,
            )
        )
    try:
        codes = [worker.wait(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    results = []
    for code, (out, err) in zip(codes, logs, strict=True):
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close(), err.close()
        assert code == 0, stderr[-5000:]
        results.append(json.loads(stdout.strip().splitlines()[-1])["worker"])
    assert [r["process_index"] for r in results] == [0, 1]
    for result in results:
        assert result["process_count"] == 2 and result["devices"] == 4
        assert result["local_devices"] == 2
        assert result["ys_sharded"] and result["grad_sharded"] == [True, True]
        assert result["ys_rel_diff"] <= 1e-12
        assert result["grad_rel_diff"] <= 1e-12
        # A NaN parameter in lane 5 (on process 1): both processes raise, naming it.
        assert "Lane 5 of 8 failed: The vector field is NaN" in result["failing_lane"], result


def check_explicit_grid(name: str, result: dict, tolerance: float) -> None:
    """One grid's figures over an `Explicit` axis: one device's steps and results (to
    `tolerance`), `ys` and the gradient sharded in their types."""
    assert result["steps"][0] == result["steps"][1], name
    assert result["ys_rel_diff"] <= tolerance, name
    assert result["grad_rel_diff"] <= tolerance, name
    assert result["ys_type_spec"] == "P(None, 'x', None)" and result["ys_sharded"], name
    assert result["grad_type_spec"] == "P('x', None)" and result["grad_sharded"], name


@pytest.mark.slow
def test_sharded_grid_explicit_axes():
    """A 64x64 state sharded `P('x', None)` over an `Explicit` mesh axis (`jax.set_mesh`:
    shardings in the types), RK4 and Tsit5, with `checkpoints=8` and the default adjoint:
    solve and gradient equal one device's, `ys` and the gradient are sharded in their types,
    and every stack of states (snapshots, saved outputs) is kept per device, `[k, 16, 64]`,
    with no gather (no more collectives than the same gradient on an `Auto` axis)."""
    results = run_checks("grid_explicit", "--solvers", "rk4", "tsit5")["grid_explicit"]
    assert results.pop("devices") == 4
    assert sorted(results) == [
        "rk4_checkpoints", "rk4_default", "tsit5_checkpoints", "tsit5_default",
    ]  # fmt: skip
    for name, result in results.items():
        check_explicit_grid(name, result, 1e-12)
        for counts in (result["solve_collectives"], result["grad_collectives"]):
            assert_no_gathers(counts)
            assert counts["collective-permute"] == 0, (name, counts)
        assert all(
            result["grad_collectives"][op] <= result["auto_grad_collectives"][op]
            for op in NO_GATHER | {"all-reduce": 0}
        ), (name, result["grad_collectives"], result["auto_grad_collectives"])
        assert result["per_device_stacks"] and not result["full_stacks"], name
    # `checkpoints=8`: each device holds its [8, 16, 64] block of the snapshots.
    for name in ("rk4_checkpoints", "tsit5_checkpoints"):
        assert "f64[8,16,64]" in results[name]["per_device_stacks"], name
        assert results[name]["per_device_snapshots"] and not results[name]["full_snapshots"]


@pytest.mark.slow
def test_sharded_grid_explicit_axes_implicit_steppers():
    """A 16x16 state sharded `P('x', None)` over an `Explicit` mesh axis, with Radau5,
    Kvaerno5, BDF and Rodas5 (rtol = atol = 1e-8, default adjoint): solve and gradient equal
    one device's to rounding, with the same steps, and `ys` and the gradient are sharded in
    their types. (Their dense LU algebra runs replicated: gathers are expected here.)"""
    results = run_checks("grid_explicit_implicit")["grid_explicit_implicit"]
    assert results.pop("devices") == 4
    assert sorted(results) == ["bdf", "kvaerno5", "radau", "rodas5"]
    for name, result in results.items():
        check_explicit_grid(name, result, 1e-10)
        for counts in (result["solve_collectives"], result["grad_collectives"]):
            assert counts["all-to-all"] == 0 and counts["collective-permute"] == 0, (name, counts)
