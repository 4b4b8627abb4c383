"""Index-1 differential-algebraic test problems `M y' = f(t, y, args)` with constant mass
matrices, for `odeckpt.solve(..., mass_matrix=...)`.

CHEMAKZO and TRANSAMP are problems of the Bari test set for IVP solvers (F. Mazzia & C.
Magherini, *Test Set for Initial Value Problem Solvers*, release 2.4, University of Bari,
2008; problem descriptions and Fortran sources `chemakzo.f` and `transamp.f` of the test set):
the equations, constants, consistent initial values and the published reference solutions at
`t1` (computed by the test set's authors with PSIDE in Cray double precision at tolerances
1e-19 and 1e-14) are taken from there, written here in JAX. Robertson's kinetics with its
conservation law as the algebraic equation (Hairer & Wanner, *Solving ODEs II*, VI.1) has a
reference from the ODE form.

Every rate constant, resistance or other parameter of `f` is in `args` (a float64 array), so
the solution can be differentiated with respect to it; a mass matrix must be a constant, so
TRANSAMP's capacitances are fixed in `M`.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp


@dataclasses.dataclass(frozen=True, eq=False)
class DAEProblem:
    """One problem `M y' = f(t, y, args)`, `y(t0) = y0` on `t_span`, with the reference
    solution `reference[i]` at `reference_ts[i]` (the last is `t1`)."""

    name: str
    f: Callable
    y0: np.ndarray
    t_span: tuple[float, float]
    args: np.ndarray
    mass_matrix: np.ndarray
    reference_ts: np.ndarray
    reference: np.ndarray


def correct_digits(y, reference, atol_over_rtol: float = 0.0) -> float:
    """The test set's number of correct digits of `y` against `reference` (same shape; over
    all entries): `-log10(max |y - ref| / (atol_over_rtol + |ref|))`.

    With `atol_over_rtol = 0` this is the test set's "scd" (significant correct digits, of the
    largest relative error). With `atol_over_rtol = atol / rtol` of the run it is the test set's
    "mescd" (mixed error significant correct digits, release 2.4): a component much smaller
    than `atol / rtol` is measured by its absolute error, so that a tiny component that the
    tolerances do not ask to resolve does not dominate. A failed solve (NaN) has none: `-inf`.
    """
    y, reference = np.asarray(y, np.float64), np.asarray(reference, np.float64)
    error = np.max(np.abs(y - reference) / (atol_over_rtol + np.abs(reference)))
    if not np.isfinite(error):
        return -np.inf
    return float(-np.log10(max(error, 1e-17)))


# --- CHEMAKZO -------------------------------------------------------------------------------

CHEMAKZO_ARGS = np.array([18.7, 0.58, 0.09, 0.42, 34.4, 3.3, 115.83, 0.9, 737.0])
"""`(k1, k2, k3, k4, K, klA, Ks, pCO2, H)` of the test set."""


def chemakzo(t, y, p):
    """The chemical Akzo Nobel problem (test set problem CHEMAKZO): six species of a reaction
    in which CO2 is bubbled through, `y6` fixed by the equilibrium `Ks y1 y4 = y6`. `p` are the
    constants `CHEMAKZO_ARGS`. Rows 1-5 are the species' rates, row 6 the algebraic equation.
    (A negative `y2`, which the test set refuses, gives NaN under the square root, which the
    steppers reject.)"""
    k1, k2, k3, k4, kbig, kla, ks, pco2, henry = (p[i] for i in range(9))
    root = jnp.sqrt(y[1])
    r1 = k1 * y[0] ** 4 * root
    r2 = k2 * y[2] * y[3]
    r3 = k2 / kbig * y[0] * y[4]
    r4 = k3 * y[0] * y[3] ** 2
    r5 = k4 * y[5] ** 2 * root
    inflow = kla * (pco2 / henry - y[1])
    return jnp.stack(
        [
            -2.0 * r1 + r2 - r3 - r4,
            -0.5 * r1 - r4 - 0.5 * r5 + inflow,
            r1 - r2 + r3,
            -r2 + r3 - 2.0 * r4,
            r2 - r3 + r5,
            ks * y[0] * y[3] - y[5],
        ]
    )


CHEMAKZO = DAEProblem(
    name="chemakzo",
    f=chemakzo,
    # The test set's consistent values: y6 = Ks y1 y4.
    y0=np.array([0.444, 0.00123, 0.0, 0.007, 0.0, 115.83 * 0.444 * 0.007]),
    t_span=(0.0, 180.0),
    args=CHEMAKZO_ARGS,
    mass_matrix=np.diag([1.0, 1.0, 1.0, 1.0, 1.0, 0.0]),
    reference_ts=np.array([180.0]),
    reference=np.array(
        [
            [
                0.1150794920661702,
                0.1203831471567715e-2,
                0.1611562887407974,
                0.3656156421249283e-3,
                0.1708010885264404e-1,
                0.4873531310307455e-2,
            ]
        ]
    ),
)


# --- TRANSAMP -------------------------------------------------------------------------------

TRANSAMP_ARGS = np.array([6.0, 0.026, 0.99, 1e-6, 1000.0, *([9000.0] * 9)])
"""`(Ub, UF, alpha, beta, R0, R1, ..., R9)` of the test set: supply voltage, the transistors'
thermal voltage, current gain and saturation current, and the ten resistances."""
TRANSAMP_CAPACITANCES = np.array([1e-6, 2e-6, 3e-6, 4e-6, 5e-6])
"""`C1, ..., C5` of the test set."""


def transamp_mass_matrix(c: np.ndarray) -> np.ndarray:
    """The test set's `M` for capacitances `c = (C1, ..., C5)`: C1, C3 and C5 couple nodes
    (1, 2), (4, 5) and (7, 8), C2 and C4 ground nodes 3 and 6. Rank 5, so three algebraic
    equations (the sums of the coupled rows)."""
    m = np.zeros((8, 8))
    for k, (i, j) in zip((0, 2, 4), ((0, 1), (3, 4), (6, 7)), strict=True):
        m[np.ix_([i, j], [i, j])] = c[k] * np.array([[-1.0, 1.0], [1.0, -1.0]])
    m[2, 2], m[5, 5] = -c[1], -c[3]
    return m


def transamp(t, y, p):
    """The transistor amplifier (test set problem TRANSAMP): node voltages `y` of a two-stage
    amplifier with input `Ue(t) = 0.1 sin(200 pi t)` and transistor currents
    `beta (exp((U_base - U_emitter) / UF) - 1)`. `p` are the constants `TRANSAMP_ARGS`.
    (The test set refuses an exponent above 300; here `exp` overflows to inf, and the steppers
    reject the step.)"""
    ub, uf, alpha, beta = p[0], p[1], p[2], p[3]
    r = [p[4 + i] for i in range(10)]
    ue = 0.1 * jnp.sin(200.0 * jnp.pi * t)
    current1 = beta * (jnp.exp((y[1] - y[2]) / uf) - 1.0)
    current2 = beta * (jnp.exp((y[4] - y[5]) / uf) - 1.0)
    return jnp.stack(
        [
            (y[0] - ue) / r[0],
            y[1] / r[1] + (y[1] - ub) / r[2] + (1.0 - alpha) * current1,
            y[2] / r[3] - current1,
            (y[3] - ub) / r[4] + alpha * current1,
            y[4] / r[5] + (y[4] - ub) / r[6] + (1.0 - alpha) * current2,
            y[5] / r[7] - current2,
            (y[6] - ub) / r[8] + alpha * current2,
            y[7] / r[9],
        ]
    )


_UB = 6.0
TRANSAMP = DAEProblem(
    name="transamp",
    f=transamp,
    # The test set's consistent values: the bias points of the two stages (R1 = R2, R5 = R6).
    y0=np.array([0.0, _UB / 2, _UB / 2, _UB, _UB / 2, _UB / 2, _UB, 0.0]),
    t_span=(0.0, 0.2),
    args=TRANSAMP_ARGS,
    mass_matrix=transamp_mass_matrix(TRANSAMP_CAPACITANCES),
    reference_ts=np.array([0.2]),
    reference=np.array(
        [
            [
                -0.5562145012262709e-2,
                0.3006522471903042e1,
                0.2849958788608128e1,
                0.2926422536206241e1,
                0.2704617865010554e1,
                0.2761837778393145e1,
                0.4770927631616772e1,
                0.1236995868091548e1,
            ]
        ]
    ),
)


# --- Robertson as a DAE ---------------------------------------------------------------------

ROBERTSON_ARGS = np.array([0.04, 3e7, 1e4])


def robertson_dae(t, y, k):
    """Robertson's kinetics with the conservation law `y1 + y2 + y3 = 1` in place of the third
    species' rate (Hairer & Wanner, *Solving ODEs II*, VI.1, (1.4))."""
    return jnp.stack(
        [
            -k[0] * y[0] + k[2] * y[1] * y[2],
            k[0] * y[0] - k[1] * y[1] ** 2 - k[2] * y[1] * y[2],
            y[0] + y[1] + y[2] - 1.0,
        ]
    )


