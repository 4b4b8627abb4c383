"""Stiff problems: work-precision of odeckpt's Kvaerno5 and Rodas5 against diffrax's Kvaerno5 and
scipy's Radau, and the compile time of the gradient.

    python benchmarks/bench_stiff.py            # everything, ~10 minutes on 2 cores
    python benchmarks/bench_stiff.py --quick    # one tolerance, short timings

Problems (float64): Robertson's kinetics (Hairer & Wanner II, IV.10) on [0, 1e5] with
atol = 1e-4 rtol (the intermediate species is ~1e-5), and Van der Pol with mu = 1000 on
[0, 3000] with atol = rtol. For rtol in 1e-4, 1e-6, 1e-8, each solver reports the error at t1
(max over components of |y - ref| / (|ref| + 1e-12), against scipy Radau at rtol = 1e-12,
atol = 1e-14), attempted steps, Jacobian evaluations, LU factorisations, evaluations of f (for
odeckpt's Kvaerno5 one per Newton iteration; not reported by diffrax), run time (median after
warm-up) and compile time (trace + lower + XLA compile from cleared caches). Every solver uses
the same PID (integral) step-size controller defaults and the analytic-free Jacobian
(`jax.jacfwd`); scipy gets the analytic Jacobian (it would otherwise use finite differences).

diffrax's Kvaerno5 (`VeryChord` root finder) evaluates and factorises the Jacobian once per
attempted step by construction, so its Jacobian evaluations and LU factorisations are its
attempted steps. scipy's Radau runs in Python (one host round trip per `f` call); its times are
not comparable to the jitted solvers' and are shown for reference only.

At equal accuracy: for each diffrax Kvaerno5 row, each odeckpt solver is searched on the ladder
rtol = 10**(-k/2) (half decades, atol by the same rule), from diffrax's rtol down to 1e-12, for
the loosest rtol whose error at t1 is at most diffrax's; that run is timed again together with
the diffrax run, and the table reports the ratios odeckpt / diffrax of Jacobian evaluations and
run time (or says that no rung down to 1e-12 was accurate enough).

Gradient compile time: `jax.grad` of the sum of Robertson's final state with respect to the rate
constants, odeckpt Kvaerno5 (default `RecursiveCheckpointAdjoint`, and `DirectAdjoint`) vs
diffrax Kvaerno5 (its default `RecursiveCheckpointAdjoint`), rtol = 1e-6, max_steps = 4096; and,
as a reference for the checkpointing engine's share, odeckpt's recursive gradient with Tsit5.
Minimum (and median) over five interleaved compiles.

Results go to `benchmarks/results/stiff.{json,md}` and `stiff-gradients.{json,md}` (with a
`-quick` suffix under `--quick`).
"""

import argparse
import json
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import (  # noqa: E402
    Column,
    compare,
    environment,
    markdown_table,
    time_compile,
    write_results,
)
from scipy.integrate import solve_ivp  # noqa: E402

import odeckpt  # noqa: E402


def robertson(t, y, k):
    k1, k2, k3 = k[0], k[1], k[2]
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def van_der_pol(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


PROBLEMS = {
    "robertson": dict(
        f=robertson, y0=np.array([1.0, 0.0, 0.0]), args=np.array([0.04, 3e7, 1e4]), t1=1e5,
        atol_factor=1e-4,
    ),
    "van_der_pol": dict(
        f=van_der_pol, y0=np.array([2.0, 0.0]), args=np.array(1000.0), t1=3000.0, atol_factor=1.0
    ),
}  # fmt: skip
MAX_STEPS = 100_000


def radau(problem, rtol, atol):
    """scipy's Radau with the jitted field and its `jax.jacfwd` Jacobian: (result, seconds)."""
    f = jax.jit(problem["f"])
    jac = jax.jit(jax.jacfwd(problem["f"], argnums=1))
    args = jnp.asarray(problem["args"])
    rhs = lambda t, y: np.asarray(f(t, jnp.asarray(y), args))
    jacobian = lambda t, y: np.asarray(jac(t, jnp.asarray(y), args))
    rhs(0.0, problem["y0"]), jacobian(0.0, problem["y0"])  # compile outside the timing
    start = time.perf_counter()
    result = solve_ivp(
        rhs, (0.0, problem["t1"]), problem["y0"], method="Radau", rtol=rtol, atol=atol,
        jac=jacobian,
    )  # fmt: skip
    assert result.success, result.message
    return result, time.perf_counter() - start


def odeckpt_solve(problem, solver, rtol, atol):
    def solve(y0, args):
        sol = odeckpt.solve(
            problem["f"], y0, (0.0, problem["t1"]), args=args, solver=solver, rtol=rtol,
            atol=atol, max_steps=MAX_STEPS, adjoint="forward",
        )  # fmt: skip
        return sol.ys[-1], sol.stats

    return solve


def diffrax_solve(problem, rtol, atol):
    def solve(y0, args):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(problem["f"]), diffrax.Kvaerno5(), 0.0, problem["t1"], None, y0,
            args=args, stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
            max_steps=MAX_STEPS, adjoint=diffrax.ForwardMode(),
        )  # fmt: skip
        return sol.ys[-1], sol.stats

    return solve


