"""Stiff problems: work-precision of every odeckpt stiff stepper (Kvaerno3/4/5, Rodas5, Radau5,
BDF) against scipy's Radau and BDF and diffrax's Kvaerno5, and the compile time of the gradient.

    python benchmarks/bench_stiff.py            # everything
    python benchmarks/bench_stiff.py --quick    # rtol 1e-6 only, short timings, no extras

Problems (float64), both from the Bari test set for IVP solvers (F. Mazzia & F. Iavernaro,
release 2.4) with its constants and its published reference solutions at t1 (computed in
extended precision):

- ROBER: Robertson's kinetics, k = (0.04, 3e7, 1e4), y0 = (1, 0, 0), t in [0, 1e11],
  atol = 1e-4 rtol (so 1e-12 at rtol 1e-8; the intermediate species ends near 8e-14);
- VDPOL: Van der Pol with mu = 1000 in the test set's scaling (time in units of mu,
  eps = 1 / mu^2 = 1e-6), y0 = (2, 0), t in [0, 2], atol = rtol.

For rtol in 1e-4, 1e-6, 1e-8 each solver reports the correct digits at t1,
`-log10(max_i |y_i - ref_i| / |ref_i|)` (the test set's "scd"), attempted steps, Jacobian
evaluations, LU factorisations, evaluations of `f` (the f + J column adds the Jacobian
evaluations), run time (median after warm-up) and compile time (trace + lower + XLA compile
from cleared caches). scipy's Radau at rtol 1e-12 is run too, as a check of the reference.

Counting: odeckpt's `sol.stats` (one `f` per Newton iteration and stage; Radau5's LU count is
one per real and one per complex factorisation; a Jacobian is one `jax.jacfwd`); scipy's
`nfev`, `njev`, `nlu` (its Radau counts a real and a complex factorisation as one LU, and its
`nfev` includes the finite-difference-free Newton iterations only); diffrax's Kvaerno5
(`VeryChord`) evaluates and factorises the Jacobian once per attempted step, and reports no `f`
count. The jitted solvers use `jax.jacfwd` for the Jacobian; scipy gets the exact Jacobian and
`f` written in NumPy (what a scipy user writes, and scipy's fastest path: no JAX dispatch per
call). scipy runs in Python, so run times compare a jitted XLA loop with an interpreted one;
the work counts compare the algorithms.

Targets (issue 22): at rtol 1e-6 and 1e-8, the best odeckpt stepper delivers at least scipy
Radau's digits minus 0.5 on each problem, with fewer f + J evaluations and less run time than
scipy Radau. The `targets` table says, per problem and rtol, which odeckpt steppers meet all
three and, if none does, by how much the closest misses.

At equal accuracy (full run only): for each diffrax Kvaerno5 row, odeckpt's Kvaerno5 and Rodas5
are searched on the ladder rtol = 10**(-k/2) (half decades, atol by the same rule), from
diffrax's rtol down to 1e-12, for the loosest rtol whose error at t1 is at most diffrax's; that
run is timed again together with the diffrax run, and the table reports the ratios
odeckpt / diffrax of Jacobian evaluations and run time.

Gradient compile time (full run only): `jax.grad` of the sum of Robertson's state at t = 100
with respect to the rate constants, odeckpt Kvaerno5 (default `RecursiveCheckpointAdjoint`, and
`DirectAdjoint`) vs diffrax Kvaerno5 (its default `RecursiveCheckpointAdjoint`), rtol = 1e-6,
max_steps = 4096; and, as a reference for the checkpointing engine's share, odeckpt's recursive
gradient with Tsit5. Minimum (and median) over five interleaved compiles.

Results go to `benchmarks/results/stiff.{json,md}`, `stiff-targets.md` and
`stiff-gradients.{json,md}` (a `-quick` suffix under `--quick`), and the work-precision plot to
`docs/images/benchmarks/stiff-work-precision.png`.
"""

import argparse
import json
import pathlib
import statistics
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


def robertson_numpy(t, y, k):
    k1, k2, k3 = k
    fast, slow = k2 * y[1] ** 2, k3 * y[1] * y[2]
    return np.array([-k1 * y[0] + slow, k1 * y[0] - fast - slow, fast])


def robertson_jacobian(t, y, k):
    k1, k2, k3 = k
    return np.array(
        [
            [-k1, k3 * y[2], k3 * y[1]],
            [k1, -2 * k2 * y[1] - k3 * y[2], -k3 * y[1]],
            [0.0, 2 * k2 * y[1], 0.0],
        ]
    )