ROBERTSON_TS = np.array([1e-2, 1.0, 100.0, 1e4, 1e5])


def robertson_reference(ts=ROBERTSON_TS) -> np.ndarray:
    """The ODE form of Robertson's kinetics (`y3' = k2 y2^2`) by
    `scipy.integrate.solve_ivp(method="Radau", rtol=1e-12, atol=1e-20)` with its exact
    Jacobian, at `ts` (shape `[len(ts), 3]`); y2 peaks near 3.6e-5, hence the tiny atol."""
    k1, k2, k3 = ROBERTSON_ARGS

    def rates(t, y):
        fast, slow = k2 * y[1] ** 2, k3 * y[1] * y[2]
        return [-k1 * y[0] + slow, k1 * y[0] - fast - slow, fast]

    def jacobian(t, y):
        return [
            [-k1, k3 * y[2], k3 * y[1]],
            [k1, -2 * k2 * y[1] - k3 * y[2], -k3 * y[1]],
            [0.0, 2 * k2 * y[1], 0.0],
        ]

    result = solve_ivp(rates, (0.0, float(ts[-1])), [1.0, 0.0, 0.0], method="Radau",
                       rtol=1e-12, atol=1e-20, jac=jacobian, t_eval=ts)  # fmt: skip
    assert result.success, result.message
    return result.y.T


