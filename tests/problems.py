"""Test problems shared by the test files (vector fields in odeckpt's `f(t, y, args)` form)."""

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp


def lotka_volterra(t, y, args):
    a, b, c, d = args
    prey, predator = y[0], y[1]
    return jnp.stack([a * prey - b * prey * predator, d * prey * predator - c * predator])


LOTKA_VOLTERRA = dict(
    f=lotka_volterra, y0=np.array([10.0, 5.0]), t_span=(0.0, 20.0), args=(1.1, 0.4, 0.4, 0.1)
)


def van_der_pol(t, y, mu):
    return jnp.stack([y[1], mu * ((1 - y[0] ** 2) * y[1]) - y[0]])


VAN_DER_POL = dict(f=van_der_pol, y0=np.array([2.0, 0.0]), t_span=(0.0, 10.0), args=1.0)


def pleiades(t, y, args):
    """The Pleiades problem (Hairer, Nørsett & Wanner, *Solving ODEs I*, II.10): seven bodies in
    the plane, y = (x[7], y[7], vx[7], vy[7]), masses m_i = i."""
    x, yy, vx, vy = y[:7], y[7:14], y[14:21], y[21:]
    mass = jnp.arange(1.0, 8.0, dtype=y.dtype)
    dx = x[None, :] - x[:, None]
    dy = yy[None, :] - yy[:, None]
    r3 = (dx**2 + dy**2 + jnp.eye(7, dtype=y.dtype)) ** 1.5
    ax = jnp.sum(mass[None, :] * dx / r3 * (1 - jnp.eye(7, dtype=y.dtype)), axis=1)
    ay = jnp.sum(mass[None, :] * dy / r3 * (1 - jnp.eye(7, dtype=y.dtype)), axis=1)
    return jnp.concatenate([vx, vy, ax, ay])


PLEIADES = dict(
    f=pleiades,
    y0=np.array(
        [
            3,
            3,
            -1,
            -3,
            2,
            -2,
            2,
            3,
            -3,
            2,
            0,
            0,
            -4,
            4,
            0,
            0,
            0,
            0,
            0,
            1.75,
            -1.5,
            0,
            0,
            0,
            -1.25,
            1,
            0,
            0,
        ],
        dtype=float,
    ),
    t_span=(0.0, 3.0),
    args=None,
)


def reference(problem: dict, t_eval) -> np.ndarray:
    """`scipy.integrate.solve_ivp(method="DOP853", rtol=1e-12)` at `t_eval`, shape [len, dim]."""
    f = jax.jit(problem["f"])
    args = problem["args"]
    result = solve_ivp(
        lambda t, y: np.asarray(f(t, jnp.asarray(y), args)),
        problem["t_span"],
        problem["y0"],
        method="DOP853",
        rtol=1e-12,
        atol=1e-12,
        t_eval=np.asarray(t_eval),
    )
    assert result.success
    return result.y.T


def robertson(t, y, k):
    """Robertson's chemical kinetics (Hairer & Wanner, *Solving ODEs II*, IV.10): three species,
    rate constants `k = (k1, k2, k3)`; stiffness ratio ~1e11 at the standard constants."""
    k1, k2, k3 = k[0], k[1], k[2]
    return jnp.stack(
        [
            -k1 * y[0] + k3 * y[1] * y[2],
            k1 * y[0] - k2 * y[1] ** 2 - k3 * y[1] * y[2],
            k2 * y[1] ** 2,
        ]
    )


def robertson_jacobian(t, y, k):
    k1, k2, k3 = k[0], k[1], k[2]
    return jnp.array(
        [
            [-k1, k3 * y[2], k3 * y[1]],
            [k1, -2 * k2 * y[1] - k3 * y[2], -k3 * y[1]],
            [0.0 * k1, 2 * k2 * y[1], 0.0 * k1],
        ]
    )


ROBERTSON = dict(
    f=robertson,
    jac=robertson_jacobian,
    y0=np.array([1.0, 0.0, 0.0]),
    args=np.array([0.04, 3e7, 1e4]),
)


def van_der_pol_jacobian(t, y, mu):
    return jnp.array([[0.0, 1.0], [-2 * mu * y[0] * y[1] - 1, mu * (1 - y[0] ** 2)]])