def van_der_pol(t, y, eps):
    return jnp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / eps])


def van_der_pol_numpy(t, y, eps):
    return np.array([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / eps])


def van_der_pol_jacobian(t, y, eps):
    return np.array([[0.0, 1.0], [(-2 * y[0] * y[1] - 1) / eps, (1 - y[0] ** 2) / eps]])


PROBLEMS = {
    "robertson": dict(
        f=robertson, f_numpy=robertson_numpy, jac_numpy=robertson_jacobian,
        y0=np.array([1.0, 0.0, 0.0]), args=np.array([0.04, 3e7, 1e4]), t1=1e11,
        atol_factor=1e-4,
        reference=np.array([0.2083340149701255e-07, 0.8333360770334713e-13, 0.9999999791665050]),
    ),
    "van_der_pol": dict(
        f=van_der_pol, f_numpy=van_der_pol_numpy, jac_numpy=van_der_pol_jacobian,
        y0=np.array([2.0, 0.0]), args=np.array(1e-6), t1=2.0, atol_factor=1.0,
        reference=np.array([1.706167732170469, -0.8928097010248125]),
    ),
}  # fmt: skip
"""The test set's ROBER and VDPOL: constants, tolerances and published references at t1."""
MAX_STEPS = 100_000
SCIPY_REPEATS = 3
"""scipy's run time is the median of this many solves (each takes up to seconds)."""


def scipy_solve(problem, method, rtol, atol):
    """scipy's `method` with the NumPy `f` and exact Jacobian: (result, seconds)."""
    args = problem["args"]
    start = time.perf_counter()
    result = solve_ivp(
        lambda t, y: problem["f_numpy"](t, y, args), (0.0, problem["t1"]), problem["y0"],
        method=method, rtol=rtol, atol=atol, jac=lambda t, y: problem["jac_numpy"](t, y, args),
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
            max_steps=MAX_STEPS, adjoint=diffrax.ForwardMode(), throw=False,
        )  # fmt: skip
        # A failed solve (e.g. `max_steps` reached) shows as NaN: no digits.
        ok = sol.result == diffrax.RESULTS.successful
        return jnp.where(ok, sol.ys[-1], jnp.nan), sol.stats

    return solve


ODECKPT_SOLVERS = {
    "odeckpt Kvaerno3": odeckpt.Kvaerno3,
    "odeckpt Kvaerno4": odeckpt.Kvaerno4,
    "odeckpt Kvaerno5": odeckpt.Kvaerno5,
    "odeckpt Rodas5": odeckpt.Rodas5,
    "odeckpt Radau5": odeckpt.Radau5,
    "odeckpt BDF": odeckpt.BDF,
}
EQUAL_ACCURACY_SOLVERS = ("odeckpt Kvaerno5", "odeckpt Rodas5")
PEER = "diffrax Kvaerno5"
SCIPY = {"scipy Radau": "Radau", "scipy BDF": "BDF"}
TARGET_PEER = "scipy Radau"


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
    """The largest relative error over the components at t1."""
    y = np.asarray(y)
    return float(np.max(np.abs(y - reference) / np.abs(reference)))


def digits(err: float) -> float:
    """Correct digits of a relative error (NaN for a failed solve)."""
    return float(-np.log10(max(err, 1e-17))) if np.isfinite(err) else float("nan")


def work(record: dict) -> int | None:
    """Evaluations of `f` plus of the Jacobian (None where `f` is not counted)."""
    if record["fn_evals"] is None:
        return None
    return record["fn_evals"] + record["jacobians"]


def solve_once(problem, solver, rtol):
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
    err = error(y1, problem["reference"])
    return dict(
        error=err, digits=digits(err), steps=steps, jacobians=jacobians, lus=lus,
        fn_evals=fn_evals,
    )  # fmt: skip


def measure(name, problem, runs, target_s):
    """Time the `(solver, rtol)` pairs of `runs` together in one `compare` (interleaved) and
    return one record per pair, in order."""
    candidates = {
        f"{solver} @ {rtol:.3g}": make_solve(problem, solver, rtol) for solver, rtol in runs
    }
    timings = compare(candidates, target_s=target_s, compile_repeats=1)
    records = []
    for (solver, rtol), timing in zip(runs, timings.values(), strict=True):
        record = dict(
            problem=name, rtol=rtol, solver=solver, **solve_once(problem, solver, rtol),
            run_ms=1e3 * timing.run_s, compile_s=timing.compile_s,
        )  # fmt: skip
        records.append(dict(record, work=work(record)))
    return records


