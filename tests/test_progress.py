"""The progress bar: at most about a hundred host callbacks per solve, whatever its steps.

Most tests run the solve's integration loop with a bar that records every report the compiled
loop sends to the host (each one host callback); the last ones read what `odeckpt.solve`'s
tqdm bar draws."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odeckpt
from odeckpt._adjoints._base import while_loop
from odeckpt._loop import IntegrationLoop, LoopState, ProgressBar, ProgressMeter
from odeckpt._loop._progress import Report
from odeckpt._saveat import SaveAt


class Recorder:
    """A bar that keeps every report it is shown (one per host callback)."""

    def __init__(self):
        self.reports: list[Report] = []

    def show(self, report: Report) -> None:
        self.reports.append(report)

    @property
    def percents(self) -> list[int]:
        return [r.percent for r in self.reports]


def run_loop(
    f, y0, t_span, bar, *, dt0, args=None, stepper=None, controller=None, max_steps=200_000
) -> LoopState:
    """The final state of `solve`'s loop over `t_span` (constant Euler steps of `dt0` unless
    told otherwise), its progress meter reporting to `bar`."""
    t0, t1 = (jnp.asarray(t, jnp.float64) for t in t_span)
    loop = IntegrationLoop(
        f=f, args=args, stepper=stepper or odeckpt.Euler(),
        controller=controller or odeckpt.ConstantStep(), t_end=t1, ts=None,
        saveat=SaveAt(t1=True), max_steps=max_steps, progress=ProgressMeter(t0, t1, bar),
        throw=False,
    )  # fmt: skip
    state, _ = loop.init_state(t0, y0, jnp.asarray(dt0, jnp.float64))
    final, _, _ = while_loop(loop, state, loop.init_outputs(state))
    return final


decay = lambda t, y, args: -y


def test_a_100k_step_solve_calls_the_host_once_per_percent():
    bar = Recorder()
    final = jax.jit(lambda y0: run_loop(decay, y0, (0.0, 1.0), bar, dt0=1e-5))(jnp.ones(1))
    jax.effects_barrier()
    assert int(final.num_steps) >= 100_000
    np.testing.assert_allclose(final.y, np.exp(-1.0), rtol=1e-4)
    # One callback at the first step (0%), one per whole percent passed, the last at 100%.
    assert bar.percents == list(range(101))
    assert [r.first for r in bar.reports] == [True] + [False] * 100
    assert [r.done for r in bar.reports] == [False] * 100 + [True]


def test_under_vmap_one_report_per_percent_of_the_slowest_lane():
    bar = Recorder()
    run = lambda dt0: run_loop(decay, jnp.ones(1), (0.0, 1.0), bar, dt0=dt0).num_steps
    steps = jax.jit(jax.vmap(run))(jnp.array([2e-5, 1e-5, 4e-5]))
    jax.effects_barrier()
    np.testing.assert_allclose(steps, [50_000, 100_000, 25_000], atol=1)
    # Not one callback per lane and step (a `lax.cond` on a batched predicate becomes a
    # select), nor one per lane and percent: one per percent of the lane with `dt0 = 1e-5`.
    assert bar.percents == list(range(101))
    assert sum(r.done for r in bar.reports) == 1 and bar.reports[-1].done


def test_a_failed_lane_stops_holding_the_bar_and_the_end_shows_where_it_stopped():
    bar = Recorder()
    blow_up = lambda t, y, a: a * y**2  # y = 1 / (1 - t) where a = 1: infinite at t = 1

    def run(a):
        final = run_loop(blow_up, jnp.ones(1), (0.0, 2.0), bar, dt0=1e-4, args=a)
        return final.t, final.status == odeckpt.Status.successful

    t, successful = jax.jit(jax.vmap(run))(jnp.array([1.0, 0.0]))
    jax.effects_barrier()
    assert successful.tolist() == [False, True]
    stopped = int(np.floor(100 * float(t[0]) / 2))
    assert 45 <= stopped < 60
    # The bar follows the lane that runs on to 99%, then closes at the failed lane's percent.
    assert bar.percents == [*range(100), stopped]
    assert [r.done for r in bar.reports] == [False] * 100 + [True]


def test_a_span_over_decades_moves_in_log_time():
    bar = Recorder()
    root = lambda t, y, args: y / (2 * t)  # y = sqrt(t / t0)
    controller = odeckpt.PIDController(rtol=1e-8, atol=1e-12)
    final = run_loop(
        root, jnp.ones(1), (1e-5, 1e11), bar, dt0=1e-7, stepper=odeckpt.Tsit5(),
        controller=controller,
    )  # fmt: skip
    jax.effects_barrier()
    np.testing.assert_allclose(final.y, 1e8, rtol=1e-5)
    # The steps grow with t, about 18 a decade: every percent is reported, where the part of
    # the span covered in t itself would pass 1% only in the last of the sixteen decades.
    assert int(final.num_steps) > 200
    assert bar.percents == list(range(101))


def test_the_part_covered_is_linear_or_logarithmic_as_the_span_says():
    part = lambda t0, t1, t: float(ProgressMeter(jnp.array(t0), jnp.array(t1), None).fraction(t))
    assert part(0.0, 1.0, 0.25) == pytest.approx(0.25)
    assert part(1.0, 100.0, 50.5) == pytest.approx(0.5)  # two decades: linear
    assert part(1e-5, 1e11, 1e3) == pytest.approx(0.5)  # sixteen: logarithmic
    assert part(-1e11, -1e-5, -1e3) == pytest.approx(0.5)  # a backward solve's internal time
    assert part(-1.0, 1e6, 0.0) == pytest.approx(1 / (1 + 1e6))  # through zero: linear
    assert part(2.0, 2.0, 2.0) == 1.0  # an empty span is covered


def test_a_gradient_reverse_sweep_reports_nothing():
    controller = odeckpt.PIDController(rtol=1e-6, atol=1e-8)
    forward, gradient = Recorder(), Recorder()

    def loss(a, bar):
        loop = IntegrationLoop(
            f=lambda t, y, a: -a * y, args=a, stepper=odeckpt.Tsit5(), controller=controller,
            t_end=jnp.array(5.0), ts=None, saveat=SaveAt(t1=True), max_steps=64,
            progress=ProgressMeter(jnp.array(0.0), jnp.array(5.0), bar),
        )  # fmt: skip
        state, _ = loop.init_state(jnp.array(0.0), jnp.ones(1), None)
        result = odeckpt.RecursiveCheckpointAdjoint().run(loop, state, loop.init_outputs(state))
        return result.state.y[0]

    value = jax.jit(lambda a: loss(a, forward))(0.3)
    slope = jax.jit(jax.grad(lambda a: loss(a, gradient)))(0.3)
    jax.effects_barrier()
    np.testing.assert_allclose(slope, -5 * value, rtol=1e-5)
    assert len(forward.reports) >= 5  # the bar moves
    assert gradient.reports == forward.reports


def test_a_step_that_reports_is_differentiable():
    """A reverse sweep differentiates the steps past its record of them as they are, progress
    meter included (in `t_end`, which the meter reads too)."""
    loop = lambda t_end: IntegrationLoop(
        f=decay, args=None, stepper=odeckpt.Euler(), controller=odeckpt.ConstantStep(),
        t_end=t_end, ts=None, saveat=SaveAt(t1=True), max_steps=10,
        progress=ProgressMeter(jnp.array(0.0), t_end, Recorder()),
    )  # fmt: skip

    def y1(y0, t_end):
        state, _ = loop(t_end).init_state(jnp.array(0.0), y0, jnp.array(0.5))
        return loop(t_end).step(state)[0].y[0]

    grads = jax.grad(y1, argnums=(0, 1))(jnp.ones(1), jnp.array(0.25))
    np.testing.assert_allclose(grads[0], [0.75])  # a step of 0.25, clipped to t_end
    np.testing.assert_allclose(grads[1], -1.0)


def test_the_bar_ignores_reports_after_its_solve_ended(capsys):
    bar = ProgressBar()
    for report in [(3, True, False), (50, False, False), (100, False, True), (60, False, False)]:
        bar.show(Report(*report))
    assert _drawn(capsys.readouterr().err) == [3, 50, 100, 100]


def _drawn(err: str) -> list[int]:
    """The percentages tqdm drew, in order."""
    return [int(p) for p in re.findall(r"odeckpt\.solve:\s+(\d+)%", err)]


def test_solve_draws_the_bar_about_a_hundred_times(capsys):
    solve = jax.jit(
        lambda y0: odeckpt.solve(
            decay, y0, (0.0, 1.0), solver="euler", dt0=1e-5, max_steps=200_000, progress=True
        )
    )
    sol = solve(jnp.ones(1))
    jax.effects_barrier()
    assert int(sol.stats.num_steps) >= 100_000
    err = capsys.readouterr().err
    drawn = _drawn(err)
    # A draw per report, and one more as the bar closes; one bar (one line).
    assert drawn == [*range(101), 100]
    assert err.count("\n") == 1


def test_solve_closes_the_bar_where_it_stopped(capsys):
    sol = odeckpt.solve(
        decay, jnp.ones(1), (0.0, 1.0), rtol=1e-10, max_steps=5, throw=False, progress=True
    )
    jax.effects_barrier()
    assert sol.status == odeckpt.Status.max_steps_reached
    drawn = _drawn(capsys.readouterr().err)
    assert len(drawn) == 6 and drawn == sorted(drawn) and drawn[-1] < 100


def test_without_progress_the_program_calls_no_host():
    solve = lambda y0, progress: odeckpt.solve(
        decay, y0, (0.0, 1.0), throw=False, progress=progress
    )
    text = lambda progress: jax.jit(lambda y0: solve(y0, progress)).lower(jnp.ones(1)).as_text()
    assert "callback" not in text(False)
    assert "callback" in text(True)
