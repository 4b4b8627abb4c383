"""Differential-algebraic equations `M y' = f(t, y, args)`: work-precision of odeckpt's Radau5,
BDF and Rodas5 with a mass matrix against SUNDIALS IDA (scikit-sundae), and the time and
accuracy of each adjoint's gradient.

    python benchmarks/bench_dae.py            # rtol 1e-4 .. 1e-10, gradients at rtol 1e-8
    python benchmarks/bench_dae.py --quick    # rtol 1e-4, 1e-6, 1e-8, short timings

Problems (float64; `tests/dae_problems.py`), both index-1 DAEs of the Bari test set for IVP
solvers (F. Mazzia & C. Magherini, release 2.4) with its constants, consistent initial values
and published reference solutions at t1:

- CHEMAKZO: the chemical Akzo Nobel problem, 6 components, `M = diag(1, 1, 1, 1, 1, 0)`,
  t in [0, 180], 9 rate constants as `args`;
- TRANSAMP: the transistor amplifier, 8 components, a non-diagonal `M` of rank 5 built from
  the capacitances, t in [0, 0.2] (40 periods of the input), 14 parameters as `args`
  (supply voltage, transistor constants, resistances).

Work-precision: for rtol in 1e-4, 1e-5, ..., 1e-10 with atol = rtol (the test set's runs),
each solver reports the correct digits at t1, "scd" (`-log10` of the largest relative error)
and "mescd" (the test set's mixed measure, `-log10 max |y - ref| / (atol / rtol + |ref|)`),
accepted and rejected steps, evaluations of `f`, Jacobian evaluations (their sum is "f + J"),
LU factorisations, run time (median of calls after warm-up) and, for odeckpt, compile time
(trace + lower + XLA compile from cleared caches, median of repeats; the tolerances are traced,
so one compilation serves every rtol). A solve that fails shows its status and no digits.

Counting: odeckpt's `sol.stats` (one `f` per Newton iteration and stage; Radau5 counts a real
and a complex factorisation as two LUs; a Jacobian is one `jax.jacfwd`). IDA: `nfev` residual
evaluations, `njev` Jacobian evaluations, its steps are the accepted steps (the points it
returns), and it reports no LU count (its dense solver factorises at each Jacobian
evaluation and each change of `cj`).

Peer: scipy and diffrax have no DAE solver. SUNDIALS IDA (variable-order BDF, the reference
DAE code) through `scikit-sundae` (module `sksundae`, a wheel on PyPI for Python 3.11; the
`bench` extra of pyproject.toml) solves the residual form `M y' - f(t, y) = 0` with the same
tolerances, `f` and its exact Jacobian written in NumPy (what an IDA user writes: no JAX
dispatch per call) and the consistent `y'(t0)` computed from the completed system
`(M + Q Q^T J) y' = f - Q Q^T f_t` (no IDACalcIC). IDA runs in Python callbacks, so its run
time compares an interpreted loop with a jitted one; the work counts compare the algorithms.
`assimulo` (the other IDA binding) has no wheel for Python 3.11 on PyPI. scikit-sundae has no
sensitivity analysis, so it has no gradient rows.

Gradients (rtol 1e-8): `jax.grad` of the loss `sum(y(t1))` with respect to the log of the
parameters (`dL/dlog p = p dL/dp`, so that parameters of different units weigh alike), for
every adjoint that supports DAEs: 'direct', 'recursive', 'forward' (`ForwardMode`, through
`jax.jacfwd`) and `ForwardSensitivity()`. Correct digits: `-log10(max |g - g_ref| /
max |g_ref|)` (as `bench_gradient_accuracy.py`). The reference `g_ref` is Richardson-extrapolated
central finite differences in log p (steps 2e-3 and 1e-3) of Radau5 solves at rtol = atol =
1e-12 on CHEMAKZO and 1e-10 on TRANSAMP (tighter, Radau5 fails its Newton iteration there);
the same extrapolation from steps 4e-3 and 2e-3 agrees with it to the digits given in the
notes, which bound how many digits can be measured. Run time: median
of calls of the compiled gradient; compile time: one compilation.

Results go to `benchmarks/results/dae.{json,md}` (`dae-quick` under `--quick`).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Column, environment, markdown_table, time_compile, write_results  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from dae_problems import CHEMAKZO, TRANSAMP, correct_digits  # noqa: E402

import odeckpt  # noqa: E402

try:
    import sksundae
except ImportError:  # the `bench` extra is optional: the odeckpt rows run without it
    sksundae = None

PROBLEMS = {"chemakzo": CHEMAKZO, "transamp": TRANSAMP}
MAX_STEPS = {"chemakzo": 20_000, "transamp": 200_000}
GRADIENT_MAX_STEPS = {"chemakzo": 4_096, "transamp": 32_768}
"""Steps for the gradients at rtol 1e-8 (the direct adjoint's cost grows with `max_steps`)."""
STEPPERS = {"Radau5": odeckpt.Radau5, "BDF": odeckpt.BDF, "Rodas5": odeckpt.Rodas5}
ADJOINTS = {
    "direct": ("direct", jax.grad),
    "recursive": ("recursive", jax.grad),
    "forward": ("forward", jax.jacfwd),
    "ForwardSensitivity": (odeckpt.ForwardSensitivity(), jax.grad),
}
GRADIENT_RTOL = 1e-8
REFERENCE_RTOL = {"chemakzo": 1e-12, "transamp": 1e-10}
"""rtol = atol of the finite-difference reference: on TRANSAMP, Radau5 stops with
`newton_failed` at 1e-12 (t = 0.092) and, for some of the perturbed parameters, at 1e-11."""
IDA = "IDA (scikit-sundae)"


# --- NumPy f and Jacobian for IDA -----------------------------------------------------------


def chemakzo_numpy(t, y, p):
    k1, k2, k3, k4, kbig, kla, ks, pco2, henry = p
    root = np.sqrt(y[1]) if y[1] >= 0 else np.nan
    r1, r2 = k1 * y[0] ** 4 * root, k2 * y[2] * y[3]
    r3, r4 = k2 / kbig * y[0] * y[4], k3 * y[0] * y[3] ** 2
    r5, inflow = k4 * y[5] ** 2 * root, kla * (pco2 / henry - y[1])
    return np.array([-2 * r1 + r2 - r3 - r4, -0.5 * r1 - r4 - 0.5 * r5 + inflow, r1 - r2 + r3,
                     -r2 + r3 - 2 * r4, r2 - r3 + r5, ks * y[0] * y[3] - y[5]])  # fmt: skip


def chemakzo_jacobian(t, y, p):
    """`df/dy` from the gradients of the five rates."""
    k1, k2, k3, k4, kbig, kla, ks, _, _ = p
    root = np.sqrt(y[1])
    dr = np.zeros((5, 6))
    dr[0, :2] = 4 * k1 * y[0] ** 3 * root, 0.5 * k1 * y[0] ** 4 / root
    dr[1, 2:4] = k2 * y[3], k2 * y[2]
    dr[2, [0, 4]] = k2 / kbig * y[4], k2 / kbig * y[0]
    dr[3, [0, 3]] = k3 * y[3] ** 2, 2 * k3 * y[0] * y[3]
    dr[4, [1, 5]] = 0.5 * k4 * y[5] ** 2 / root, 2 * k4 * y[5] * root
    stoichiometry = np.array([[-2, 1, -1, -1, 0], [-0.5, 0, 0, -1, -0.5], [1, -1, 1, 0, 0],
                              [0, -1, 1, -2, 0], [0, 1, -1, 0, 1]])  # fmt: skip
    jac = np.zeros((6, 6))
    jac[:5] = stoichiometry @ dr
    jac[1, 1] -= kla
    jac[5] = ks * y[3], 0, 0, ks * y[0], 0, -1
    return jac


def transamp_numpy(t, y, p):
    ub, uf, alpha, beta, r = p[0], p[1], p[2], p[3], p[4:]
    ue = 0.1 * np.sin(200 * np.pi * t)
    i1, i2 = beta * (np.exp((y[1] - y[2]) / uf) - 1), beta * (np.exp((y[4] - y[5]) / uf) - 1)
    return np.array([
        (y[0] - ue) / r[0], y[1] / r[1] + (y[1] - ub) / r[2] + (1 - alpha) * i1,
        y[2] / r[3] - i1, (y[3] - ub) / r[4] + alpha * i1,
        y[4] / r[5] + (y[4] - ub) / r[6] + (1 - alpha) * i2, y[5] / r[7] - i2,
        (y[6] - ub) / r[8] + alpha * i2, y[7] / r[9],
    ])  # fmt: skip


def transamp_jacobian(t, y, p):
    """`df/dy`: the conductances on the diagonal, and each transistor's `di/du` in the rows
    its current enters."""
    uf, alpha, beta, r = p[1], p[2], p[3], p[4:]
    jac = np.diag([1 / r[0], 1 / r[1] + 1 / r[2], 1 / r[3], 1 / r[4], 1 / r[5] + 1 / r[6],
                   1 / r[7], 1 / r[8], 1 / r[9]])  # fmt: skip
    for base, slope in ((1, beta / uf * np.exp((y[1] - y[2]) / uf)),
                        (4, beta / uf * np.exp((y[4] - y[5]) / uf))):  # fmt: skip
        for row, weight in ((base, 1 - alpha), (base + 1, -1.0), (base + 2, alpha)):
            jac[row, base] += weight * slope
            jac[row, base + 1] -= weight * slope
    return jac


NUMPY = {"chemakzo": (chemakzo_numpy, chemakzo_jacobian),
         "transamp": (transamp_numpy, transamp_jacobian)}  # fmt: skip


def consistent_slope(problem) -> np.ndarray:
    """`y'(t0)` of the consistent `y0`: `(M + Q Q^T J) y' = f - Q Q^T f_t`, `Q` spanning the
    null space of `M^T` (the differentiated constraints complete `M y' = f`)."""
    t0, y0, p = problem.t_span[0], jnp.asarray(problem.y0), jnp.asarray(problem.args)
    value, f_t = jax.jvp(lambda t: problem.f(t, y0, p), (jnp.asarray(t0),), (jnp.ones(()),))
    jac = np.asarray(jax.jacfwd(problem.f, argnums=1)(t0, y0, p))
    u, singular, _ = np.linalg.svd(problem.mass_matrix)
    q = u[:, singular <= singular[0] * 1e-12]
    completed = problem.mass_matrix + q @ (q.T @ jac)
    return np.linalg.solve(completed, np.asarray(value) - q @ (q.T @ np.asarray(f_t)))


def check_numpy(name):
    """The NumPy `f` and Jacobian agree with the JAX `f` and `jax.jacfwd` at y0 and at a state
    off it (where the transistors conduct)."""
    problem, (f, jac) = PROBLEMS[name], NUMPY[name]
    p, t = problem.args, 1e-3
    for y in (problem.y0, problem.y0 + 0.05 * np.linspace(0.2, 1.0, problem.y0.size)):
        value = problem.f(t, jnp.asarray(y), jnp.asarray(p))
        np.testing.assert_allclose(f(t, y, p), value, rtol=1e-12, atol=1e-15)
        exact = jax.jacfwd(problem.f, argnums=1)(t, jnp.asarray(y), jnp.asarray(p))
        np.testing.assert_allclose(jac(t, y, p), exact, rtol=1e-12, atol=1e-15)


def ida_record(name, rtol, repeats):
    """IDA at `rtol` (atol = rtol): digits, counts and the median time of `repeats` solves."""
    problem, (f, jac) = PROBLEMS[name], NUMPY[name]
    m, p = problem.mass_matrix, problem.args

    def residual(t, y, yp, res):
        res[:] = m @ yp - f(t, y, p)

    def jacobian(t, y, yp, res, cj, out):
        out[:, :] = cj * m - jac(t, y, p)

    yp0, seconds, result = consistent_slope(problem), [], None
    for _ in range(repeats):
        solver = sksundae.ida.IDA(residual, rtol=rtol, atol=rtol, jacfn=jacobian,
                                  max_num_steps=MAX_STEPS[name])  # fmt: skip
        start = time.perf_counter()
        result = solver.solve(np.array(problem.t_span), problem.y0, yp0)
        seconds.append(time.perf_counter() - start)
    record = dict(problem=name, rtol=rtol, solver=IDA, status=str(result.message),
                  steps=len(result.t) - 1, fn_evals=int(result.nfev),
                  jacobians=int(result.njev), lus=None,
                  run_ms=1e3 * statistics.median(seconds), compile_s=None)  # fmt: skip
    return dict(record, **_digits(problem, result.y[-1] if result.success else None, rtol))


IDA_LIMIT_S = 30.0
"""IDA is not run at tighter tolerances once a solve took longer than this (on TRANSAMP its
steps grow about 30-fold per decade of rtol below 1e-8)."""


def ida_records(name, rtols, repeats):
    """`ida_record` at each rtol, loosest first, one solve only once a solve took over 5 s,
    none once one took over `IDA_LIMIT_S`."""
    records, slowest = [], 0.0
    for rtol in sorted(rtols, reverse=True):
        if slowest > IDA_LIMIT_S:
            note = f"not run: the solve at rtol {records[-1]['rtol']:.0e} took {slowest:.0f} s"
            records.append(dict(problem=name, rtol=rtol, solver=IDA, status=note, scd=None,
                                mescd=None))  # fmt: skip
        else:
            records.append(ida_record(name, rtol, repeats if slowest < 5.0 else 1))
            slowest = records[-1]["run_ms"] / 1e3
        print(records[-1], flush=True)
    return records


def _digits(problem, y, rtol):
    if y is None:
        return dict(scd=None, mescd=None, work=None)
    return dict(scd=correct_digits(y, problem.reference[-1]),
                mescd=correct_digits(y, problem.reference[-1], atol_over_rtol=1.0))  # fmt: skip


# --- odeckpt work-precision -----------------------------------------------------------------


def make_solve(name, stepper):
    """`(y0, args, rtol) -> (y(t1), stats, status)` with atol = rtol (traced)."""
    problem = PROBLEMS[name]

    def solve(y0, args, rtol):
        sol = odeckpt.solve(
            problem.f, y0, problem.t_span, args, solver=STEPPERS[stepper](),
            mass_matrix=problem.mass_matrix, rtol=rtol, atol=rtol, max_steps=MAX_STEPS[name],
            adjoint="forward", throw=False,
        )  # fmt: skip
        return sol.ys[-1], sol.stats, sol.status

    return solve


def median_time(jitted, args, target_s, min_repeats=3):
    """Median seconds of calls of `jitted(*args)` after one warm-up, about `target_s` in all."""
    jax.block_until_ready(jitted(*args))
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    estimate = max(time.perf_counter() - start, 1e-7)
    samples = []
    for _ in range(max(min_repeats, min(10_000, int(target_s / estimate)))):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def work_precision(name, stepper, rtols, target_s, compile_repeats):
    problem, solve = PROBLEMS[name], make_solve(name, stepper)
    inputs = (jnp.asarray(problem.y0), jnp.asarray(problem.args))
    compile_s = statistics.median(
        sum(time_compile(solve, *inputs, 1e-6)[:2]) for _ in range(compile_repeats)
    )
    jitted, records = jax.jit(solve), []
    for rtol in rtols:
        y1, stats, status = jitted(*inputs, rtol)
        ok = status == odeckpt.Status.successful
        record = dict(
            problem=name, rtol=rtol, solver=f"odeckpt {stepper}", status=status.name,
            steps=int(stats.num_steps), fn_evals=int(stats.num_fn_evals),
            jacobians=int(stats.num_jacobian_evals), lus=int(stats.num_lu_factorisations),
            run_ms=1e3 * median_time(jitted, (*inputs, rtol), target_s), compile_s=compile_s,
            **_digits(problem, np.asarray(y1) if ok else None, rtol),
        )  # fmt: skip
        records.append(record)
        print(record, flush=True)
    return records


# --- gradients ------------------------------------------------------------------------------


def loss_of(name, stepper, rtol, adjoint, max_steps):
    """`log p -> sum(y(t1))`."""
    problem = PROBLEMS[name]

    def loss(log_p):
        sol = odeckpt.solve(
            problem.f, jnp.asarray(problem.y0), problem.t_span, jnp.exp(log_p),
            solver=STEPPERS[stepper](), mass_matrix=problem.mass_matrix, rtol=rtol, atol=rtol,
            max_steps=max_steps, adjoint=adjoint,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1])

    return loss