ODECKPT_SOLVERS = {"odeckpt Kvaerno5": odeckpt.Kvaerno5, "odeckpt Rodas5": odeckpt.Rodas5}
PEER = "diffrax Kvaerno5"


def make_solve(problem, solver, rtol):
    """The jittable `(y0, args) -> (y(t1), stats)` of `solver` (a key of `ODECKPT_SOLVERS` or
    `PEER`) at `rtol`, with atol = atol_factor * rtol, and its arguments."""
    atol = rtol * problem["atol_factor"]
    if solver == PEER:
        fn = diffrax_solve(problem, rtol, atol)
    else:
        fn = odeckpt_solve(problem, ODECKPT_SOLVERS[solver](), rtol, atol)
    return fn, (jnp.asarray(problem["y0"]), jnp.asarray(problem["args"]))


def error(y, reference) -> float:
    y = np.asarray(y)
    return float(np.max(np.abs(y - reference) / (np.abs(reference) + 1e-12)))


def reference_state(problem):
    """y(t1) from scipy's Radau at rtol 1e-12, atol 1e-14: the reference for every error."""
    reference, _ = radau(problem, 1e-12, 1e-14)
    return reference.y[:, -1]


def solve_once(problem, solver, rtol, reference):
    """Error at t1 and work counts of one (untimed) solve."""
    fn, args = make_solve(problem, solver, rtol)
    y1, stats = jax.jit(fn)(*args)
    steps = int(stats["num_steps"] if isinstance(stats, dict) else stats.num_steps)
    if solver == PEER:
        jacobians = lus = steps  # VeryChord: one of each per attempted step
        fn_evals = None
    else:
        jacobians, lus = int(stats.num_jacobian_evals), int(stats.num_lu_factorisations)
        fn_evals = int(stats.num_fn_evals)
    return dict(
        error=error(y1, reference), steps=steps, jacobians=jacobians, lus=lus, fn_evals=fn_evals
    )


def measure(name, problem, runs, reference, target_s):
    """Time the `(solver, rtol)` pairs of `runs` together in one `compare` (interleaved) and
    return one record per pair, in order."""
    candidates = {
        f"{solver} @ {rtol:.3g}": make_solve(problem, solver, rtol) for solver, rtol in runs
    }
    timings = compare(candidates, target_s=target_s, compile_repeats=1)
    records = []
    for (solver, rtol), timing in zip(runs, timings.values(), strict=True):
        records.append(
            dict(
                problem=name, rtol=rtol, solver=solver,
                **solve_once(problem, solver, rtol, reference),
                run_ms=1e3 * timing.run_s, compile_s=timing.compile_s,
            )
        )  # fmt: skip
    return records


def work_precision(name, problem, rtols, reference, target_s):
    records = []
    for rtol in rtols:
        runs = [(solver, rtol) for solver in [*ODECKPT_SOLVERS, PEER]]
        records += measure(name, problem, runs, reference, target_s)
        result, seconds = radau(problem, rtol, rtol * problem["atol_factor"])
        records.append(
            dict(
                problem=name, rtol=rtol, solver="scipy Radau (Python)",
                error=error(result.y[:, -1], reference), steps=int(result.t.size - 1),
                jacobians=int(result.njev), lus=int(result.nlu), fn_evals=int(result.nfev),
                run_ms=1e3 * seconds, compile_s=None,
            )
        )  # fmt: skip
        print(*(r for r in records[-4:]), sep="\n", flush=True)
    return records


