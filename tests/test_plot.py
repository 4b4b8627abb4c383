"""`odeckpt.plot`: matplotlib loads lazily, and each plot draws what it claims."""

import dataclasses
import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest

import odeckpt
import odeckpt.plot
from odeckpt.checkpointing.schedules import offline_schedule, optimal_cost, simulate

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent
EPS = 1e-6  # the time scale of `hyperbola` at t = 0


def oscillator(t, y, args):
    return jnp.stack([y[1], -y[0]])


def hyperbola(t, y, args):
    """`y = EPS / (t + EPS)`: its time scale grows with `t`, as a stiff problem's steps do."""
    return -y / (t + EPS)


def drawn(ax, gid: str) -> list:
    return [artist for artist in [*ax.lines, *ax.collections] if artist.get_gid() == gid]


def legend(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


@pytest.fixture(scope="module")
def oscillator_solution():
    """Every kind of output: t0, one save time, the step ends, t1 and the dense output."""
    saveat = odeckpt.SaveAt(t0=True, ts=jnp.array([2.5]), steps=True, t1=True, dense=True)
    return odeckpt.solve(oscillator, jnp.array([1.0, 0.0]), (0.0, 6.0), saveat=saveat)


@pytest.fixture(scope="module")
def log_time_solution():
    # 118 accepted steps from t = 0 to 1e6; the first ends near 2e-7.
    saveat = odeckpt.SaveAt(t0=True, ts=jnp.logspace(-4, 6, 11), dense=True)
    return odeckpt.solve(
        hyperbola, jnp.array([1.0]), (0.0, 1e6), saveat=saveat, rtol=1e-6, atol=1e-12
    )


@pytest.fixture(scope="module")
def ensemble():
    """Four damped oscillators with different stiffnesses, batched by `jax.vmap`."""

    def solve(k):
        field = lambda t, y, k: jnp.stack([y[1], -k * y[0] - 0.3 * y[1]])
        saveat = odeckpt.SaveAt(ts=jnp.linspace(0.0, 5.0, 6), dense=True)
        return odeckpt.solve(field, jnp.array([1.0, 0.0]), (0.0, 5.0), k, saveat=saveat)

    return jax.vmap(solve)(jnp.array([0.5, 1.0, 2.0, 4.0]))


def test_import_odeckpt_does_not_import_matplotlib():
    code = (
        "import sys, odeckpt, odeckpt.plot; odeckpt.solve; odeckpt.memory_report; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_solution_marks_every_accepted_step_and_saved_point(oscillator_solution):
    sol = oscillator_solution
    accepted = int(sol.stats.num_accepted_steps)
    ax = odeckpt.plot.solution(sol, labels=["position", "velocity"])
    (ticks,) = drawn(ax, "steps")
    np.testing.assert_allclose(ticks.get_xdata(), sol.dense.t_ends[:accepted])
    # t0, the save time, every step end and t1.
    assert [len(line.get_xdata()) for line in drawn(ax, "saved")] == [accepted + 3] * 2
    assert legend(ax) == ["position", "velocity", "saved points", "step ends"]
    assert ax.get_title() == f"solution ({accepted} accepted steps)"
    # The step sizes come from the dense output or the steps block, never the other points.
    for which in (sol, dataclasses.replace(sol, dense=None)):
        sizes = odeckpt.plot.step_sizes(which).lines[0].get_ydata()
        assert len(sizes) == accepted
        np.testing.assert_allclose(np.sum(sizes), 6.0)


def test_saved_points_alone_are_joined_by_straight_lines(oscillator_solution):
    sol = dataclasses.replace(oscillator_solution, dense=None)
    ax = odeckpt.plot.solution(sol, steps=False)
    saved_t = np.sort(sol.ts[np.isfinite(sol.ts)])
    for curve, points in zip(drawn(ax, "curve"), drawn(ax, "saved"), strict=True):
        np.testing.assert_array_equal(curve.get_xdata(), saved_t)
        assert len(points.get_xdata()) == len(saved_t)
    np.testing.assert_allclose(drawn(ax, "curve")[0].get_ydata(), np.cos(saved_t), atol=1e-3)
    assert drawn(ax, "steps") == [] and legend(ax) == ["y[0]", "y[1]", "saved points"]
    only_t1 = dataclasses.replace(sol, ts=sol.ts[-1:], ys=sol.ys[-1:])
    with pytest.raises(ValueError, match=r"SaveAt\(steps=True\)"):
        odeckpt.plot.step_sizes(only_t1)


def test_log_time_axis_is_chosen_and_drawn_from_a_geometric_grid(log_time_solution):
    sol = log_time_solution
    ax = odeckpt.plot.solution(sol, samples=200)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "linear"
    (curve,) = drawn(ax, "curve")
    t, y = np.asarray(curve.get_xdata()), np.asarray(curve.get_ydata())
    assert t[0] == float(sol.dense.t_ends[0]) and t[-1] == 1e6  # never past the steps
    # 200 times over about 12.6 decades, and the step ends: 15 or more in each whole decade.
    per_decade = np.histogram(np.log10(t), bins=12, range=(-6, 6))[0]
    assert per_decade.min() >= 15, per_decade
    # The dense output itself at every time drawn (a flat or extrapolated line is far off).
    np.testing.assert_allclose(y, EPS / (t + EPS), rtol=0.02)
    # The saved points at t > 0 (t0 = 0 and the 11 save times): a log axis cannot show t0.
    assert len(drawn(ax, "saved")[0].get_xdata()) == 11
    assert len(drawn(ax, "steps")[0].get_xdata()) == int(sol.stats.num_accepted_steps)
    ax = odeckpt.plot.step_sizes(sol)
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    np.testing.assert_allclose(np.sum(ax.lines[0].get_ydata()), 1e6)


def test_linear_time_axis_for_an_oscillator_and_log_values_leave_out_those_below_zero(
    oscillator_solution,
):
    ax = odeckpt.plot.solution(oscillator_solution, yscale="log", samples=100)
    assert (ax.get_xscale(), ax.get_yscale()) == ("linear", "log")
    curve = drawn(ax, "curve")[0]
    t, y = np.asarray(curve.get_xdata()), np.asarray(curve.get_ydata())
    assert np.all(t[:-1] < t[1:]) and len(t) >= 100
    assert np.all(np.isnan(y[np.cos(t) < -1e-3])) and np.all(y[np.cos(t) > 1e-3] > 0)
    assert odeckpt.plot.solution(oscillator_solution, xscale="log").get_xscale() == "log"


def test_pytree_components_are_labelled_by_their_paths():
    def field(t, y, args):
        return {"grid": -y["grid"], "s": y["s"]}

    y0 = {"grid": jnp.ones((1, 2)), "s": jnp.array(1.0)}
    saveat = odeckpt.SaveAt(ts=jnp.array([0.5, 1.0]), dense=True)
    sol = odeckpt.solve(field, y0, (0.0, 1.0), saveat=saveat)
    ax = odeckpt.plot.solution(sol, samples=20)
    assert legend(ax)[:3] == ["y['grid'][0, 0]", "y['grid'][0, 1]", "y['s']"]
    ax = odeckpt.plot.solution(sol, components=[2], labels=["s"], samples=20)
    assert legend(ax)[0] == "s" and ax.get_title().endswith("1 of 3 components")
    np.testing.assert_allclose(drawn(ax, "saved")[0].get_ydata(), np.exp([0.5, 1.0]), rtol=1e-4)


def test_an_ensemble_is_drawn_as_a_band_around_its_median(ensemble):
    ax = odeckpt.plot.solution(ensemble, samples=50)
    bands, medians = drawn(ax, "band"), drawn(ax, "curve")
    assert len(bands) == len(medians) == 2
    assert legend(ax) == ["y[0]", "y[1]", "min to max"]
    assert ax.get_title() == "4 solutions: median, band min to max"
    t = np.asarray(medians[0].get_xdata())
    member = lambda i: jax.tree.map(lambda x: x[i], ensemble)
    members = np.stack([member(i).evaluate(t)[:, 0] for i in range(4)])
    np.testing.assert_allclose(medians[0].get_ydata(), np.median(members, axis=0), atol=1e-12)
    # The band's outline runs along the lowest member and back along the highest.
    outline = bands[0].get_paths()[0].vertices
    np.testing.assert_allclose(outline[1 : len(t) + 1, 1], members.min(axis=0), atol=1e-12)
    np.testing.assert_allclose(outline[-len(t) - 1 : -1, 1], members.max(axis=0)[::-1], atol=1e-12)
    assert drawn(ax, "saved") == [] and drawn(ax, "steps") == []


def test_an_ensemble_without_dense_output_needs_common_save_times(ensemble):
    saved = dataclasses.replace(ensemble, dense=None)
    ax = odeckpt.plot.solution(saved, band=(0.25, 0.75))
    assert len(drawn(ax, "band")) == 2 and legend(ax)[-1] == "quantiles 0.25 to 0.75"
    np.testing.assert_allclose(
        drawn(ax, "curve")[1].get_ydata(), np.median(ensemble.ys[:, :, 1], axis=0)
    )
    shifted = dataclasses.replace(saved, ts=saved.ts + jnp.arange(4.0)[:, None])
    with pytest.raises(ValueError, match="saved at different times"):
        odeckpt.plot.solution(shifted)


def test_a_failed_solve_is_drawn_up_to_where_it_stopped(oscillator_solution):
    # The dense output of a solve that stopped after its third step.
    dense = dataclasses.replace(oscillator_solution.dense, num_accepted=jnp.asarray(3))
    ax = odeckpt.plot.solution(dataclasses.replace(oscillator_solution, dense=dense))
    curve = drawn(ax, "curve")[0]
    assert curve.get_xdata()[-1] == float(dense.t_ends[2])
    assert np.all(np.isfinite(curve.get_ydata()))
    assert len(drawn(ax, "steps")[0].get_xdata()) == 3


def test_a_failed_solve_says_so_in_the_title():
    sol = odeckpt.solve(oscillator, jnp.array([1.0, 0.0]), (0.0, 10.0), max_steps=3,
                        saveat=odeckpt.SaveAt(dense=True), throw=False)  # fmt: skip
    ax = odeckpt.plot.solution(sol, samples=20)
    assert ax.get_title() == "solution (3 accepted steps, failed: max_steps_reached)"


def test_a_complex_state_is_drawn_as_its_real_and_imaginary_parts():
    ts = jnp.linspace(0.0, 3.0, 5)
    sol = odeckpt.solve(lambda t, y, a: 1j * y, jnp.ones(1, complex), (0.0, 3.0), saveat=ts,
                        rtol=1e-10, atol=1e-10)  # fmt: skip
    ax = odeckpt.plot.solution(sol)
    assert legend(ax)[:2] == ["Re y[0]", "Im y[0]"]
    real, imaginary = (line.get_ydata() for line in drawn(ax, "saved"))
    np.testing.assert_allclose(real, np.cos(ts), atol=1e-8)
    np.testing.assert_allclose(imaginary, np.sin(ts), atol=1e-8)


def test_wrong_arguments_name_the_fix(oscillator_solution):
    sol = oscillator_solution
    with pytest.raises(ValueError, match="`xscale` must be one of"):
        odeckpt.plot.solution(sol, xscale="logarithmic")
    with pytest.raises(ValueError, match="1 labels for 2 components"):
        odeckpt.plot.solution(sol, labels=["x"])
    with pytest.raises(ValueError, match="component 2 does not exist"):
        odeckpt.plot.solution(sol, components=[2])
    with pytest.raises(ValueError, match="two quantiles"):
        odeckpt.plot.solution(sol, band=(0.9, 0.1))
    earlier = dataclasses.replace(sol, ts=sol.ts - 10, t0=sol.t0 - 10, t1=sol.t1 - 10, dense=None)
    with pytest.raises(ValueError, match='needs positive times.*xscale="linear"'):
        odeckpt.plot.solution(earlier, xscale="log")


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


def test_the_code_shown_in_the_docs_is_that_of_the_example():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs/api/plot.md").read_text(), re.S)
    script = (ROOT / "examples/robertson_plot.py").read_text()
    assert len(blocks) == 2 and all(block in script for block in blocks)


@pytest.mark.slow
def test_robertson_example(tmp_path):
    # The stiff figures of docs/api/plot.md, at their tiny size: Radau5 from 0 to 1e5.
    script = ROOT / "examples" / "robertson_plot.py"
    env = os.environ | {"ODECKPT_EXAMPLE_SIZE": "tiny", "ODECKPT_EXAMPLE_OUTPUT": str(tmp_path)}
    completed = subprocess.run(
        [sys.executable, str(script)], env=env | {"MPLBACKEND": "Agg"}, capture_output=True
    )
    assert completed.returncode == 0, completed.stderr.decode()
    assert (tmp_path / "robertson_plot" / "robertson.png").stat().st_size > 10_000
