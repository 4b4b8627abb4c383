"""Accuracy and time of d sum(y(1000)^2) / d log mu on Van der Pol (mu = 1000, x(0) = 2,
v(0) = 0; issue 20): odeckpt's default recursive gradient, ForwardSensitivity (Kvaerno5,
Rodas5, Radau5) and InterpolatingAdjoint (Radau5) against scipy's Radau forward sensitivities
at rtol 1e-12, with scipy at rtol 1e-6 and diffrax Kvaerno5 as peers.

Run: `PYTHONPATH=. python benchmarks/van_der_pol_sensitivity.py`
"""

import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "tests")
sys.path.insert(0, "benchmarks")
jax.config.update("jax_enable_x64", True)

from _harness import environment, stamp_markdown  # noqa: E402
from test_sensitivity import _van_der_pol_reference  # noqa: E402

import odeckpt  # noqa: E402

LOG_MU = jnp.log(1000.0)


def field(t, y, mu):
    return jnp.stack([y[1], mu * (1 - y[0] ** 2) * y[1] - y[0]])


def odeckpt_loss(adjoint, rtol, solver):
    def loss(log_mu):
        sol = odeckpt.solve(
            field, jnp.array([2.0, 0.0]), (0.0, 1000.0), args=jnp.exp(log_mu), solver=solver,
            rtol=rtol, atol=1e-10, adjoint=adjoint, max_steps=100_000,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


def diffrax_loss(rtol):
    import diffrax

    def loss(log_mu):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(field), diffrax.Kvaerno5(), 0.0, 1000.0, None,
            jnp.array([2.0, 0.0]), args=jnp.exp(log_mu),
            stepsize_controller=diffrax.PIDController(rtol=rtol, atol=1e-10),
            max_steps=100_000,
        )  # fmt: skip
        return jnp.sum(sol.ys[-1] ** 2)

    return loss


def timed(fn):
    jitted = jax.jit(fn)
    value = float(jitted(LOG_MU))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(jitted(LOG_MU))
        times.append(time.perf_counter() - start)
    return value, statistics.median(times)


def scipy_radau(rtol):
    from scipy.integrate import solve_ivp

    mu = 1000.0

    def rhs(t, z):
        x, v, sx, sv = z
        return [v, mu * (1 - x * x) * v - x, sv,
                (-2 * mu * x * v - 1) * sx + mu * (1 - x * x) * (sv + v)]  # fmt: skip

    start = time.perf_counter()
    sol = solve_ivp(rhs, (0, 1000), [2, 0, 0, 0], "Radau", rtol=rtol, atol=1e-10)
    x, v, sx, sv = sol.y[:, -1]
    return 2 * (x * sx + v * sv), time.perf_counter() - start


def main():
    reference = _van_der_pol_reference()
    digits = lambda v: -math.log10(abs(v - reference) / abs(reference))
    fs = odeckpt.ForwardSensitivity()
    recursive = timed(jax.grad(odeckpt_loss("recursive", 1e-6, "kvaerno5")))
    cases = [
        ("odeckpt recursive (default), grad", 1e-6, recursive),
        ("odeckpt forward_sensitivity, grad", 1e-6,
         timed(jax.grad(odeckpt_loss(fs, 1e-6, "kvaerno5")))),
        ("odeckpt forward_sensitivity, jvp", 1e-6, timed(
            lambda x: jax.jvp(odeckpt_loss(fs, 1e-6, "kvaerno5"), (x,), (1.0,))[1])),
        ("odeckpt forward_sensitivity(rtol=1e-8), grad", 1e-6, timed(jax.grad(
            odeckpt_loss(odeckpt.ForwardSensitivity(rtol=1e-8), 1e-6, "kvaerno5")))),
        ("odeckpt forward_sensitivity, Rodas5, grad", 1e-8,
         timed(jax.grad(odeckpt_loss(fs, 1e-8, "rodas5")))),
        ("odeckpt recursive, Radau5, grad", 1e-6,
         timed(jax.grad(odeckpt_loss("recursive", 1e-6, "radau")))),
        ("odeckpt forward_sensitivity, Radau5, grad", 1e-6,
         timed(jax.grad(odeckpt_loss(fs, 1e-6, "radau")))),
        ("odeckpt forward_sensitivity(rtol=1e-7), Radau5, grad", 1e-6, timed(jax.grad(
            odeckpt_loss(odeckpt.ForwardSensitivity(rtol=1e-7), 1e-6, "radau")))),
        ("odeckpt interpolating, Radau5, grad", 1e-6, timed(jax.grad(
            odeckpt_loss(odeckpt.InterpolatingAdjoint(), 1e-6, "radau")))),
        ("odeckpt interpolating(rtol=1e-8, atol=1e-12), Radau5, grad", 1e-6, timed(jax.grad(
            odeckpt_loss(odeckpt.InterpolatingAdjoint(rtol=1e-8, atol=1e-12), 1e-6, "radau")))),
        ("scipy Radau, state and sensitivity", 1e-6, scipy_radau(1e-6)),
    ]  # fmt: skip
    try:
        cases.append(("diffrax Kvaerno5, grad", 1e-6, timed(jax.grad(diffrax_loss(1e-6)))))
    except ImportError:
        pass
    print(stamp_markdown(environment()))
    print(f"\nreference {reference:.8f}\n")
    print("| method | rtol | d/dlog mu | correct digits | time (s) | time / recursive |")
    print("|---|---|---|---|---|---|")
    for name, rtol, (value, seconds) in cases:
        ratio = seconds / recursive[1]
        print(f"| {name} | {rtol:g} | {value:.4f} | {digits(value):.1f} | {seconds:.4f} | "
              f"{ratio:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
