"""The cost of `progress=True`: 100,000-step solves timed with the bar off and on.

    python benchmarks/bench_progress.py             # about a minute on 2 CPU cores
    python benchmarks/bench_progress.py --quick     # smoke run: 3 calls each

Problems (float64, `throw` on, y(t1) only, about 100,000 constant steps each):

- `decay, euler`: `dy/dt = -y`, `y0 = 1`, Euler with steps of 1e-5 over [0, 1]: the cheapest
  step there is, so the worst case for a cost paid per step.
- `lotka_volterra, tsit5`: prey and predator from (10, 5), rates (1.1, 0.4, 0.4, 0.1), Tsit5
  with steps of 1e-3 over [0, 100].
- `lorenz96 (40), tsit5`: Lorenz-96 with 40 variables and forcing 8, `dx_i/dt = (x_{i+1} -
  x_{i-2}) x_{i-1} - x_i + 8`, from `8 + 0.01 sin(i)`, Tsit5 with steps of 1e-3 over [0, 100]:
  a step of about a microsecond, as in a small chemical or neural model.
- `lotka_volterra, tsit5, vmap 16`: the same under `jax.vmap` over 16 initial states (one
  bar: the slowest lane).

Each solve is `jax.jit`ted and called once to compile; then the two candidates (`progress=False`
and `progress=True`) are called in turns, `--repeats` times each, every call ended by
`jax.block_until_ready` and `jax.effects_barrier` (so that the host callbacks have run) with
tqdm writing to a buffer. The figures are the best call of each (`ms off`, `ms on`), their
ratio, the time the bar adds per step and per solve, and the host updates per solve: the draws
tqdm made, counted in its output (a draw per host callback, and one more as the bar closes).

Results go to `benchmarks/results/progress.{json,md}` (`progress-quick.*` with `--quick`).
"""

import argparse
import contextlib
import dataclasses
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from _harness import Column, environment, write_results  # noqa: E402

import odeckpt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Problem:
    """A solve of constant steps: `solve(y0, progress)` and its `y0`."""

    name: str
    solve: Callable[[Any, bool], Any]
    y0: Any


def _decay(y0, progress: bool):
    f = lambda t, y, args: -y
    return odeckpt.solve(
        f, y0, (0.0, 1.0), solver="euler", dt0=1e-5, max_steps=200_000, progress=progress
    )


def _lotka_volterra(y0, progress: bool):
    def f(t, y, args):
        prey, predator = y
        return jnp.stack(
            [1.1 * prey - 0.4 * prey * predator, 0.1 * prey * predator - 0.4 * predator]
        )

    return odeckpt.solve(
        f, y0, (0.0, 100.0), solver="tsit5", controller=odeckpt.ConstantStep(), dt0=1e-3,
        max_steps=200_000, progress=progress,
    )  # fmt: skip


def _lorenz96(y0, progress: bool):
    def f(t, x, args):
        return (jnp.roll(x, -1) - jnp.roll(x, 2)) * jnp.roll(x, 1) - x + 8.0

    return odeckpt.solve(
        f, y0, (0.0, 100.0), solver="tsit5", controller=odeckpt.ConstantStep(), dt0=1e-3,
        max_steps=200_000, progress=progress,
    )  # fmt: skip


LV_Y0 = jnp.array([10.0, 5.0])
PROBLEMS = [
    Problem("decay, euler", _decay, jnp.ones(1)),
    Problem("lotka_volterra, tsit5", _lotka_volterra, LV_Y0),
    Problem("lorenz96 (40), tsit5", _lorenz96, 8.0 + 0.01 * jnp.sin(jnp.arange(40.0))),
    Problem(
        "lotka_volterra, tsit5, vmap 16",
        jax.vmap(_lotka_volterra, in_axes=(0, None)),
        LV_Y0 * jnp.linspace(0.9, 1.1, 16)[:, None],
    ),
]


def _call(fn: Callable, y0) -> tuple[float, int]:
    """Seconds of one call of `fn(y0)`, host callbacks included, and the tqdm draws it made."""
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        start = time.perf_counter()
        jax.block_until_ready(fn(y0))
        jax.effects_barrier()
        seconds = time.perf_counter() - start
    return seconds, out.getvalue().count("\r")


def measure(problem: Problem, repeats: int) -> dict:
    """The problem's row: best times off and on, their ratio, the cost per step and per solve,
    and the draws per solve."""
    runs = {p: jax.jit(lambda y0, p=p: problem.solve(y0, p).ys) for p in (False, True)}
    steps = int(jnp.max(jax.jit(lambda y0: problem.solve(y0, False).stats.num_steps)(problem.y0)))
    for run in runs.values():
        _call(run, problem.y0)  # compile
    times: dict[bool, list[float]] = {False: [], True: []}
    draws: set[int] = set()
    for _ in range(repeats):
        for progress, run in runs.items():
            seconds, drawn = _call(run, problem.y0)
            times[progress].append(seconds)
            if progress:
                draws.add(drawn)
    off, on = min(times[False]), min(times[True])
    return {
        "problem": problem.name,
        "steps": steps,
        "off_ms": 1e3 * off,
        "on_ms": 1e3 * on,
        "ratio": on / off,
        "added_ms": 1e3 * (on - off),
        "added_ns_per_step": 1e9 * (on - off) / steps,
        "draws_per_solve": ", ".join(str(d) for d in sorted(draws)),
        "repeats": repeats,
    }


COLUMNS = [
    Column("problem", "problem"),
    Column("steps", "steps"),
    Column("off_ms", "ms off", ".3g"),
    Column("on_ms", "ms on", ".3g"),
    Column("ratio", "on / off", ".2f"),
    Column("added_ms", "added ms per solve", ".3g"),
    Column("added_ns_per_step", "added ns per step", ".3g"),
    Column("draws_per_solve", "tqdm draws per solve"),
]

NOTES = """\
Best of the repeated calls of each candidate, taken in turns after a compiling call; every call
waits for its host callbacks (`jax.effects_barrier`). With the bar, the loop runs in stretches
over which the whole percent covered stays: each step computes that percent in the inner loop's
predicate, and each stretch ends with one host callback (one tqdm draw; the bar draws once more
as it closes), about a hundred per solve whatever the number of steps."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 calls of each candidate")
    parser.add_argument("--repeats", type=int, default=15, help="calls of each candidate")
    options = parser.parse_args(argv)
    repeats = 3 if options.quick else options.repeats
    records = [measure(problem, repeats) for problem in PROBLEMS]
    for record in records:
        print(record)
    command = " ".join(["python benchmarks/bench_progress.py", *(argv or sys.argv[1:])])
    name = "progress-quick" if options.quick else "progress"
    write_results(name, records, COLUMNS, title="The cost of progress=True",
                  command=command, env=environment(), notes=NOTES)  # fmt: skip


if __name__ == "__main__":
    main()
