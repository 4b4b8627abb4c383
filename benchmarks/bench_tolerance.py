"""Tolerance proportionality of the steppers `bench_stiff.py` leaves out: how the error at t1
relates to `rtol` for every explicit stepper with an error estimate and for `ImplicitEuler` and
`Trapezoid` (issue 22; `bench_stiff.py` measures Kvaerno3/4/5, Rodas5, Radau5 and BDF).

    python benchmarks/bench_tolerance.py

The explicit steppers run where explicit steppers belong, on non-stiff problems: Van der Pol
with mu = 1 (y0 = (2, 0), t in [0, 10]) and Lotka-Volterra (a, b, c, d = 1.1, 0.4, 0.4, 0.1,
y0 = (10, 5), t in [0, 15]), against scipy's DOP853 at rtol = atol = 1e-13; atol = rtol. On
the stiff ROBER and VDPOL of `bench_stiff.py` they would need millions of steps.
`ImplicitEuler` and `Trapezoid` run on ROBER and VDPOL with `bench_stiff.py`'s tolerances and
references. Per stepper and problem: the error at t1 (largest relative error over the
components), the slope of log(error) against log(rtol) (1: one decade per decade) and error /
rtol (below 1: more accurate than asked). Writes `benchmarks/results/tolerance.{json,md}`.

    python benchmarks/bench_tolerance.py --stiff

The stiff steppers of `bench_stiff.py` and scipy's `Radau` and `BDF` (with the exact Jacobian)
on ROBER and VDPOL at nine rtols, half a decade apart from 1e-4 to 1e-8: the error at t1 is
irregular in rtol, and a slope fitted over three points depends on where they fall. Writes
`benchmarks/results/tolerance-stiff.{json,md}`.
"""

import argparse
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _harness import Column, environment, write_results  # noqa: E402
from bench_stiff import (  # noqa: E402
    ODECKPT_SOLVERS,
    PROBLEMS as STIFF,  # noqa: E402
    SCIPY,
    digits,
    error,
    scipy_solve,
)
from scipy.integrate import solve_ivp  # noqa: E402

import odeckpt  # noqa: E402


