"""`odeckpt.plot`: matplotlib loads lazily, and each plot draws what it claims."""

import doctest
import subprocess
import sys

import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import odeckpt
import odeckpt.plot
from odeckpt.checkpointing.schedules import offline_schedule, optimal_cost, simulate

matplotlib.use("Agg")


def oscillator(t, y, args):
    return jnp.stack([y[1], -y[0]])


def test_import_odeckpt_does_not_import_matplotlib():
    code = (
        "import sys, odeckpt, odeckpt.plot; odeckpt.solve; odeckpt.memory_report; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_solution_needs_steps_or_dense_output():
    sol = odeckpt.solve(oscillator, jnp.array([1.0, 0.0]), (0.0, 1.0), saveat=jnp.ones(3) / 2)
    with pytest.raises(ValueError, match=r"SaveAt\(steps=True\)"):
        odeckpt.plot.solution(sol)


def test_solution_marks_every_accepted_step():
    saveat = odeckpt.SaveAt(t0=True, steps=True)
    sol = odeckpt.solve(oscillator, jnp.array([1.0, 0.0]), (0.0, 6.0), saveat=saveat)
    ax = odeckpt.plot.solution(sol, labels=["position", "velocity"])
    markers = ax.lines[1]
    assert len(markers.get_xdata()) == int(sol.stats.num_accepted_steps) + 1
    assert [text.get_text() for text in ax.get_legend().get_texts()] == ["position", "velocity"]
    sizes = odeckpt.plot.step_sizes(sol).lines[0].get_ydata()
    assert len(sizes) == int(sol.stats.num_accepted_steps)
    np.testing.assert_allclose(np.sum(sizes), 6.0)


def test_schedule_draws_the_simulated_run():
    n, c = 20, 4
    ax = odeckpt.plot.schedule(n, c)
    lines = {line.get_label(): line for line in ax.lines}
    reversals = np.asarray(lines["reverse"].get_xdata())
    advances = np.asarray(lines["advance"].get_xdata())
    # Segments are (start, end, NaN) triples: n reverse steps and t(n, c) forward steps.
    assert len(reversals) == 3 * n
    assert len(advances) == 3 * optimal_cost(n, c)
    assert reversals[1::3].tolist() == list(simulate(offline_schedule(n, c), n).reversal_order)
    assert f"{optimal_cost(n, c)} forward steps" in ax.get_title()


def test_docstring_examples():
    result = doctest.testmod(odeckpt.plot, raise_on_error=False, verbose=False)
    assert result.failed == 0 and result.attempted > 0, result
