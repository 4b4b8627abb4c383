"""The fused kernel's evaluation of a jaxpr on lane vectors (`odeckpt._fused._lanes`), outside
any kernel: each operation a vector field may use gives, lane by lane, what `jax.vmap` gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from odeckpt._fused import Unsupported
from odeckpt._fused._lanes import evaluate_with, lanes_of

LANES = 5
MATRIX = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [0.0, 1.0, 1.0]])


def _on_lanes(function, t, ys, args):
    """`function(t, y, args)` for every lane (rows of `ys` and `args`) by the lane evaluation:
    `t` uniform, each element of `y` and `args` a lane vector."""
    closed = jax.make_jaxpr(function)(t, ys[0], args[0])

    def per_lane(x):
        out = np.empty(x.shape[1:], dtype=object)
        for i in range(x.shape[1]):
            out[i] = jnp.asarray(x[:, i])
        return out

    inputs = [lanes_of(np.asarray(t)), per_lane(ys), per_lane(args)]
    consts = [lanes_of(c) for c in closed.consts]
    outs = evaluate_with(closed, consts, inputs, LANES)
    stacked = []
    for out in outs:
        rows = [jnp.broadcast_to(e, (LANES,)) for e in out.reshape(-1)]
        stacked.append(jnp.stack(rows, axis=-1).reshape((LANES, *out.shape)))
    return stacked


FIELDS = {
    "elementwise": lambda t, y, a: jnp.where(y > 0, jnp.exp(-a * y), jnp.tanh(y)) * jnp.sin(t),
    "clip and powers": lambda t, y, a: jnp.clip(y, -0.5, 0.5) ** 2 + jnp.abs(a) ** 1.5,
    "reductions": lambda t, y, a: y * jnp.sum(a) - jnp.max(y) + jnp.linalg.norm(a),
    "moves": lambda t, y, a: jnp.concatenate([y[::-1][:2], jnp.roll(a, 1)[:1]]),
    "matrix products": lambda t, y, a: MATRIX @ y + jnp.einsum("i,j->i", a, y) * t,
    "cond on t": lambda t, y, a: jax.lax.cond(t > 0.5, lambda: y * a, lambda: y - a),
    "cond per lane": lambda t, y, a: jax.lax.cond(y[0] > 0, lambda: y * a, lambda: y - a),
    "split and cumsum": lambda t, y, a: jnp.cumsum(jnp.concatenate(jnp.split(y * a, [1]))),
    "argmax and argmin": lambda t, y, a: y * (jnp.argmax(y) - jnp.argmin(a)),
    "index by a lane's number": lambda t, y, a: y + a[jnp.argmax(a)],
    "dynamic slice per lane": lambda t, y, a: (
        y + jnp.sum(jax.lax.dynamic_slice(a, (jnp.argmin(y),), (2,)))
    ),
    "scatter": lambda t, y, a: y.at[1].set(a[0]).at[jnp.array([0, 0, 2])].add(a),
    "fori loop": lambda t, y, a: jax.lax.fori_loop(0, 3, lambda i, x: 0.5 * x + a * i, y),
}


@pytest.mark.parametrize("name", FIELDS)
def test_each_operation_on_lanes_equals_vmap(name):
    field = FIELDS[name]
    rng = np.random.default_rng(0)
    ys, args = rng.normal(size=(LANES, 3)), rng.normal(size=(LANES, 3))
    (ours,) = _on_lanes(field, 0.7, ys, args)
    expected = jax.vmap(field, in_axes=(None, 0, 0))(0.7, ys, args)
    np.testing.assert_allclose(ours, expected, rtol=1e-14, atol=1e-14)


def test_an_operation_without_a_lane_form_is_named():
    with pytest.raises(Unsupported, match="`sort`.*backend='vmap'"):
        _on_lanes(lambda t, y, a: jnp.sort(y * a), 0.0, np.ones((LANES, 3)), np.ones((LANES, 3)))
