"""Terminating events, odeckpt vs diffrax: a solve stopped by an event and the gradient of the
event time, run time, compile time and event-time error, in one process.

    python benchmarks/bench_events.py            # both problems, about 2 minutes
    python benchmarks/bench_events.py --quick    # smoke run, short timings

Problems (float64, Tsit5, the same rtol/atol and max_steps, `throw` on):

- `free-fall`: `h' = v, v' = -g` from `h = 1` until `h` falls through 0; exact event time
  `sqrt(2 h / g)`. Tsit5 is exact on quadratics, so the error is that of the event location.
- `lotka-volterra`: prey `x` falling through 2 from `(10, 5)`; reference: scipy's `solve_ivp`
  (DOP853, rtol = atol = 1e-13, `events=`).

odeckpt: `Event(fn, direction=-1)` with its default root finder (Illinois on the step's
interpolant) and `RecursiveCheckpointAdjoint`. diffrax: `Event(cond_fn, root_finder=
optimistix.Newton(rtol=1e-12, atol=1e-12), direction=False)` (a falling crossing) with its
default `RecursiveCheckpointAdjoint`. "grad" is `jax.grad` of the event time with respect to
the initial state and the parameters.

Results go to `benchmarks/results/events.{json,md}` (`events-quick.*` with `--quick`).
"""

import argparse
import dataclasses
from collections.abc import Callable

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optimistix  # noqa: E402
import scipy.integrate  # noqa: E402
from _harness import Column, compare, environment, write_results  # noqa: E402

import odeckpt  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Problem:
    """A solve stopped where `event(t, y, args)` falls through zero, with its exact time."""

    name: str
    f: Callable
    event: Callable
    y0: jax.Array
    args: jax.Array
    t1: float
    rtol: float
    atol: float
    exact: float
    max_steps: int = 4096


def free_fall() -> Problem:
    g = 9.81
    return Problem(
        "free-fall", lambda t, y, g: jnp.stack([y[1], -g]), lambda t, y, g: y[0],
        jnp.array([1.0, 0.0]), jnp.asarray(g), 10.0, 1e-8, 1e-8, float(np.sqrt(2 / g)),
    )  # fmt: skip


def lotka_volterra() -> Problem:
    def f(t, y, p):
        return jnp.stack([p[0] * y[0] - p[1] * y[0] * y[1], p[3] * y[0] * y[1] - p[2] * y[1]])

    args, y0 = np.array([1.1, 0.4, 0.4, 0.1]), np.array([10.0, 5.0])
    reference = scipy.integrate.solve_ivp(
        lambda t, y: np.asarray(f(t, y, args)), (0.0, 30.0), y0, method="DOP853",
        rtol=1e-13, atol=1e-13, events=lambda t, y: y[0] - 2.0,
    )  # fmt: skip
    return Problem(
        "lotka-volterra", f, lambda t, y, p: y[0] - 2.0, jnp.asarray(y0), jnp.asarray(args),
        30.0, 1e-8, 1e-8, float(reference.t_events[0][0]),
    )  # fmt: skip


PROBLEMS = {"free-fall": free_fall, "lotka-volterra": lotka_volterra}


def odeckpt_time(p: Problem) -> Callable:
    event = odeckpt.Event(p.event, direction=-1)

    def solve(y0, args):
        sol = odeckpt.solve(p.f, y0, (0.0, p.t1), args, event=event, rtol=p.rtol, atol=p.atol,
                            max_steps=p.max_steps)  # fmt: skip
        return sol.ts[-1]

    return solve


def diffrax_time(p: Problem) -> Callable:
    root = optimistix.Newton(rtol=1e-12, atol=1e-12)
    event = diffrax.Event(lambda t, y, args, **kw: p.event(t, y, args), root_finder=root,
                          direction=False)  # fmt: skip

    def solve(y0, args):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(p.f), diffrax.Tsit5(), 0.0, p.t1, None, y0, args,
            stepsize_controller=diffrax.PIDController(rtol=p.rtol, atol=p.atol),
            event=event, max_steps=p.max_steps, saveat=diffrax.SaveAt(t1=True),
        )  # fmt: skip
        return sol.ts[-1]

    return solve


def run_problem(p: Problem, target_s: float, compile_repeats: int) -> list[dict]:
    records = []
    solvers = {"odeckpt": odeckpt_time(p), "diffrax": diffrax_time(p)}
    for kind in ("solve", "grad"):
        candidates = {}
        for name, solve in solvers.items():
            fn = solve if kind == "solve" else jax.grad(solve, argnums=(0, 1))
            candidates[name] = (fn, (p.y0, p.args))
        timings = compare(candidates, target_s=target_s, compile_repeats=compile_repeats)
        record = {"problem": p.name, "kind": kind}
        for name, timing in timings.items():
            record[f"{name}_run_ms"] = 1e3 * timing.run_s
            record[f"{name}_compile_s"] = timing.compile_s
        record["run_ratio"] = timings["odeckpt"].run_s / timings["diffrax"].run_s
        record["compile_ratio"] = timings["odeckpt"].compile_s / timings["diffrax"].compile_s
        if kind == "solve":
            for name, solve in solvers.items():
                record[f"{name}_error"] = abs(float(jax.jit(solve)(p.y0, p.args)) - p.exact)
        else:
            grads = {n: jax.jit(c[0])(*c[1]) for n, c in candidates.items()}
            flat = {n: np.concatenate([np.ravel(x) for x in g]) for n, g in grads.items()}
            scale = np.max(np.abs(flat["diffrax"]))
            record["grad_difference"] = float(np.max(np.abs(flat["odeckpt"] - flat["diffrax"])))
            record["grad_difference"] /= scale
        print(record)
        records.append(record)
    return records


COLUMNS = [
    Column("problem", "problem"),
    Column("kind", "kind"),
    Column("odeckpt_run_ms", "odeckpt run (ms)", ".3g"),
    Column("diffrax_run_ms", "diffrax run (ms)", ".3g"),
    Column("run_ratio", "run ratio", ".2f"),
    Column("odeckpt_compile_s", "odeckpt compile (s)", ".2f"),
    Column("diffrax_compile_s", "diffrax compile (s)", ".2f"),
    Column("compile_ratio", "compile ratio", ".2f"),
    Column("odeckpt_error", "odeckpt event-time err", ".1e"),
    Column("diffrax_error", "diffrax event-time err", ".1e"),
    Column("grad_difference", "grad rel. diff", ".1e"),
]

NOTES = """\
Ratios are odeckpt / diffrax (below 1: odeckpt faster). Run time: median of repeated calls of
the jitted function after warm-up; compile time: `jax.jit(fn).lower(*args).compile()` from
cleared caches, median of repeats. "event-time err" is |t* - exact| (free fall: sqrt(2h/g);
Lotka-Volterra: scipy DOP853 at rtol = atol = 1e-13); "grad rel. diff" is the largest
difference between the two libraries' gradients of t* over the largest gradient entry."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", choices=sorted(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--quick", action="store_true", help="short timings, one compile")
    options = parser.parse_args(argv)
    target_s = 0.3 if options.quick else 2.0
    compile_repeats = 1 if options.quick else 3
    name = "events-quick" if options.quick else "events"
    records = []
    for problem in options.problems:
        records += run_problem(PROBLEMS[problem](), target_s, compile_repeats)
    command = "python benchmarks/bench_events.py" + (" --quick" if options.quick else "")
    write_results(name, records, COLUMNS, title="Terminating events: odeckpt vs diffrax",
                  command=command, env=environment(), notes=NOTES)  # fmt: skip


if __name__ == "__main__":
    main()