def scipy_record(name, problem, solver, rtol):
    """One scipy solve's error and counts, and the median time of `SCIPY_REPEATS` solves."""
    runs = [
        scipy_solve(problem, SCIPY[solver], rtol, rtol * problem["atol_factor"])
        for _ in range(SCIPY_REPEATS)
    ]
    result = runs[0][0]
    err = error(result.y[:, -1], problem["reference"])
    record = dict(
        problem=name, rtol=rtol, solver=solver, error=err, digits=digits(err),
        steps=int(result.t.size - 1), jacobians=int(result.njev), lus=int(result.nlu),
        fn_evals=int(result.nfev), run_ms=1e3 * statistics.median(s for _, s in runs),
        compile_s=None,
    )  # fmt: skip
    return dict(record, work=work(record))


def work_precision(name, problem, rtols, target_s):
    records = []
    for rtol in rtols:
        runs = [(solver, rtol) for solver in [*ODECKPT_SOLVERS, PEER]]
        records += measure(name, problem, runs, target_s)
        records += [scipy_record(name, problem, solver, rtol) for solver in SCIPY]
        print(*records[-len(runs) - len(SCIPY) :], sep="\n", flush=True)
    return records


def reference_check(name, problem):
    """scipy Radau at rtol 1e-12 against the published reference: how tight the reference is
    compared with what any run here reaches. `atol` is 1e-12 times the smallest component of
    the reference (the solve's own rule, atol = 1e-4 rtol on ROBER, would leave y1 ~ 2e-8 at
    t1 with a relative tolerance of 5e-9)."""
    atol = 1e-12 * float(np.min(np.abs(problem["reference"])))
    result, seconds = scipy_solve(problem, "Radau", 1e-12, atol)
    err = error(result.y[:, -1], problem["reference"])
    return dict(problem=name, rtol=1e-12, atol=atol, error=err, digits=digits(err))


def target_rows(records, rtols=(1e-6, 1e-8)):
    """Per problem and rtol: scipy Radau's digits, work and time, and which odeckpt steppers
    deliver >= its digits - 0.5 with fewer f + J evaluations and less run time; if none, the
    closest (most digits) and its shortfalls."""
    rows = []
    for name in PROBLEMS:
        for rtol in rtols:
            here = [r for r in records if r["problem"] == name and r["rtol"] == rtol]
            if not here:
                continue
            peer = next(r for r in here if r["solver"] == TARGET_PEER)
            ours = [r for r in here if r["solver"] in ODECKPT_SOLVERS]
            checks = {r["solver"]: _meets(r, peer) for r in ours}
            met = [s.removeprefix("odeckpt ") for s, c in checks.items() if all(c.values())]
            accurate = [r for r in ours if checks[r["solver"]]["digits"]]
            best = min(accurate, key=lambda r: r["run_ms"]) if accurate else None
            best = best or max(ours, key=lambda r: r["digits"])
            rows.append(
                dict(
                    problem=name, rtol=rtol, scipy_digits=peer["digits"],
                    scipy_work=peer["work"], scipy_run_ms=peer["run_ms"],
                    met_by=", ".join(met) or "none", best=best["solver"],
                    best_digits=best["digits"], best_work=best["work"],
                    best_run_ms=best["run_ms"],
                    digits_margin=best["digits"] - (peer["digits"] - 0.5),
                    work_ratio=best["work"] / peer["work"],
                    run_ratio=best["run_ms"] / peer["run_ms"],
                )
            )  # fmt: skip
    return rows


def proportionality_rows(records):
    """Per problem and solver: the slope of log(error at t1) against log(rtol), and error / rtol
    at each rtol (how the achieved error relates to the tolerance asked for)."""
    rows = []
    for name in PROBLEMS:
        for solver in [*ODECKPT_SOLVERS, PEER, *SCIPY]:
            here = sorted(
                (r for r in records if r["problem"] == name and r["solver"] == solver),
                key=lambda r: -r["rtol"],
            )
            if not here:
                continue
            rtols, errors = [r["rtol"] for r in here], [r["error"] for r in here]
            row = dict(problem=name, solver=solver)
            if len(here) > 1 and np.all(np.isfinite(errors)):
                row["slope"] = float(np.polyfit(np.log(rtols), np.log(errors), 1)[0])
            row.update({f"ratio_{r:.0e}": e / r for r, e in zip(rtols, errors, strict=True)})
            rows.append(row)
    return rows


