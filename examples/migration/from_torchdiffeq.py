"""A torchdiffeq solve and gradient (in the comments below; PyTorch is not needed) and its odeckpt
port, checked against the exact solution of a linear ODE.

Run: python examples/migration/from_torchdiffeq.py
(under a minute on 2 CPU cores, most of it compiling; float64).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import expm

import odeckpt

jax.config.update("jax_enable_x64", True)

# The torchdiffeq original:
# import torch
# from torchdiffeq import odeint
#
# A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]], requires_grad=True)
# f = lambda t, y: y @ A.T
# y0 = torch.tensor([2.0, 0.0])
# t = torch.linspace(0.0, 5.0, 50)
# ys = odeint(f, y0, t, rtol=1e-7, atol=1e-9, method="dopri5")  # ys[0] is y0
# ys.pow(2).sum().backward()  # A.grad

# The port: the parameters travel in `args`; `jax.grad` replaces `.backward()`.
A = jnp.array([[-0.1, 2.0], [-2.0, -0.1]])
y0 = jnp.array([2.0, 0.0])
t = jnp.linspace(0.0, 5.0, 50)


def f(t, y, A):  # odeckpt passes args; the parameters are an argument, not a closure
    return A @ y


def loss(A):
    sol = odeckpt.solve(f, y0, (t[0], t[-1]), A, saveat=t, solver="dopri5", rtol=1e-7,
                        atol=1e-9)  # fmt: skip
    return jnp.sum(sol.ys**2)  # sol.ys[0] is y0, as in torchdiffeq


grad = jax.grad(loss)(A)

# The check: the exact solution of this linear ODE is expm(t A) y0.
exact = lambda A: jnp.sum(jax.vmap(lambda s: expm(s * A) @ y0)(t) ** 2)
error = abs(float(loss(A)) - float(exact(A))) / float(exact(A))
grad_error = float(jnp.max(jnp.abs(grad - jax.grad(exact)(A))) / jnp.max(jnp.abs(grad)))
print(f"loss relative error {error:.1e}, gradient relative error {grad_error:.1e}")
assert error < 1e-6 and grad_error < 1e-5
assert np.all(np.isfinite(grad))
