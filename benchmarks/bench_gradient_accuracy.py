"""Gradient accuracy on stiff problems (issue 20): correct digits of the Jacobian dy(t1)/dlog p of
every odeckpt adjoint (the error-controlled ones also held tighter than the solve) and every
diffrax adjoint, against forward sensitivities at a tight tolerance, with run time, compile
time and compiled memory, in one run.

    python benchmarks/bench_gradient_accuracy.py [--problems robertson van_der_pol decay_chain]
                                                 [--rtols 1e-4 1e-6 1e-8] [--name NAME]
                                                 [--solver kvaerno5]

Problems (float64, `max_steps` 10_000; odeckpt's stepper `--solver`, Kvaerno5 by default,
diffrax's Kvaerno5):

- robertson: Robertson's kinetics with the test set's constants, k = (0.04, 3e7, 1e4),
  y0 = (1, 0, 0), t1 = 1e11, atol = 1e-4 rtol (the test set's rule).
- van_der_pol: mu = 1000, y0 = (2, 0), t1 = 1000, atol = 1e-10 (issue 20's setting).
- decay_chain: A -> B -> C with rates (1, 1e4) (stiffness ratio 1e4), y0 = (1, 0, 0), t1 = 10,
  atol = 1e-4 rtol.

The reference is scipy's Radau on the state and its sensitivities at rtol 1e-12
(`tests/problems.py::sensitivity_reference`). Correct digits: -log10(max |J - J_ref| /
max |J_ref|) over the whole Jacobian; "-" where the Jacobian is not finite (a failed solve or
backward solve: odeckpt's gradients of a failure are NaN). Reverse-mode methods build the
Jacobian with `jax.jacrev`, forward-mode ones with `jax.jacfwd`. Run time: median of calls of
the compiled Jacobian (after a warm-up); compile time: lowering and XLA compilation, once per
method (the tolerances are traced); memory: `memory_analysis().temp_size_in_bytes` of the compiled
Jacobian.
Writes `benchmarks/results/<name>.{json,md}` (default `gradient-accuracy`) and the
work-precision figure `docs/images/benchmarks/gradient_accuracy.png` (digits against run time;
needs matplotlib, `pip install -e ".[plot]"`).
"""

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import RESULTS, Column, environment, time_compile, write_results  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from problems import robertson, sensitivity_reference  # noqa: E402

import odeckpt  # noqa: E402

MAX_STEPS = 10_000


def van_der_pol(t, y, p):
    return jnp.stack([y[1], p[0] * (1 - y[0] ** 2) * y[1] - y[0]])


def decay_chain(t, y, k):
    return jnp.stack([-k[0] * y[0], k[0] * y[0] - k[1] * y[1], k[1] * y[1]])


PROBLEMS = {
    "robertson": dict(f=robertson, y0=[1.0, 0.0, 0.0], p=[0.04, 3e7, 1e4], t1=1e11,
                      atol=lambda rtol: 1e-4 * rtol),
    "van_der_pol": dict(f=van_der_pol, y0=[2.0, 0.0], p=[1000.0], t1=1000.0,
                        atol=lambda rtol: 1e-10),
    "decay_chain": dict(f=decay_chain, y0=[1.0, 0.0, 0.0], p=[1.0, 1e4], t1=10.0,
                        atol=lambda rtol: 1e-4 * rtol),
}  # fmt: skip

ODECKPT = {
    "recursive": ("recursive", jax.jacrev),
    "direct": ("direct", jax.jacrev),
    "backsolve": ("backsolve", jax.jacrev),
    "interpolating": ("interpolating", jax.jacrev),
    "forward_sensitivity": ("forward_sensitivity", jax.jacfwd),
    "forward": ("forward", jax.jacfwd),
    # The error-controlled modes held tighter than the forward solve (docs/which-adjoint.md).
    "interpolating(rtol/100)": (
        lambda rtol, atol: odeckpt.InterpolatingAdjoint(rtol=rtol / 100, atol=atol / 100),
        jax.jacrev,
    ),
    "forward_sensitivity(rtol/10)": (
        lambda rtol, atol: odeckpt.ForwardSensitivity(rtol=rtol / 10, atol=atol / 10),
        jax.jacfwd,
    ),
}
DIFFRAX = ("RecursiveCheckpointAdjoint", "DirectAdjoint", "BacksolveAdjoint")