LADDER_TIGHTEST = 24  # the ladder of rtols is 10**(-k/2) for k up to 24 (rtol 1e-12)


def ladder(rtol):
    """The half-decade rtols 10**(-k/2) from `rtol` down to 1e-12."""
    start = round(-2 * np.log10(rtol))
    return [10.0 ** (-k / 2) for k in range(start, LADDER_TIGHTEST + 1)]


def loosest_match(problem, solver, rtol, target, reference, errors):
    """The loosest rtol of `ladder(rtol)` at which `solver`'s error at t1 is <= `target`, or None.
    `errors` caches `{(solver, rtol): error}` across searches."""
    for candidate in ladder(rtol):
        key = (solver, candidate)
        if key not in errors:
            errors[key] = solve_once(problem, solver, candidate, reference)["error"]
        if errors[key] <= target:
            return candidate
    return None


def equal_accuracy(name, problem, records, reference, target_s):
    """For each diffrax row of `records`, each odeckpt solver at the loosest ladder rtol that is
    at least as accurate at t1, timed in one `compare` with that diffrax run."""
    records = [r for r in records if r["problem"] == name]
    errors = {
        (r["solver"], r["rtol"]): r["error"] for r in records if r["solver"] in ODECKPT_SOLVERS
    }
    rows = []
    for peer in (r for r in records if r["solver"] == PEER):
        matches = {
            solver: loosest_match(problem, solver, peer["rtol"], peer["error"], reference, errors)
            for solver in ODECKPT_SOLVERS
        }
        runs = [(PEER, peer["rtol"])] + [(s, r) for s, r in matches.items() if r is not None]
        timed = measure(name, problem, runs, reference, target_s)
        peer_now, ours = timed[0], {r["solver"]: r for r in timed[1:]}
        for solver, match in matches.items():
            row = dict(
                problem=name, diffrax_rtol=peer["rtol"], diffrax_error=peer_now["error"],
                diffrax_jacobians=peer_now["jacobians"], diffrax_run_ms=peer_now["run_ms"],
                solver=solver,
            )  # fmt: skip
            if match is None:
                tried = {r: e for (s, r), e in errors.items() if s == solver and r <= peer["rtol"]}
                best = min(tried, key=tried.get)
                row.update(
                    best_rtol=best, best_error=tried[best],
                    note=f"not reached down to rtol 1e-12 (best {tried[best]:.1e} at {best:.2g})",
                )  # fmt: skip
            else:
                record = ours[solver]
                row.update(
                    rtol=match, **{k: record[k] for k in ("error", "steps", "jacobians", "lus")},
                    run_ms=record["run_ms"],
                    jacobian_ratio=record["jacobians"] / peer_now["jacobians"],
                    run_ratio=record["run_ms"] / peer_now["run_ms"],
                )  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return rows


def gradient_compile_times():
    problem = PROBLEMS["robertson"]
    y0, k = jnp.asarray(problem["y0"]), jnp.asarray(problem["args"])

    def ours(adjoint, solver="kvaerno5"):
        def loss(k):
            sol = odeckpt.solve(robertson, y0, (0.0, 100.0), args=k, solver=solver,
                                rtol=1e-6, atol=1e-10, max_steps=4096, adjoint=adjoint)  # fmt: skip
            return jnp.sum(sol.ys[-1])

        return jax.grad(loss)

    def theirs(k):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(robertson), diffrax.Kvaerno5(), 0.0, 100.0, None, y0, args=k,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-10), max_steps=4096,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1])

    candidates = {
        "odeckpt Kvaerno5, recursive (default)": ours(odeckpt.RecursiveCheckpointAdjoint()),
        "odeckpt Kvaerno5, direct": ours(odeckpt.DirectAdjoint()),
        # Compiled only (never run): how much of the recursive gradient's compile time is the
        # checkpointing engine's, with an explicit step that costs next to nothing to compile.
        "odeckpt Tsit5, recursive (engine reference)": ours(
            odeckpt.RecursiveCheckpointAdjoint(), odeckpt.Tsit5()
        ),
        "diffrax Kvaerno5, recursive (default)": jax.grad(theirs),
    }
    times = {name: [] for name in candidates}
    for _ in range(COMPILE_ROUNDS):  # interleaved, so that a disturbance hits every candidate
        for name, fn in candidates.items():
            lower, xla, _ = time_compile(fn, k)
            times[name].append(lower + xla)
    peer = times["diffrax Kvaerno5, recursive (default)"]
    return [compile_record(name, t, peer) for name, t in times.items()]