def reference_gradient(name):
    """Richardson-extrapolated central differences in log p of Radau5 at rtol
    `REFERENCE_RTOL[name]`, and the digits to which two such extrapolations (steps 4e-3/2e-3
    and 2e-3/1e-3) agree."""
    rtol = REFERENCE_RTOL[name]
    loss = jax.jit(loss_of(name, "Radau5", rtol, "forward", MAX_STEPS[name]))
    log_p = jnp.log(jnp.asarray(PROBLEMS[name].args))

    def central(h):
        rows = []
        for i in range(log_p.size):
            step = jnp.zeros_like(log_p).at[i].set(h)
            rows.append((loss(log_p + step) - loss(log_p - step)) / (2 * h))
        return np.array(rows)

    d1, d2, d3 = central(4e-3), central(2e-3), central(1e-3)
    coarse, fine = (4 * d2 - d1) / 3, (4 * d3 - d2) / 3
    return fine, gradient_digits(coarse, fine)


def gradient_digits(g, reference) -> float | None:
    g = np.asarray(g)
    if not np.all(np.isfinite(g)):
        return None
    error = np.max(np.abs(g - reference)) / np.max(np.abs(reference))
    return float(-np.log10(max(error, 1e-17)))


def failure_note(error: Exception) -> str:
    """The first sentence of odeckpt's message in `error` (raised through a host callback, it
    sits inside XLA's traceback), on one line."""
    text = str(error)
    start = text.find("EquinoxRuntimeError: ")
    if start >= 0:
        text = text[start + len("EquinoxRuntimeError: ") :]
    sentence = text.split(". ")[0]
    return " ".join(sentence.split()).replace("|", "/")[:240]