COLUMNS = [
    Column("problem", "problem"),
    Column("rtol", "rtol", ".0e"),
    Column("method", "method"),
    Column("digits", "correct digits", ".2f"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("time_vs_recursive", "time / odeckpt recursive", ".2f"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("memory_kib", "memory (KiB)", ".1f"),
]


def odeckpt_jacobian(problem: dict, adjoint, mode, solver: str):
    """The Jacobian of `y(t1)` with `adjoint`: a name, or a function of the (traced) solve
    tolerances that makes it."""

    def final(log_p, rtol, atol):
        chosen = adjoint(rtol, atol) if callable(adjoint) else adjoint
        sol = odeckpt.solve(
            problem["f"], jnp.asarray(problem["y0"]), (0.0, problem["t1"]), jnp.exp(log_p),
            solver=solver, rtol=rtol, atol=atol, adjoint=chosen, max_steps=MAX_STEPS,
            throw=False,
        )  # fmt: skip
        return sol.ys[-1]

    return mode(final)


def diffrax_jacobian(problem: dict, adjoint: str):
    import diffrax

    def final(log_p, rtol, atol):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(problem["f"]), diffrax.Kvaerno5(), 0.0, problem["t1"], None,
            jnp.asarray(problem["y0"]), args=jnp.exp(log_p),
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            adjoint=getattr(diffrax, adjoint)(), max_steps=MAX_STEPS, throw=False,
        )  # fmt: skip
        return sol.ys[-1]

    return jax.jacrev(final)


def digits(jacobian: np.ndarray, reference: np.ndarray) -> float | None:
    if not np.all(np.isfinite(jacobian)):
        return None
    error = np.max(np.abs(jacobian - reference)) / np.max(np.abs(reference))
    return 16.0 if error == 0 else -math.log10(error)


def compiled(fn, args) -> tuple[float, float, Callable]:
    """`(compile_s, memory_kib, jitted)`: the compile time and temporary memory of the jitted
    `fn` at `args`, and `fn` jitted (compiled once for every rtol: the tolerances are
    traced)."""
    compile_s = sum(time_compile(fn, *args)[:2])
    lowered = jax.jit(fn).lower(*args).compile()
    return compile_s, lowered.memory_analysis().temp_size_in_bytes / 1024, jax.jit(fn)


def run_time(jitted: Callable, args, target_s: float = 1.0) -> tuple[float, np.ndarray]:
    """The median run time of `jitted(*args)` (after one warm-up call) and its value."""
    value = np.asarray(jitted(*args))
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    repeats = max(3, min(50, int(target_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def run_problem(name: str, rtols: list[float], solver: str) -> list[dict]:
    problem = PROBLEMS[name]
    log_p = np.log(np.asarray(problem["p"]))
    reference = sensitivity_reference(problem["f"], np.asarray(problem["y0"]), log_p,
                                      problem["t1"])  # fmt: skip
    methods = {f"odeckpt {label}": odeckpt_jacobian(problem, adjoint, mode, solver)
               for label, (adjoint, mode) in ODECKPT.items()}  # fmt: skip
    for adjoint in DIFFRAX:
        methods[f"diffrax {adjoint}"] = diffrax_jacobian(problem, adjoint)
    arguments = lambda rtol: (jnp.asarray(log_p), jnp.asarray(rtol),
                              jnp.asarray(problem["atol"](rtol)))  # fmt: skip
    builds = {method: compiled(fn, arguments(rtols[0])) for method, fn in methods.items()}
    records = []
    for rtol in rtols:
        runs = {method: run_time(builds[method][2], arguments(rtol)) for method in methods}
        base = runs["odeckpt recursive"][0]
        for method in methods:
            (run_s, jacobian), (compile_s, memory, _) = runs[method], builds[method]
            record = dict(
                problem=name, rtol=rtol, method=method, digits=digits(jacobian, reference),
                run_ms=1e3 * run_s, time_vs_recursive=run_s / base, compile_s=compile_s,
                memory_kib=memory,
            )  # fmt: skip
            print(record, flush=True)
            records.append(record)
    return records


def plot(records: list[dict], path: Path) -> None:
    """A work-precision figure: correct digits against Jacobian run time, one panel per
    problem, one line per method through its rtols (digits below -1, a gradient wrong by more
    than 10x, drawn at -1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r["problem"] for r in records))
    fig, axes = plt.subplots(1, len(problems), figsize=(5 * len(problems), 4.2), squeeze=False)
    for ax, problem in zip(axes[0], problems, strict=True):
        rows = [r for r in records if r["problem"] == problem]
        for method in dict.fromkeys(r["method"] for r in rows):
            points = [(r["run_ms"], max(r["digits"], -1.0)) for r in rows
                      if r["method"] == method and r["digits"] is not None]  # fmt: skip
            if points:
                style = "-o" if method.startswith("odeckpt") else "--s"
                ax.plot(*zip(*points, strict=True), style, label=method, markersize=4)
        ax.set_xscale("log")
        ax.set_xlabel("Jacobian run time (ms)")
        ax.set_ylabel("correct digits")
        ax.set_title(problem)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--rtols", nargs="+", type=float, default=[1e-4, 1e-6, 1e-8])
    parser.add_argument("--name", default="gradient-accuracy")
    parser.add_argument("--solver", default="kvaerno5", help="odeckpt's stepper")
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw the figure from results/<name>.json without measuring",
    )
    options = parser.parse_args()
    images = Path(__file__).resolve().parent.parent / "docs/images/benchmarks"
    figure = images / f"{options.name.replace('-', '_')}.png"
    if options.plot_only:
        plot(json.loads((RESULTS / f"{options.name}.json").read_text())["records"], figure)
        return 0
    env = environment()
    records = [r for name in options.problems
               for r in run_problem(name, options.rtols, options.solver)]  # fmt: skip
    command = " ".join(["python benchmarks/bench_gradient_accuracy.py", *sys.argv[1:]])
    json_path, md_path = write_results(
        options.name, records, COLUMNS, title="Gradient accuracy on stiff problems",
        command=command, env=env,
        notes="Correct digits of dy(t1)/dlog p against scipy Radau forward sensitivities at "
        f"rtol 1e-12; '-' = failed (NaN gradient or error). odeckpt's stepper: {options.solver}; "
        "diffrax's: Kvaerno5.",
    )  # fmt: skip
    plot(records, figure)
    print(f"wrote {json_path}, {md_path} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