STIFF_VAN_DER_POL = dict(
    f=van_der_pol, jac=van_der_pol_jacobian, y0=np.array([2.0, 0.0]), args=1000.0
)


def e5(t, y, k):
    """The E5 pyrolysis problem (Hairer & Wanner's stiff DETEST problem E5; problem E5 of the
    Bari test set for IVP solvers): four species, rate constants `k = (A, B, CM, C)`, over
    `[0, 1e13]`. Each flux is computed once and added to one species and subtracted from
    another, as the test set's Fortran `feval` does, so `f` keeps the conservation law
    `y2 - y3 - y4 = 0` in floating point. (Written out species by species, `f` breaks it by
    rounding the fluxes, about `1e-7` while the species are `1e-10`; the leak reaches `1e-20`
    by `t = 1e5`, and at `t = 1e13`, where `y2 = y3 ~ 9e-23`, no float64 integrator then gets
    `y2` or `y3` within a factor 10: scipy's Radau, BDF and LSODA at `rtol=1e-12` neither.)
    The optimization barrier keeps XLA from recomputing a shared flux inside two different
    fused multiply-adds (openxla/xla#41579), which breaks the law the same way."""
    a, b, cm, c = k[0], k[1], k[2], k[3]
    prod1, prod2 = a * y[0], b * y[0] * y[2]
    f2, f4 = prod1 - cm * y[1] * y[2], prod2 - c * y[3]
    prod1, prod2, f2, f4 = jax.lax.optimization_barrier((prod1, prod2, f2, f4))
    return jnp.stack([-prod1 - prod2, f2, f2 - f4, f4])


E5 = dict(
    f=e5, y0=np.array([1.76e-3, 0.0, 0.0, 0.0]), args=np.array([7.89e-10, 1.1e7, 1.13e9, 1.13e3])
)


def e5_reference(t1: float, method: str) -> np.ndarray:
    """E5 at `t1` from `scipy.integrate.solve_ivp(method=method, rtol=1e-12, atol=1e-40)`,
    solved with `y2 = y3 + y4` substituted: the conservation law holds exactly, so rounding
    cannot break it (the test set's own reference, computed in extended precision, breaks it
    by 1.3e-25 and so has `y2` and `y3` 7e-4 apart, each off by half that)."""
    a, b, cm, c = E5["args"]

    def reduced(t, u):
        y1, y3, y4 = u
        y2 = y3 + y4
        return [
            -a * y1 - b * y1 * y3,
            a * y1 - b * y1 * y3 - cm * y2 * y3 + c * y4,
            b * y1 * y3 - c * y4,
        ]

    def jacobian(t, u):
        y1, y3, y4 = u
        y2 = y3 + y4
        return [
            [-a - b * y3, -b * y1, 0.0],
            [a - b * y3, -b * y1 - cm * (y2 + y3), c - cm * y3],
            [b * y3, b * y1, -c],
        ]

    result = solve_ivp(reduced, (0.0, t1), [E5["y0"][0], 0.0, 0.0], method=method, rtol=1e-12,
                       atol=1e-40, jac=jacobian)  # fmt: skip
    assert result.success
    y1, y3, y4 = result.y[:, -1]
    return np.array([y1, y3 + y4, y3, y4])


# `radau_reference(problem, t1)` at the published tolerances, stored because the Van der Pol
# reference takes ~10 s; `test_implicit.py::test_stored_references` (slow) recomputes them.
STIFF_REFERENCES = {
    ("robertson", 1e5): np.array(
        [1.786592114216766e-02, 7.274751468464571e-08, 9.821340061103163e-01]
    ),
    ("robertson", 1e11): np.array(
        [2.083340155271562e-08, 8.333360792615899e-14, 9.999999791665098e-01]
    ),
    ("van_der_pol", 3000.0): np.array([-1.5106069367441031e00, 1.1783800007309291e-03]),
}
# `e5_reference(1e13, method)` for method in ("Radau", "BDF", "LSODA") agree to 1e-10 in y2 and
# y3: 8.86123352129e-23, 8.86123352209e-23, 8.86123352191e-23; y1 (about 1e-3430 exactly) and
# y4 are far below any tolerance. `test_implicit.py::test_e5_reference` (slow) recomputes them.
E5_REFERENCE = np.array([0.0, 8.861233522e-23, 8.861233522e-23, 0.0])


