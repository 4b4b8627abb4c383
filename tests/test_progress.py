"""The progress bar: at most about a hundred host callbacks per solve, whatever its steps.

Most tests run the solve's integration loop with a bar that records every report the compiled
loop sends to the host (each one host callback); the last ones read what `odeckpt.solve`'s
tqdm bar draws."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import odeckpt
from odeckpt._adjoints._base import while_loop
from odeckpt._loop import IntegrationLoop, LoopState, ProgressBar, ProgressMeter
from odeckpt._loop._progress import Report
from odeckpt._saveat import SaveAt
from odeckpt.checkpointing import bounded_while_loop


class Recorder:
    """A bar that asks for a report at every percent and keeps each one it is shown."""

    def __init__(self):
        self.reports: list[Report] = []
        self.target = 0

    def show(self, report: Report) -> int:
        if not (report.first or report.done) and report.percent < self.target:
            return self.target  # a stretch that a host segment cut short, as `ProgressBar`
        self.reports.append(report)
        self.target = report.percent + 1  # the next percent: a report at every percent
        return self.target

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


def euler_loop(a, bar, num_steps=None) -> IntegrationLoop:
    """`y' = -a y` over `[0, 1]` in Euler steps, reporting to `bar`."""
    return IntegrationLoop(
        f=lambda t, y, a: -a * y, args=a, stepper=odeckpt.Euler(),
        controller=odeckpt.ConstantStep(), t_end=jnp.array(1.0), ts=None,
        saveat=SaveAt(t1=True), max_steps=300, num_steps=num_steps,
        progress=ProgressMeter(jnp.array(0.0), jnp.array(1.0), bar),
    )  # fmt: skip


@pytest.mark.parametrize(
    "adjoint, num_steps",
    [
        (odeckpt.RecursiveCheckpointAdjoint(checkpoints=4), None),  # online binomial
        (odeckpt.RecursiveCheckpointAdjoint(), 256),  # every step's residuals
        (odeckpt.DirectAdjoint(), None),  # every state stored
        (odeckpt.RecursiveCheckpointAdjoint(offload="host", checkpoints=2), None),
    ],
    ids=["binomial", "residuals", "direct", "offload"],
)
def test_every_engine_regime_reports_its_forward_run_once_per_percent(adjoint, num_steps):
    forward, gradient = Recorder(), Recorder()

    def loss(a, bar):
        loop = euler_loop(a, bar, num_steps)
        # 256 steps, exact in binary: every whole percent is passed.
        state, _ = loop.init_state(jnp.array(0.0), jnp.ones(1), jnp.array(1 / 256))
        return adjoint.run(loop, state, loop.init_outputs(state)).state.y[0]

    value = jax.jit(lambda a: loss(a, forward))(0.5)
    slope = jax.jit(jax.grad(lambda a: loss(a, gradient)))(0.5)
    jax.effects_barrier()
    np.testing.assert_allclose(slope, -value / (1 - 0.5 / 256), rtol=1e-12)  # of (1 - a/256)^256
    assert forward.percents == list(range(101))
    if num_steps is None:
        assert gradient.reports == forward.reports
    else:  # the gradient that stores every step's residuals: a scan, reported at its ends
        assert gradient.reports == [forward.reports[0], forward.reports[-1]]


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve"])
def test_progress_changes_no_value_nor_derivative(adjoint):
    def solve(y0, t1, progress):
        sol = odeckpt.solve(
            lambda t, y, a: -y * jnp.sin(t), y0, (0.0, t1), adjoint=adjoint, max_steps=64,
            progress=progress,
        )  # fmt: skip
        return sol.ys[-1].sum()

    run = lambda progress: jax.jit(
        jax.vmap(jax.value_and_grad(lambda y0, t1: solve(y0, t1, progress), argnums=(0, 1)))
    )(jnp.ones((2, 2)), jnp.array([1.0, 2.0]))
    with_bar, without = run(True), run(False)
    jax.effects_barrier()
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), with_bar, without))


def test_the_bar_ignores_reports_after_its_solve_ended(capsys):
    bar = ProgressBar()
    for report in [(3, True, False), (50, False, False), (100, False, True), (60, False, False)]:
        bar.show(Report(*report))
    # (tqdm draws at opening and closing; the reports between come within its 0.1 s.)
    assert _drawn(capsys.readouterr().err) == [3, 100]


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
    # At most a draw per report (tqdm skips those within 0.1 s of the last), opening at 0% and
    # closing at 100%; one bar (one line).
    assert drawn[0] == 0 and drawn[-1] == 100 and drawn == sorted(drawn) and len(drawn) <= 102
    assert err.count("\n") == 1


def test_solve_closes_the_bar_where_it_stopped(capsys):
    sol = odeckpt.solve(
        decay, jnp.ones(1), (0.0, 1.0), rtol=1e-10, max_steps=5, throw=False, progress=True
    )
    jax.effects_barrier()
    assert sol.status == odeckpt.Status.max_steps_reached
    drawn = _drawn(capsys.readouterr().err)
    # Opened at 0%, closed below 100% (tqdm draws the steps in between only 0.1 s apart).
    assert 2 <= len(drawn) <= 7 and drawn == sorted(drawn) and drawn[0] == 0 and drawn[-1] < 100


def test_without_progress_the_program_calls_no_host():
    solve = lambda y0, progress: odeckpt.solve(
        decay, y0, (0.0, 1.0), throw=False, progress=progress
    )
    text = lambda progress: jax.jit(lambda y0: solve(y0, progress)).lower(jnp.ones(1)).as_text()
    assert "callback" not in text(False)
    assert "callback" in text(True)


def test_bounded_while_loop_reports_where_its_milestone_reaches_the_target():
    reports = []

    def on_host(n):
        reports.append(int(n))
        return np.int32(n // 10 + 1)  # the next milestone

    out = jax.ShapeDtypeStruct((), jnp.int32)
    report = lambda val: io_callback(on_host, out, val[0])
    milestone = lambda val: (val[0] // 10).astype(jnp.int32)
    body = lambda val: (val[0] + 1, val[1] * 2.0)

    def run(x):
        return bounded_while_loop(
            lambda val: val[0] < 35, body, (jnp.array(0), x), max_steps=100, checkpoints=3,
            progress=(milestone, report),
        )[1]  # fmt: skip

    plain = lambda x: bounded_while_loop(lambda val: val[0] < 35, body, (jnp.array(0), x),
                                         max_steps=100, checkpoints=3)[1]  # fmt: skip
    assert jax.jit(run)(1.0) == jax.jit(plain)(1.0) == 2.0**35
    jax.effects_barrier()
    assert reports == [0, 10, 20, 30, 35]  # before the first step, at each move, at the stop
    reports.clear()
    assert jax.jit(jax.grad(run))(1.0) == 2.0**35
    jax.effects_barrier()
    assert reports == [0, 10, 20, 30, 35]  # the reverse sweep reports nothing
    with pytest.raises(TypeError, match="int32 scalar"):
        bounded_while_loop(lambda val: val[0] < 35, body, (0, 1.0), max_steps=100,
                           progress=(lambda val: val[1], report))  # fmt: skip
    with pytest.raises(TypeError, match="report next"):
        bounded_while_loop(lambda val: val[0] < 35, body, (jnp.array(0), 1.0), max_steps=100,
                           progress=(milestone, lambda val: None))  # fmt: skip


def test_the_bar_asks_a_quick_solve_for_fewer_reports():
    # A solve that covers 1% in a microsecond is asked for its next report 0.1 s ahead (all of
    # it), one that covers 1% in a second for the next percent; a report short of the target
    # (a stretch that a host segment cut short) draws nothing and keeps the target.
    bar = ProgressBar()
    assert bar.show(Report(0, True, False)) == 1
    bar._opened = (bar._opened[0] - 1e-6, 0)
    assert bar.show(Report(1, False, False)) == 100
    assert bar.show(Report(40, False, False)) == 100
    bar._opened = (bar._opened[0] - 100.0, 0)
    assert bar.show(Report(100, False, False)) == 100
    bar = ProgressBar()
    bar.show(Report(0, True, False))
    bar._opened = (bar._opened[0] - 10.0, 0)
    assert bar.show(Report(2, False, False)) == 3
    assert bar.show(Report(100, False, True)) > 100
