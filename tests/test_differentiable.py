"""`odeckpt._autodiff.differentiable` (the rule of the checkpointing engine and the adjoints):
one rule for forward and reverse mode, and calls that are differentiable in reverse mode only."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odeckpt._autodiff import Sweeps, differentiable


class Args(NamedTuple):
    x: jax.Array
    k: jax.Array


def _primal(args: Args):
    return jnp.sin(args.x) * args.k


def _sweeps() -> Sweeps:
    def forward(args):
        return _primal(args), args

    def reverse(args, saved, ct, want):
        x, k = saved
        return Args(jnp.cos(x) * k * ct if want.x else None, jnp.sum(jnp.sin(x) * ct))

    return Sweeps(forward, reverse)


def _call(x, k, **kwargs):
    return jnp.sum(differentiable(_primal, _sweeps, Args(x, k), **kwargs))


X, K = jnp.linspace(0.1, 1.0, 4), jnp.asarray(1.7)
EXACT = (jnp.cos(X) * K, jnp.sum(jnp.sin(X)))


@pytest.mark.parametrize("forward_error", [None, "reverse mode only: use jax.grad"])
def test_reverse_mode_follows_the_reverse_sweep(forward_error):
    grad = jax.grad(_call, argnums=(0, 1))
    for g in (
        grad(X, K, forward_error=forward_error),
        jax.jit(grad, static_argnames="forward_error")(X, K, forward_error=forward_error),
    ):
        np.testing.assert_allclose(g[0], EXACT[0], rtol=1e-12)
        np.testing.assert_allclose(g[1], EXACT[1], rtol=1e-12)
    batched = jax.vmap(grad, in_axes=(0, None))(jnp.stack([X, 2 * X]), K)
    np.testing.assert_allclose(batched[0][1], jnp.cos(2 * X) * K, rtol=1e-12)


def test_forward_mode_is_the_jvp_of_the_primal():
    _, tangent = jax.jvp(lambda x: _call(x, K), (X,), (jnp.ones(4),))
    np.testing.assert_allclose(tangent, jnp.sum(jnp.cos(X) * K), rtol=1e-12)


def test_forward_mode_raises_when_reverse_only():
    message = "reverse mode only: use jax.grad"
    f = lambda x: _call(x, K, forward_error=message)
    with pytest.raises(TypeError, match=message):
        jax.jvp(f, (X,), (jnp.ones(4),))
    with pytest.raises(TypeError, match=message):
        jax.jit(jax.jacfwd(f))(X)
