"""scipy's `solve_ivp` on Robertson's stiff chemistry, and its odeckpt port: the same solution.

Run: python examples/migration/from_scipy.py
(under a minute on 2 CPU cores, most of it compiling; float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
from scipy.integrate import solve_ivp

import odeckpt

jax.config.update("jax_enable_x64", True)

t_eval = np.logspace(-4, 4, 9)
y0 = [1.0, 0.0, 0.0]
atol = [1e-8, 1e-12, 1e-8]  # per component: y2 stays below 4e-5


# The scipy original: Radau, with an `atol` per component.
def robertson(t, y, k1, k2, k3):
    y1, y2, y3 = y
    return np.array([
        -k1 * y1 + k3 * y2 * y3,
        k1 * y1 - k3 * y2 * y3 - k2 * y2**2,
        k2 * y2**2,
    ])  # fmt: skip


scipy_sol = solve_ivp(robertson, (0.0, 1e4), y0, method="Radau", t_eval=t_eval,
                      rtol=1e-6, atol=atol, args=(0.04, 3e7, 1e4))  # fmt: skip
scipy_ys = scipy_sol.y.T  # scipy's y is (components, times)


# The port: f(t, y, args) builds a jnp array; "Radau" is odeckpt's Radau5; the solution comes
# times first.
def robertson_jax(t, y, args):
    k1, k2, k3 = args
    y1, y2, y3 = y
    return jnp.stack([
        -k1 * y1 + k3 * y2 * y3,
        k1 * y1 - k3 * y2 * y3 - k2 * y2**2,
        k2 * y2**2,
    ])  # fmt: skip


sol = odeckpt.solve(robertson_jax, jnp.array(y0), (0.0, 1e4), (0.04, 3e7, 1e4),
                    solver="radau", saveat=jnp.asarray(t_eval), rtol=1e-6,
                    atol=jnp.array(atol), max_steps=10_000)  # fmt: skip
odeckpt_ys = sol.ys  # (times, components)

relative = np.abs(odeckpt_ys - scipy_ys) / (np.abs(scipy_ys) + np.array(atol))
steps, nfev = int(sol.stats["num_steps"]), int(sol.stats["nfev"])
print(f"scipy {scipy_sol.nfev} f evaluations; odeckpt {steps} steps, {nfev} f evaluations")
print(f"largest difference relative to the solution (plus atol): {relative.max():.1e}")
assert relative.max() < 1e-3
