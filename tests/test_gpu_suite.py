"""`benchmarks/gpu_suite.sh` refuses to run without a GPU, saying so, and its steps fit the 10
minutes it promises."""

import importlib.util
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_without_a_gpu():
    env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh")],
        capture_output=True, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert "no GPU found" in completed.stderr and "--cpu-smoke" in completed.stderr
    assert "gpu-suite" not in completed.stdout  # nothing ran


def test_steps_fit_ten_minutes(tmp_path):
    suite = load_suite()
    steps = suite.steps(smoke=False, results=tmp_path)
    names = ["tests", "offload", "layers", "gradients", "forward", "ensemble"]
    assert [step.name for step in steps] == names
    assert sum(step.timeout for step in steps) <= 600
    offload = next(step for step in steps if step.name == "offload").command
    assert offload[offload.index("--sizes") + 1 :][:4] == ["16", "18", "20", "22"]
    for step in steps[1:]:
        assert f"gpu-{step.name}" in step.command  # results named gpu-*
    for path in suite.GPU_TESTS:
        assert (ROOT / path).exists()
