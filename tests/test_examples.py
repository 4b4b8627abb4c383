"""The examples run as scripts at their tiny size, write their plots, and hold their claims.

Each example is a jupytext percent-format script that asserts its own claim at the end and
writes `result.json` beside its plots; the checks here repeat the claims from that file. The
examples compile many gradients (several seconds each on two CPU cores): the default suite runs
only the quickest notebook (`scan_memory`); the others run with `-m slow` (20-60 s each at their
tiny size), with the demo. Their claims have unit tests in the default run: gradient memory flat
in the steps (`test_gradient_memory.py`, Gray-Scott's), flat in the depth of a layer stack and
gradients equal to `lax.scan`'s (`test_layers.py`, the deep residual network's), every adjoint's
gradient against Direct's (`test_adjoints.py`, the spiral's), Robertson (`test_implicit.py`),
DAEs with a mass matrix and consistent initial values (`test_dae.py`, the enzyme fit's).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


NOTEBOOKS = [
    "bouncing_ball_fit", "dae_fit", "deep_residual", "gray_scott", "neural_ode_reversible",
    "neural_ode_spiral", "robertson_fit", "robertson_plot", "scan_memory",
]  # fmt: skip


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_example_is_a_percent_format_notebook(name):
    # jupytext reads `# %%` cells; a notebook opens on its title and reads its size switch.
    source = (EXAMPLES / f"{name}.py").read_text()
    assert source.startswith("# %% [markdown]\n# # ")
    assert source.count("\n# %%\n") >= 3
    assert 'os.environ.get("ODECKPT_EXAMPLE_SIZE", "full")' in source


def run_example(name: str, output: Path) -> Path:
    """Run `examples/<name>.py` at the tiny size; **returns** the folder of its plots."""
    env = os.environ | {"ODECKPT_EXAMPLE_SIZE": "tiny", "ODECKPT_EXAMPLE_OUTPUT": str(output)}
    env["MPLBACKEND"] = "Agg"
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")], env=env, capture_output=True, text=True
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return output / name


def plots_written(folder: Path, names: list[str]) -> None:
    for name in names:
        path = folder / name
        assert path.stat().st_size > 10_000, path  # a real figure, not an empty canvas


@pytest.mark.slow
def test_scan_memory(tmp_path):
    folder = run_example("scan_memory", tmp_path)
    plots_written(folder, ["memory_vs_length.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["lax_scan_mib_per_step"] >= result["carry_mib"]
    assert result["checkpointed_growth_mib"] < result["carry_mib"]


@pytest.mark.slow
def test_gray_scott(tmp_path):
    folder = run_example("gray_scott", tmp_path)
    plots_written(folder, ["pattern.png", "memory.png"])
    result = json.loads((folder / "result.json").read_text())
    by_steps = list(result["temp_mib_recursive_by_steps"].values())
    assert max(by_steps) <= 1.1 * min(by_steps)
    assert max(result["temp_mib_by_checkpoints"].values()) < result["temp_mib_direct"] / 4


@pytest.mark.slow
def test_deep_residual(tmp_path):
    folder = run_example("deep_residual", tmp_path)
    plots_written(folder, ["training.png", "memory_vs_depth.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["gradient_relative_error"] < 1e-4
    assert result["final_loss"] < result["initial_loss"]
    by_depth = result["temp_mib_by_depth"]
    flat = list(by_depth[f"checkpointed_layers, c={result['checkpoints']}"].values())
    assert max(flat) <= 1.1 * min(flat)
    scan = {int(depth): mib for depth, mib in by_depth["lax.scan"].items()}
    assert scan[max(scan)] > 2 * scan[min(scan)]


@pytest.mark.slow
def test_neural_ode_spiral(tmp_path):
    folder = run_example("neural_ode_spiral", tmp_path)
    plots_written(folder, ["training.png", "adjoints.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["final_loss"] < result["initial_loss"]
    assert set(result["adjoints"]) >= {"direct", "recursive (default)", "backsolve"}


@pytest.mark.slow
def test_neural_ode_reversible(tmp_path):
    folder = run_example("neural_ode_reversible", tmp_path)
    plots_written(folder, ["training.png", "adjoints.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["final_loss"] < result["initial_loss"]
    assert result["adjoints"]["reversible"]["rel_error_vs_direct"] < 1e-8
    assert result["drift"]["succeeded"] and result["drift"]["num_undone_steps"] == result["steps"]


@pytest.mark.slow
def test_bouncing_ball_fit(tmp_path):
    folder = run_example("bouncing_ball_fit", tmp_path)
    plots_written(folder, ["fit.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["solved_bounce_time_error"] < 1e-9
    assert result["final_loss"] < result["initial_loss"]


@pytest.mark.slow
def test_robertson_fit(tmp_path):
    folder = run_example("robertson_fit", tmp_path)
    plots_written(folder, ["fit.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["final_loss"] < result["initial_loss"]


@pytest.mark.slow
def test_dae_fit(tmp_path):
    # The fit converges within the tiny size's 20 iterations (compiling costs more than
    # iterating), so the statistical claim is checked here: with Gaussian noise of known
    # deviation the least-squares log-constants lie within three standard errors of the truth
    # (99.7% per constant; the noise is seeded, so the check is deterministic), and those errors
    # are below 2.5%, so the check cannot pass from the start, 2.5 to 3.3 times off.
    folder = run_example("dae_fit", tmp_path)
    plots_written(folder, ["fit.png"])
    result = json.loads((folder / "result.json").read_text())
    assert result["initial_equilibrium_residual"] < 1e-8
    assert result["initial_substrate_total_error"] < 1e-12
    assert result["gradient_error"] < 1e-6
    assert result["final_loss"] < 0.6 < result["initial_loss"]  # the noise floor is about 0.49
    for log_error, standard_error in zip(
        result["log_errors"], result["standard_errors"], strict=True
    ):
        assert standard_error < 0.025
        assert log_error < 3 * standard_error


@pytest.mark.slow
def test_demo(tmp_path):
    output = tmp_path / "demo.png"
    completed = subprocess.run(
        [sys.executable, "-m", "odeckpt", "demo", "--tiny", "--output", str(output)],
        env=os.environ | {"MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    table = completed.stdout.splitlines()
    for adjoint in ("direct", "recursive (default)", "backsolve", "forward"):
        assert any(line.startswith(adjoint) for line in table), completed.stdout
    assert output.stat().st_size > 10_000