def gradient_records(name, reference, target_s, failed):
    records = []
    log_p = jnp.log(jnp.asarray(PROBLEMS[name].args))
    for stepper in STEPPERS:
        for adjoint_name, (adjoint, transform) in ADJOINTS.items():
            record = dict(problem=name, rtol=GRADIENT_RTOL, solver=f"odeckpt {stepper}",
                          adjoint=adjoint_name)  # fmt: skip
            if (name, stepper) in failed:
                records.append(dict(record, note=f"solve fails: {failed[name, stepper]}"))
                continue
            loss = loss_of(name, stepper, GRADIENT_RTOL, adjoint, GRADIENT_MAX_STEPS[name])
            grad = transform(loss)
            compile_s = sum(time_compile(grad, log_p)[:2])
            jitted = jax.jit(grad)
            try:
                g = jitted(log_p)
            except Exception as error:  # a failure is a result here: record it
                records.append(dict(record, note=failure_note(error)))
                print(records[-1], flush=True)
                continue
            digits = gradient_digits(g, reference)
            record.update(digits=digits, compile_s=compile_s,
                          run_ms=1e3 * median_time(jitted, (log_p,), target_s))  # fmt: skip
            if digits is None:
                record["note"] = "non-finite gradient, no error raised"
            records.append(record)
            print(record, flush=True)
    return records