COMPILE_ROUNDS = 5
"""Interleaved compiles per gradient: the minimum is the least disturbed by a shared machine."""


def compile_record(name: str, times: list[float], peer: list[float]) -> dict:
    """The minimum and median compile time of one gradient, and their ratios to diffrax's."""
    median, peer_median = float(np.median(times)), float(np.median(peer))
    return dict(
        gradient=name,
        compile_s=min(times),
        ratio=min(times) / min(peer),
        median_s=median,
        median_ratio=median / peer_median,
    )


COLUMNS = [
    Column("problem", "problem"),
    Column("rtol", "rtol", ".0e"),
    Column("solver", "solver"),
    Column("error", "error at t1", ".1e"),
    Column("steps", "steps"),
    Column("jacobians", "Jacobians"),
    Column("lus", "LU"),
    Column("fn_evals", "f evals"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("compile_s", "compile (s)", ".2f"),
]
EQUAL_COLUMNS = [
    Column("problem", "problem"),
    Column("diffrax_rtol", "diffrax rtol", ".0e"),
    Column("diffrax_error", "diffrax error", ".1e"),
    Column("diffrax_jacobians", "diffrax Jacobians"),
    Column("diffrax_run_ms", "diffrax run (ms)", ".3g"),
    Column("solver", "solver"),
    Column("rtol", "rtol", ".1e"),
    Column("error", "error at t1", ".1e"),
    Column("steps", "steps"),
    Column("jacobians", "Jacobians"),
    Column("lus", "LU"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("jacobian_ratio", "Jacobian ratio", ".3f"),
    Column("run_ratio", "run ratio", ".3f"),
    Column("note", "note"),
]
EQUAL_NOTES = """## At equal accuracy

For each diffrax Kvaerno5 row above, each odeckpt solver is run at the loosest rtol of the
half-decade ladder 10**(-k/2) (1e-4, 3.2e-5, 1e-5, ...), starting at diffrax's rtol and going
no tighter than 1e-12, whose error at t1 (against the same reference) is at most diffrax's;
atol follows rtol by the same rule as above. That odeckpt run and the diffrax run are then timed
together in one `compare` (interleaved rounds), so the diffrax run time here is a fresh
measurement of the same solve as above. Ratios are odeckpt / diffrax (below 1: odeckpt does less
work or is faster). The error at t1 is not monotone in rtol (on Van der Pol it is a phase error),
so a looser rung can miss where a tighter one matches."""
GRADIENT_COLUMNS = [
    Column("gradient", "gradient"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("ratio", "ratio to diffrax", ".2f"),
    Column("median_s", "median (s)", ".2f"),
    Column("median_ratio", "median ratio", ".2f"),
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tolerance, short timings")
    options = parser.parse_args(argv)
    rtols = [1e-6] if options.quick else [1e-4, 1e-6, 1e-8]
    target_s = 0.5 if options.quick else 2.0
    records, matches = [], []
    for name, problem in PROBLEMS.items():
        reference = reference_state(problem)
        records += work_precision(name, problem, rtols, reference, target_s)
        matches += equal_accuracy(name, problem, records, reference, target_s)
    gradients = gradient_compile_times()
    print(*gradients, sep="\n")
    command = "python benchmarks/bench_stiff.py" + (" --quick" if options.quick else "")
    suffix = "-quick" if options.quick else ""
    env = environment()
    notes = EQUAL_NOTES + "\n\n" + markdown_table(matches, EQUAL_COLUMNS)
    json_path, _ = write_results(
        "stiff" + suffix, records, COLUMNS, title="Stiff solvers: work-precision",
        command=command, env=env, notes=notes,
    )  # fmt: skip
    payload = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({**payload, "equal_accuracy": matches}, indent=2) + "\n")
    write_results(
        "stiff-gradients" + suffix, gradients, GRADIENT_COLUMNS,
        title="Stiff solvers: gradient compile time (Robertson, rtol 1e-6)", command=command,
        env=env,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
