"""Test problems shared by the test files (vector fields in odeckpt's `f(t, y, args)` form)."""

import jax
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
