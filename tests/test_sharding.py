"""Sharded solves and gradients on 4 CPU devices equal the unsharded ones and keep the inputs'
sharding; the same across two processes joined by `jax.distributed`.

The device count must be set before JAX starts its backend, so the checks run in fresh processes
(`sharded_checks.py`) with `XLA_FLAGS=--xla_force_host_platform_device_count=4`; this file
asserts on the figures they print. The default run checks the ensemble (about 30 s of CPU
time); the grids (constant and adaptive steps, their checkpoints sharded) and the two-process
run (each process compiling the solve and its gradient twice) are `slow`.
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