# --- output ---------------------------------------------------------------------------------

COLUMNS = [
    Column("problem", "problem"),
    Column("rtol", "rtol", ".0e"),
    Column("solver", "solver"),
    Column("status", "status"),
    Column("scd", "scd", ".2f"),
    Column("mescd", "mescd", ".2f"),
    Column("steps", "steps"),
    Column("fn_evals", "f evals"),
    Column("jacobians", "Jacobians"),
    Column("work", "f + J"),
    Column("lus", "LU"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("compile_s", "compile (s)", ".2f"),
]
GRADIENT_COLUMNS = [
    Column("problem", "problem"),
    Column("solver", "solver"),
    Column("adjoint", "adjoint"),
    Column("digits", "digits", ".2f"),
    Column("run_ms", "run (ms)", ".3g"),
    Column("compile_s", "compile (s)", ".2f"),
    Column("note", "note"),
]


def digits_table(records, measure):
    """Digits (`measure`: scd or mescd) as a solver x rtol table per problem."""
    solvers = list(dict.fromkeys(r["solver"] for r in records))
    rtols = sorted({r["rtol"] for r in records}, reverse=True)
    parts = []
    for name in PROBLEMS:
        rows = []
        for solver in solvers:
            row = dict(solver=solver)
            for r in records:
                if r["problem"] == name and r["solver"] == solver:
                    value, skipped = r[measure], r["status"].startswith("not run")
                    text = "not run" if skipped else "fail"
                    row[f"{r['rtol']:.0e}"] = text if value is None else f"{value:.2f}"
            rows.append(row)
        columns = [Column("solver", name), *(Column(f"{t:.0e}", f"{t:.0e}") for t in rtols)]
        parts.append(markdown_table(rows, columns))
    return "\n\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="rtol 1e-4, 1e-6, 1e-8, short timings, one compile each")  # fmt: skip
    options = parser.parse_args(argv)
    rtols = [1e-4, 1e-6, 1e-8] if options.quick else [10.0**-k for k in range(4, 11)]
    target_s, compile_repeats = (0.3, 1) if options.quick else (1.0, 3)
    command = "python benchmarks/bench_dae.py" + (" --quick" if options.quick else "")
    env = environment()
    env["versions"]["scikit-sundae"] = None if sksundae is None else sksundae.__version__
    records, failed = [], {}
    for name in PROBLEMS:
        check_numpy(name)
        for stepper in STEPPERS:
            rows = work_precision(name, stepper, rtols, target_s, compile_repeats)
            records += rows
            bad = [r for r in rows if r["status"] != "successful"]
            if any(r["rtol"] == GRADIENT_RTOL for r in bad):
                failed[name, stepper] = bad[0]["status"]
        if sksundae is not None:
            records += ida_records(name, rtols, repeats=1 if options.quick else 3)
    for r in records:
        r["work"] = None if r["scd"] is None else r["fn_evals"] + r["jacobians"]
    gradients, reference_digits = [], {}
    for name in PROBLEMS:
        reference, reference_digits[name] = reference_gradient(name)
        print(name, "reference gradient", reference, reference_digits[name], flush=True)
        gradients += gradient_records(name, reference, target_s, failed)
    notes = "\n\n".join([
        "## Correct digits (scd) at t1, solver x rtol (atol = rtol)", digits_table(records, "scd"),
        "## Mixed correct digits (mescd, atol / rtol = 1)", digits_table(records, "mescd"),
        f"## Gradients at rtol {GRADIENT_RTOL:.0e}\n\n`d sum(y(t1)) / d log p`; digits "
        "against Richardson-extrapolated finite differences of Radau5 at rtol 1e-12 "
        "(CHEMAKZO) and 1e-10 (TRANSAMP), whose two extrapolations agree to "
        + ", ".join(f"{d:.1f} digits ({n})" for n, d in reference_digits.items()) + ".",
        markdown_table(gradients, GRADIENT_COLUMNS),
    ])  # fmt: skip
    suffix = "-quick" if options.quick else ""
    json_path, md_path = write_results(
        "dae" + suffix, records, COLUMNS, title="DAEs: work-precision and gradients",
        command=command, env=env, notes=notes,
    )  # fmt: skip
    payload = json.loads(json_path.read_text())
    payload.update(gradients=gradients, gradient_reference_digits=reference_digits)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    sys.exit(main())