def scaled_van_der_pol(t, y, eps):
    """Van der Pol in the test set's scaling (problem VDPOL of the Bari test set for IVP
    solvers): `mu = 1000` with time in units of `mu`, `eps = 1 / mu^2`."""
    return jnp.stack([y[1], ((1 - y[0] ** 2) * y[1] - y[0]) / eps])


VDPOL = dict(f=scaled_van_der_pol, y0=np.array([2.0, 0.0]), args=np.array(1e-6), t1=2.0)
ROBER = dict(f=robertson, y0=ROBERTSON["y0"], args=ROBERTSON["args"], t1=1e11)
# The test set's published references (F. Mazzia & F. Iavernaro, Test Set for IVP Solvers,
# Univ. Bari, release 2.4: problems VDPOL at t = 2 and ROBER at t = 1e11, computed in extended
# precision).
TEST_SET_REFERENCES = {
    "vdpol": np.array([1.706167732170469, -0.8928097010248125]),
    "rober": np.array([0.2083340149701255e-07, 0.8333360770334713e-13, 0.9999999791665050]),
}


def radau_reference(problem: dict, t1: float) -> np.ndarray:
    """`scipy.integrate.solve_ivp(method="Radau", rtol=1e-12, atol=1e-14)` at `t1`, with the
    problem's analytic Jacobian."""
    f, jac, args = jax.jit(problem["f"]), jax.jit(problem["jac"]), problem["args"]
    result = solve_ivp(
        lambda t, y: np.asarray(f(t, jnp.asarray(y), args)),
        (0.0, t1),
        problem["y0"],
        method="Radau",
        rtol=1e-12,
        atol=1e-14,
        jac=lambda t, y: np.asarray(jac(t, jnp.asarray(y), args)),
    )
    assert result.success
    return result.y[:, -1]


def sensitivity_reference(
    f, y0: np.ndarray, log_p: np.ndarray, t1: float, rtol: float = 1e-12, atol: float = 1e-14
) -> np.ndarray:
    """`d y(t1) / d log p` (shape `(n, m)`) for `f(t, y, p)`, `p = exp(log_p)`, by scipy's Radau
    on the state and its forward sensitivities `S' = J S + df/dlog p` (with the analytic
    Jacobian of the whole system from JAX) at `rtol`, `atol` (for the sensitivities
    `atol / 1e-4` with `atol` the state's: the absolute size of `S` is that of `y` times the
    orders of magnitude of `log p`'s effect, well above the state's own `atol` in chemistry)."""
    n, m = len(y0), len(log_p)

    def system(t, z):
        y, s = z[:n], z[n:].reshape(n, m)
        field = lambda y, log_p: f(t, y, jnp.exp(log_p))
        jy, jp = jax.jacfwd(field, argnums=(0, 1))(y, jnp.asarray(log_p))
        return jnp.concatenate([field(y, jnp.asarray(log_p)), (jy @ s + jp).ravel()])

    rhs = jax.jit(system)
    jac = jax.jit(jax.jacfwd(system, argnums=1))
    z0 = np.concatenate([np.asarray(y0, float), np.zeros(n * m)])
    tolerances = np.concatenate([np.full(n, atol), np.full(n * m, atol * 1e4)])
    result = solve_ivp(
        lambda t, z: np.asarray(rhs(t, jnp.asarray(z))), (0.0, t1), z0, method="Radau",
        rtol=rtol, atol=tolerances, jac=lambda t, z: np.asarray(jac(t, jnp.asarray(z))),
    )  # fmt: skip
    assert result.success, result.message
    return result.y[n:, -1].reshape(n, m)


def central_differences(fn, x, eps: float = 1e-5):
    """Central finite differences of the scalar `fn` at the pytree of float arrays `x`, shaped
    like `x`."""
    flat, unravel = jax.flatten_util.ravel_pytree(x)
    out = []
    for i in range(flat.size):
        e = jnp.zeros_like(flat).at[i].set(eps)
        out.append((fn(unravel(flat + e)) - fn(unravel(flat - e))) / (2 * eps))
    return unravel(jnp.stack(out))
