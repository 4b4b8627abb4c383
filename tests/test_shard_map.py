"""Gradients inside `jax.shard_map` (with JAX's default type checks) equal those on one device,
for every adjoint, an event, a DAE and the checkpointing engine, also of a loss summed over
the devices (data-parallel), and under `jax.jit` over `Explicit` mesh axes; a failing lane
with `throw=True` raises within seconds, naming the lane, inside `shard_map` and in a batch
sharded by `jax.jit`, under `jax.jit` and `odeckpt.jit`, and never leaves a device waiting on
another.

The device count must be set before JAX starts, so the checks run in fresh processes
(`shard_map_checks.py`) with 4 CPU devices; this file asserts on the figures they print. The
default run checks the README's case (the recursive adjoint with Tsit5), the continuous
adjoint and the engine; `-m slow` every adjoint.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("test_shard_map")

SCRIPT = Path(__file__).resolve().parent / "shard_map_checks.py"
FAST = ["recursive-tsit5"]
SLOW = ["backsolve-tsit5", "direct-tsit5", "forward-tsit5", "interpolating-dopri5",
        "forward_sensitivity-kvaerno5", "recursive-radau5", "reversible", "recursive-event",
        "recursive-dae"]  # fmt: skip


def run_checks(*arguments: str, timeout: float = 600) -> dict:
    env = os.environ | {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-5000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_checks() -> dict:
    return run_checks("adjoints", "engine", "throw", "explicit", "--cases", *FAST)


@pytest.mark.parametrize("case", FAST)
def test_gradients_inside_shard_map_equal_one_device(default_checks, case):
    """Each lane's gradient, and the gradient of the loss summed over the devices' lanes by
    `lax.psum` (data-parallel training), equal those of `vmap` on one device."""
    assert default_checks["adjoints"][case] <= 1e-12
    assert default_checks["adjoints"][f"{case}/psum"] <= 1e-12
    assert default_checks["adjoints"]["solve"] <= 1e-12


@pytest.mark.slow
def test_every_adjoint_inside_shard_map():
    result = run_checks("adjoints", "--cases", *SLOW)["adjoints"]
    reverse = [case for case in SLOW if not case.startswith("forward-")]
    keys = SLOW + [f"{case}/psum" for case in reverse]
    assert {key: result[key] <= 1e-12 for key in keys} == dict.fromkeys(keys, True), result


def test_checkpointing_engine_inside_shard_map(default_checks):
    assert default_checks["engine"] == {"checkpointed_scan": 0.0, "bounded_while_loop": 0.0}


THROWING = {
    "shard_map": "Lane 1 of 2 on shard 2 of 4 of the jax.shard_map failed: ",
    "shard_map_gradient": "Lane 1 of 2 on shard 2 of 4 of the jax.shard_map failed: ",
    "sharded_jit": "Lane 5 of 8 failed: ",
}


@pytest.mark.parametrize("compile_", ["jax.jit", "odeckpt.jit"])
@pytest.mark.parametrize("program", list(THROWING))
def test_a_failing_lane_raises_naming_it(default_checks, compile_, program):
    """Lane 5 of 8 (lane 1 of shard 2) fails with `throw=True`: under `jax.jit` every device
    raises from its host callback at once, under `odeckpt.jit` the host raises after the call;
    the message names the lane. (A device left waiting in a collective would make XLA abort
    the checks' process after its 40 s rendezvous timeout, failing every test here.)"""
    result = default_checks["throw"][f"{compile_}/{program}"]
    kind = "JaxRuntimeError" if compile_ == "jax.jit" else "EquinoxRuntimeError"
    assert result["raised"] == kind, result
    expected = THROWING[program] + "The vector field is NaN or inf at the initial point"
    assert expected in result["message"], result["message"]


def test_explicit_axes(default_checks):
    """`jax.jit` of `vmap(solve)` and of `vmap(grad)` over lanes sharded on a mesh whose axis
    is `Explicit` (the default of `jax.make_mesh`), with and without `jax.set_mesh`, and of
    the checkpointing engine's gradients: one device's figures, sharded by lane."""
    result = default_checks["explicit"]
    assert result["solve"] <= 1e-12 and result["grad"] <= 1e-12
    assert result["without_set_mesh"] <= 1e-12 and result["engine"] <= 1e-12
    assert result["ys_spec"] == "P('lanes', None, None)"


@pytest.mark.slow
def test_explicit_axes_every_case():
    """Every adjoint and stepper family of `CASES` (and an event, a DAE) over `Explicit` axes."""
    cases = [*FAST, *SLOW]
    result = run_checks("explicit_cases", "--cases", *cases)["explicit_cases"]
    figures = {case: (result[case]["grad"] <= 1e-12, result[case]["lanes"]) for case in cases}
    assert figures == dict.fromkeys(cases, (True, True)), result


@pytest.mark.slow
def test_explicit_axes_ensemble_and_odeckpt_jit():
    """`odeckpt.ensemble` and `odeckpt.jit` over `Explicit` axes equal one device, sharded by
    lane; a failing lane with `throw=True` raises naming it, under `jax.jit` and `odeckpt.jit`."""
    result = run_checks("explicit_programs")["explicit_programs"]
    for program in ("ensemble", "odeckpt.jit"):
        assert result[program] == {"difference": 0.0, "spec": "P('lanes', None, None)"}, result
    for compile_, kind in (("jax.jit", "JaxRuntimeError"), ("odeckpt.jit", "EquinoxRuntimeError")):
        raised = result[f"{compile_}/throw"]
        assert raised["raised"] == kind, raised
        assert "Lane 5 of 8 failed: The vector field is NaN or inf" in raised["message"], raised