def _meets(record, peer) -> dict:
    return dict(
        digits=record["digits"] >= peer["digits"] - 0.5,
        work=record["work"] < peer["work"],
        time=record["run_ms"] < peer["run_ms"],
    )


LADDER_TIGHTEST = 24  # the ladder of rtols is 10**(-k/2) for k up to 24 (rtol 1e-12)


def ladder(rtol):
    """The half-decade rtols 10**(-k/2) from `rtol` down to 1e-12."""
    start = round(-2 * np.log10(rtol))
    return [10.0 ** (-k / 2) for k in range(start, LADDER_TIGHTEST + 1)]


def loosest_match(problem, solver, rtol, target, errors):
    """The loosest rtol of `ladder(rtol)` at which `solver`'s error at t1 is <= `target`, or None.
    `errors` caches `{(solver, rtol): error}` across searches."""
    for candidate in ladder(rtol):
        key = (solver, candidate)
        if key not in errors:
            errors[key] = solve_once(problem, solver, candidate)["error"]
        if errors[key] <= target:
            return candidate
    return None


def equal_accuracy(name, problem, records, target_s):
    """For each diffrax row of `records`, each of `EQUAL_ACCURACY_SOLVERS` at the loosest
    ladder rtol that is at least as accurate at t1, timed in one `compare` with that diffrax
    run."""
    records = [r for r in records if r["problem"] == name]
    errors = {
        (r["solver"], r["rtol"]): r["error"]
        for r in records
        if r["solver"] in EQUAL_ACCURACY_SOLVERS
    }
    rows = []
    for peer in (r for r in records if r["solver"] == PEER):
        matches = {
            solver: loosest_match(problem, solver, peer["rtol"], peer["error"], errors)
            for solver in EQUAL_ACCURACY_SOLVERS
        }
        runs = [(PEER, peer["rtol"])] + [(s, r) for s, r in matches.items() if r is not None]
        timed = measure(name, problem, runs, target_s)
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
    Column("digits", "digits", ".1f"),
    Column("steps", "steps"),
    Column("jacobians", "Jacobians"),
    Column("lus", "LU"),
    Column("fn_evals", "f evals"),
    Column("work", "f + J"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("compile_s", "compile (s)", ".2f"),
]
TARGET_COLUMNS = [
    Column("problem", "problem"),
    Column("rtol", "rtol", ".0e"),
    Column("scipy_digits", "scipy Radau digits", ".1f"),
    Column("scipy_work", "scipy f + J"),
    Column("scipy_run_ms", "scipy run (ms)", ".3g"),
    Column("met_by", "all three met by"),
    Column("best", "fastest accurate odeckpt (else most digits)"),
    Column("best_digits", "its digits", ".1f"),
    Column("digits_margin", "digits - (scipy - 0.5)", "+.1f"),
    Column("best_work", "its f + J"),
    Column("work_ratio", "f + J ratio", ".2f"),
    Column("best_run_ms", "its run (ms)", ".3g"),
    Column("run_ratio", "run ratio", ".3f"),
]
TARGET_NOTES = """Target: at rtol 1e-6 and 1e-8, an odeckpt stepper with digits >= scipy Radau's
- 0.5, fewer f + J evaluations and less run time than scipy Radau. Ratios are odeckpt / scipy Radau.
"fastest accurate" is the fastest odeckpt stepper that meets the digits target; where none
does, the one with the most digits is shown and the margin is negative."""
PROPORTIONALITY_NOTES = """## Tolerance proportionality

The slope of log(error at t1) against log(rtol) over the rtols run (1: the error falls one
decade per decade of rtol), and error / rtol at each rtol (below 1: more accurate than asked)."""
REFERENCE_COLUMNS = [
    Column("problem", "problem"),
    Column("rtol", "rtol", ".0e"),
    Column("atol", "atol", ".0e"),
    Column("error", "error at t1", ".1e"),
    Column("digits", "digits", ".1f"),
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


PLOT = pathlib.Path(__file__).resolve().parent.parent / "docs/images/benchmarks"


def plot(records, command: str, suffix: str) -> pathlib.Path:
    """Digits at t1 against f + J evaluations, one panel per problem, one line per solver."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    solvers = [*ODECKPT_SOLVERS, *SCIPY]
    fig, axes = plt.subplots(1, len(PROBLEMS), figsize=(12, 4.8))
    for ax, name in zip(axes, PROBLEMS, strict=True):
        for i, solver in enumerate(solvers):
            rows = [r for r in records if r["problem"] == name and r["solver"] == solver]
            rows.sort(key=lambda r: -r["rtol"])
            style = "--" if solver in SCIPY else "-"
            ax.plot([r["work"] for r in rows], [r["digits"] for r in rows], style, marker="o",
                    color=f"C{i}", label=solver.removeprefix("odeckpt "))  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("evaluations of f + Jacobian")
        ax.set_ylabel("correct digits at t1")
        ax.set_title({"robertson": "ROBER (t1 = 1e11)", "van_der_pol": "VDPOL (mu = 1000)"}[name])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"rtol 1e-4, 1e-6, 1e-8: `{command}`", fontsize=9)
    fig.tight_layout()
    PLOT.mkdir(parents=True, exist_ok=True)
    path = PLOT / f"stiff-work-precision{suffix}.png"
    fig.savefig(path, dpi=110)
    return path


def write_stiff(records, matches, references, rtols, command, suffix, env):
    """`results/stiff<suffix>.{json,md}`: the work-precision table, the targets, tolerance
    proportionality, the reference check and (when run) the equal-accuracy search."""
    targets, proportional = target_rows(records), proportionality_rows(records)
    print(*targets, *proportional, sep="\n")
    ratio_columns = [Column(f"ratio_{r:.0e}", f"error / rtol at {r:.0e}", ".2g") for r in rtols]
    proportional_columns = [
        Column("problem", "problem"), Column("solver", "solver"), Column("slope", "slope", ".2f"),
        *ratio_columns,
    ]  # fmt: skip
    notes = [
        "## Targets against scipy Radau", TARGET_NOTES, markdown_table(targets, TARGET_COLUMNS),
        PROPORTIONALITY_NOTES, markdown_table(proportional, proportional_columns),
        "## The reference\n\nThe published test-set references; scipy Radau at rtol 1e-12 "
        "(atol 1e-12 times the smallest component) against them:",
        markdown_table(references, REFERENCE_COLUMNS),
    ]  # fmt: skip
    if matches:
        notes += [EQUAL_NOTES, markdown_table(matches, EQUAL_COLUMNS)]
    json_path, _ = write_results(
        "stiff" + suffix, records, COLUMNS, title="Stiff solvers: work-precision",
        command=command, env=env, notes="\n\n".join(notes),
    )  # fmt: skip
    payload = json.loads(json_path.read_text())
    extra = dict(
        targets=targets, proportionality=proportional, reference_check=references,
        equal_accuracy=matches,
    )  # fmt: skip
    json_path.write_text(json.dumps({**payload, **extra}, indent=2) + "\n")
    print(f"wrote {json_path}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="rtol 1e-6 only, short timings, no equal-accuracy search or gradient compiles",
    )  # fmt: skip
    options = parser.parse_args(argv)
    rtols = [1e-6] if options.quick else [1e-4, 1e-6, 1e-8]
    target_s = 0.5 if options.quick else 2.0
    command = "python benchmarks/bench_stiff.py" + (" --quick" if options.quick else "")
    suffix = "-quick" if options.quick else ""
    env = environment()
    records, references = [], []
    for name, problem in PROBLEMS.items():
        references.append(reference_check(name, problem))
        print(references[-1], flush=True)
        records += work_precision(name, problem, rtols, target_s)
    # Written before the longer parts, and again with them.
    write_stiff(records, [], references, rtols, command, suffix, env)
    print(f"wrote {plot(records, command, suffix)}", flush=True)
    if options.quick:
        return
    matches = []
    for name, problem in PROBLEMS.items():
        matches += equal_accuracy(name, problem, records, target_s)
    write_stiff(records, matches, references, rtols, command, suffix, env)
    gradients = gradient_compile_times()
    print(*gradients, sep="\n")
    write_results(
        "stiff-gradients" + suffix, gradients, GRADIENT_COLUMNS,
        title="Stiff solvers: gradient compile time (Robertson, rtol 1e-6)",
        command=command, env=env,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