# `robertson_reference(ROBERTSON_TS)`, stored; `test_dae_references.py::test_robertson_reference`
# (slow) recomputes it.
ROBERTSON_REFERENCE = np.array(
    [
        [9.9960068268829394e-01, 3.6450478878438726e-05, 3.6286683282835998e-04],
        [9.6645973733300283e-01, 3.0746265785786134e-05, 3.3509516401211512e-02],
        [6.1723488239611635e-01, 6.1535912746398480e-06, 3.8275896401261006e-01],
        [1.0730042853780469e-01, 4.8001669725715705e-07, 8.9269909144549864e-01],
        [1.7865921142100241e-02, 7.2747514684366524e-08, 9.8213400611038360e-01],
    ]
)

ROBERTSON = DAEProblem(
    name="robertson",
    f=robertson_dae,
    # The algebraic component is only a guess: the solve makes it consistent (y3 = 0).
    y0=np.array([1.0, 0.0, 0.3]),
    t_span=(0.0, float(ROBERTSON_TS[-1])),
    args=ROBERTSON_ARGS,
    mass_matrix=np.diag([1.0, 1.0, 0.0]),
    reference_ts=ROBERTSON_TS,
    reference=ROBERTSON_REFERENCE,
)

PROBLEMS = {p.name: p for p in (CHEMAKZO, TRANSAMP, ROBERTSON)}