def van_der_pol(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def lotka_volterra(t, y, p):
    a, b, c, d = p
    return jnp.stack([a * y[0] - b * y[0] * y[1], d * y[0] * y[1] - c * y[1]])


def _reference(f, y0, args, t1):
    """scipy's DOP853 at rtol = atol = 1e-13."""
    rhs = lambda t, y: np.asarray(f(t, jnp.asarray(y), jnp.asarray(args)))
    result = solve_ivp(rhs, (0.0, t1), y0, method="DOP853", rtol=1e-13, atol=1e-13)
    assert result.success, result.message
    return result.y[:, -1]


NON_STIFF = {
    "van_der_pol_mu_1": dict(f=van_der_pol, y0=np.array([2.0, 0.0]), args=np.array(1.0), t1=10.0,
                             atol_factor=1.0),
    "lotka_volterra": dict(f=lotka_volterra, y0=np.array([10.0, 5.0]),
                           args=np.array([1.1, 0.4, 0.4, 0.1]), t1=15.0, atol_factor=1.0),
}  # fmt: skip
EXPLICIT = ("heun", "bosh3", "tsit5", "dopri5", "dopri8")
"""The explicit steppers with an embedded error estimate (the others take constant steps)."""
CLASSIC_IMPLICIT = ("implicit_euler", "trapezoid")
RTOLS = {"implicit_euler": (1e-2, 1e-3, 1e-4)}
"""ImplicitEuler holds its steps to rtol^2-like tolerances (`tolerance_exponent = 2`): tighter
rtols than these take more than `MAX_STEPS` steps on ROBER."""
DEFAULT_RTOLS = (1e-4, 1e-6, 1e-8)
FINE_RTOLS = tuple(float(r) for r in np.logspace(-4, -8, 9))
"""`--stiff`: half a decade apart."""
MAX_STEPS = 1_000_000

COLUMNS = [
    Column("problem", "problem"),
    Column("stepper", "stepper"),
    Column("slope", "slope", ".2f"),
    Column("rtols", "rtols"),
    Column("errors", "error at t1"),
    Column("ratios", "error / rtol"),
    Column("steps", "steps"),
]


def run(name: str, problem: dict, stepper, rtols=None) -> dict:
    """The error at t1 of `stepper` (a name or an odeckpt stepper) at each of `rtols`."""
    rtols = rtols or RTOLS.get(stepper, DEFAULT_RTOLS)

    @jax.jit
    def final(y0, args, rtol):
        sol = odeckpt.solve(
            problem["f"], y0, (0.0, problem["t1"]), args, solver=stepper, rtol=rtol,
            atol=rtol * problem["atol_factor"], max_steps=MAX_STEPS, adjoint="forward",
            throw=False,
        )  # fmt: skip
        ok = sol.status == odeckpt.Status.successful
        return jnp.where(ok, sol.ys[-1], jnp.nan), sol.stats.num_steps

    errors, steps = [], []
    for rtol in rtols:
        # Traced tolerances: one compile for the three rtols.
        y1, n = final(jnp.asarray(problem["y0"]), jnp.asarray(problem["args"]), rtol)
        errors.append(error(y1, problem["reference"]))
        steps.append(int(n))
    return record(name, stepper if isinstance(stepper, str) else stepper.name, rtols, errors, steps)


def run_scipy(name: str, problem: dict, method: str, rtols) -> dict:
    """The error at t1 of scipy's `method` at each of `rtols`."""
    errors, steps = [], []
    for rtol in rtols:
        result, _ = scipy_solve(problem, method, rtol, rtol * problem["atol_factor"])
        errors.append(error(result.y[:, -1], problem["reference"]))
        steps.append(len(result.t) - 1)
    return record(name, f"scipy {method}", rtols, errors, steps)


def record(name: str, stepper: str, rtols, errors, steps) -> dict:
    """The errors, their slope against rtol on log scales, and error / rtol."""
    slope = float(np.polyfit(np.log(rtols), np.log(errors), 1)[0])
    fmt = lambda values, spec: ", ".join(format(v, spec) for v in values)
    return dict(
        problem=name, stepper=stepper, slope=slope, rtols=fmt(rtols, ".0e"),
        errors=fmt(errors, ".1e"), ratios=fmt(np.divide(errors, rtols), ".2g"),
        steps=", ".join(map(str, steps)), digits=[digits(e) for e in errors],
    )  # fmt: skip


def stiff(env) -> int:
    """`--stiff`: every stiff stepper and scipy's on ROBER and VDPOL at `FINE_RTOLS`."""
    records = []
    for name, problem in STIFF.items():
        for solver in ODECKPT_SOLVERS.values():
            records.append(run(name, problem, solver(), FINE_RTOLS))
            print(records[-1], flush=True)
        for method in SCIPY.values():
            records.append(run_scipy(name, problem, method, FINE_RTOLS))
            print(records[-1], flush=True)
    return written("tolerance-stiff", records, "Tolerance proportionality of stiff solvers",
                   "python benchmarks/bench_tolerance.py --stiff", env)  # fmt: skip


def written(name: str, records, title: str, command: str, env) -> int:
    """Write `benchmarks/results/<name>.{json,md}` and say so."""
    json_path, md_path = write_results(
        name, records, COLUMNS, title=title, command=command, env=env
    )
    print(f"wrote {json_path} and {md_path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stiff", action="store_true", help="stiff solvers at nine rtols")
    env = environment()
    if parser.parse_args().stiff:
        return stiff(env)
    records = []
    for name, problem in NON_STIFF.items():
        problem = {**problem, "reference": _reference(**{k: problem[k] for k in
                                                         ("f", "y0", "args", "t1")})}  # fmt: skip
        for stepper in EXPLICIT:
            records.append(run(name, problem, stepper))
            print(records[-1], flush=True)
    for name, problem in STIFF.items():
        for stepper in CLASSIC_IMPLICIT:
            records.append(run(name, problem, stepper))
            print(records[-1], flush=True)
    return written("tolerance", records, "Tolerance proportionality",
                   "python benchmarks/bench_tolerance.py", env)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
