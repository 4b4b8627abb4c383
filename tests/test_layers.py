"""`checkpoint_layers` and `checkpointed_layers` against the uncheckpointed model (float64,
tolerance 1e-12): MLP stacks, dropout, batch norm with state, and (with `-m slow`)
transformer-style blocks with dropout."""

from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import lax

from odeckpt.checkpointing import checkpoint_layers, checkpointed_layers, checkpointed_scan
from odeckpt.checkpointing._checkpoint_layers import Checkpointed, CheckpointedSequential
from odeckpt.checkpointing._stacking import repeated_runs


class MLPBlock(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width, hidden, key, dtype=jnp.float64):
        k1, k2 = jr.split(key)
        self.up = eqx.nn.Linear(width, hidden, key=k1, dtype=dtype)
        self.down = eqx.nn.Linear(hidden, width, key=k2, dtype=dtype)

    def __call__(self, x, *, key=None):
        """`x`: a batch `[b, width]`."""
        return x + jax.vmap(lambda v: self.down(jnp.tanh(self.up(v))))(x)


class TransformerBlock(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __init__(self, key, dim=8, heads=2):
        k1, k2 = jr.split(key)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, dropout_p=0.2, key=k1)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 2 * dim, 1, activation=jax.nn.gelu, key=k2)
        self.dropout = eqx.nn.Dropout(0.3)

    def __call__(self, x, *, key):
        """`x`: a sequence `[tokens, dim]`; training mode (dropout on)."""
        k1, k2 = jr.split(key)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, key=k1)
        h = jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return x + self.dropout(h, key=k2)


class BatchNormBlock(eqx.nn.StatefulLayer):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key, width=4):
        self.linear = eqx.nn.Linear(width, width, key=key)
        self.norm = eqx.nn.BatchNorm(width, axis_name="batch", mode="batch")

    def __call__(self, x, state, *, key=None):
        """One example `x` under `jax.vmap(..., axis_name="batch")`."""
        x, state = self.norm(jnp.tanh(self.linear(x)), state)
        return x, state


class BlockList(eqx.Module):
    """A model whose own code loops over its blocks, with one key per block."""

    blocks: list

    def __call__(self, x, *, key):
        for block, k in zip(self.blocks, jr.split(key, len(self.blocks)), strict=True):
            x = block(x, key=k)
        return x


def _assert_close(a, b, tol=1e-12):
    a_leaves, b_leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a_leaves) == len(b_leaves) > 0
    for u, v in zip(a_leaves, b_leaves, strict=True):
        scale = max(1.0, float(jnp.max(jnp.abs(v))))
        np.testing.assert_allclose(u, v, rtol=0, atol=tol * scale)


def _array_grad(loss, model):
    """`grad(params, x)`, a function of the arrays (or `ShapeDtypeStruct`s) of `model` only,
    and those arrays."""
    is_array = lambda a: eqx.is_array(a) or isinstance(a, jax.ShapeDtypeStruct)
    params, static = eqx.partition(model, is_array)
    return jax.grad(lambda p, x: loss(eqx.combine(p, static), x)), params


def _primitives(loss, model, x) -> list[str]:
    """The primitives at the top level of the traced `loss(model, x)`."""
    params, static = eqx.partition(model, eqx.is_array)
    jaxpr = jax.make_jaxpr(lambda p, x: loss(eqx.combine(p, static), x))(params, x)
    return [eqn.primitive.name for eqn in jaxpr.eqns]


def _count_remat(names) -> int:
    return sum(name in ("checkpoint", "remat", "remat2") for name in names)


def _grads(loss, model, *args):
    """Gradients with respect to the arrays of `model`, in the structure of `model`."""
    return eqx.filter_jit(eqx.filter_grad(loss))(model, *args)


def _mlp_blocks(depth, width=4, hidden=6, seed=0):
    return [MLPBlock(width, hidden, k) for k in jr.split(jr.key(seed), depth)]


# Stacks of MLP blocks by default: test_stacks_repeated_units_and_falls_back_for_the_rest,
# test_forward_mode_and_gradients_on_the_original_leaves and test_policy_passes_through.
@pytest.mark.slow
def test_mlp_sequential_gradients_equal():
    first = eqx.nn.Linear(3, 4, key=jr.key(1))
    last = eqx.nn.Linear(4, 2, key=jr.key(2))
    batched = lambda layer: eqx.nn.Lambda(eqx.filter_vmap(layer))
    layers = [batched(first), *_mlp_blocks(6), batched(last)]
    model = eqx.nn.Sequential(layers)
    x = jr.normal(jr.key(3), (5, 3))
    loss = lambda m, x: jnp.sum(jnp.sin(m(x)))
    ckpt = lambda m, x: loss(checkpoint_layers(m), x)
    _assert_close(_grads(ckpt, model, x), _grads(loss, model, x))


def test_same_leaves_and_attribute_paths():
    model = eqx.nn.Sequential(_mlp_blocks(3))
    ckpt = checkpoint_layers(model)
    assert isinstance(ckpt, CheckpointedSequential)
    assert all(a is b for a, b in zip(jax.tree.leaves(ckpt), jax.tree.leaves(model), strict=True))
    assert ckpt[1].up.weight is model[1].up.weight and len(ckpt) == 3


def test_stacks_repeated_units_and_falls_back_for_the_rest():
    unit = lambda k: [eqx.nn.Linear(4, 4, key=k), eqx.nn.Lambda(jnp.tanh)]
    layers = [eqx.nn.Linear(3, 4, key=jr.key(9))]
    layers += [layer for k in jr.split(jr.key(0), 5) for layer in unit(k)]
    model = eqx.nn.Sequential(layers)
    loss = lambda m, x: jnp.sum(checkpoint_layers(m)(x) ** 2)
    names = _primitives(loss, model, jnp.ones(3))
    # The 5 (Linear, tanh) repeats run in one indexed scan (a custom_jvp around lax.scan); the
    # first Linear is checkpointed alone.
    assert names.count("custom_jvp_call") == 1 and _count_remat(names) == 1, names
    ref = lambda m, x: jnp.sum(m(x) ** 2)
    _assert_close(_grads(loss, model, jnp.ones(3)), _grads(ref, model, jnp.ones(3)))


def test_repeated_runs_by_hand():
    assert repeated_runs("abbbc") == [(0, 1, 1), (1, 1, 3), (4, 1, 1)]
    assert repeated_runs("xabababy") == [(0, 1, 1), (1, 2, 3), (7, 1, 1)]
    assert repeated_runs("abcabcab") == [(0, 3, 2), (6, 1, 1), (7, 1, 1)]
    assert repeated_runs("aaaa") == [(0, 1, 4)]
    assert repeated_runs("abcd") == [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]


def test_forward_mode_and_gradients_on_the_original_leaves():
    model = eqx.nn.Sequential(_mlp_blocks(5))
    x = jr.normal(jr.key(1), (3, 4))
    params, static = eqx.partition(model, eqx.is_array)
    tangent = jax.tree.map(lambda a: jnp.cos(a.sum()) * jnp.ones_like(a), params)
    apply = lambda p, wrap: wrap(eqx.combine(p, static))(x)
    jvp = lambda wrap: jax.jvp(lambda p: apply(p, wrap), (params,), (tangent,))
    _assert_close(jvp(checkpoint_layers), jvp(lambda m: m))
    # Frozen parameters (closed over, not differentiated) and an input gradient only.
    grad_x = lambda wrap: jax.grad(lambda x: jnp.sum(jnp.sin(wrap(model)(x))))(x)
    _assert_close(grad_x(checkpoint_layers), grad_x(lambda m: m))


@pytest.mark.slow
def test_second_order():
    model = eqx.nn.Sequential(_mlp_blocks(4))
    x, v = jr.normal(jr.key(1), (3, 4)), jr.normal(jr.key(2), (3, 4))
    params, static = eqx.partition(model, eqx.is_array)
    loss = lambda wrap, p, x: jnp.sum(jnp.sin(wrap(eqx.combine(p, static))(x)))
    grad = lambda wrap, x: jax.grad(partial(loss, wrap))(params, x)
    # reverse over reverse (a gradient penalty), forward over reverse (a Hessian-vector
    # product), forward over forward
    penalty = lambda wrap: jax.grad(lambda x: jnp.sum(grad(wrap, x).layers[1].up.weight ** 2))(x)
    hvp = lambda wrap: jax.jvp(partial(grad, wrap), (x,), (v,))[1]
    jvp = lambda wrap, x: jax.jvp(lambda x: loss(wrap, params, x), (x,), (v,))[1]
    jvp2 = lambda wrap: jax.jvp(partial(jvp, wrap), (x,), (v,))[1]
    for second in (penalty, hvp, jvp2):
        _assert_close(second(checkpoint_layers), second(lambda m: m))
    # checkpointed_layers: not reverse over reverse (its reverse sweep is a lax.while_loop).
    stacked = lambda m: lambda x: checkpointed_layers(_stack_like(m.layers), x, checkpoints=2)
    for second in (hvp, jvp2):
        _assert_close(second(stacked), second(lambda m: m))


def test_heterogeneous_layers_checkpointed_one_by_one():
    sizes = [3, 5, 4, 6, 2]
    keys = jr.split(jr.key(0), len(sizes) - 1)
    layers = [
        eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
    ]
    model = eqx.nn.Sequential(layers)
    loss = lambda m, x: jnp.sum(jnp.tanh(checkpoint_layers(m)(x)))
    names = _primitives(loss, model, jnp.ones(3))
    assert "custom_jvp_call" not in names and _count_remat(names) == len(layers), names
    ref = lambda m, x: jnp.sum(jnp.tanh(m(x)))
    _assert_close(_grads(loss, model, jnp.ones(3)), _grads(ref, model, jnp.ones(3)))


def _transformer_loss(model, x, key):
    return jnp.sum(jnp.tanh(model(x, key=key)))


def _check_transformer(make_model):
    blocks = [TransformerBlock(k) for k in jr.split(jr.key(0), 2)]
    x, key = jr.normal(jr.key(1), (5, 8)), jr.key(2)
    # Dropout is on: another key changes the output.
    assert not jnp.allclose(BlockList(blocks)(x, key=key), BlockList(blocks)(x, key=jr.key(3)))
    model = make_model(blocks)
    ckpt = lambda m, x, key: _transformer_loss(checkpoint_layers(m), x, key)
    _assert_close(_grads(ckpt, model, x, key), _grads(_transformer_loss, model, x, key))


# Dropout keys by default: test_checkpointed_layers_from_a_list_with_dropout_keys.
@pytest.mark.slow
def test_transformer_blocks_with_dropout_gradients_equal():
    _check_transformer(eqx.nn.Sequential)  # stacked, under lax.scan


@pytest.mark.slow
def test_transformer_block_list_with_dropout_gradients_equal():
    _check_transformer(BlockList)  # a loop in the model's code: per-layer jax.checkpoint


@pytest.mark.slow
def test_transformer_checkpointed_layers_with_keys():
    stacked = eqx.filter_vmap(TransformerBlock)(jr.split(jr.key(0), 4))
    blocks = [
        jax.tree.map(lambda a, i=i: a[i] if eqx.is_array(a) else a, stacked) for i in range(4)
    ]
    x, key = jr.normal(jr.key(1), (5, 8)), jr.key(2)
    got = lambda m, x, key: jnp.sum(jnp.tanh(checkpointed_layers(m, x, key=key, checkpoints=2)))
    # eqx.nn.Sequential splits the key as checkpointed_layers does.
    want = _grads(_transformer_loss, eqx.nn.Sequential(blocks), x, key)
    _assert_close(_grads(got, stacked, x, key), _stack_like(want.layers))


class DropoutBlock(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear, self.dropout = eqx.nn.Linear(3, 3, key=key), eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key):
        return self.dropout(jnp.tanh(self.linear(x)), key=key)


def test_checkpointed_layers_from_a_list_with_dropout_keys():
    layers = [DropoutBlock(k) for k in jr.split(jr.key(0), 5)]
    got = lambda m, x, key: jnp.sum(checkpointed_layers(m, x, key=key, checkpoints=2) ** 3)
    # eqx.nn.Sequential splits the key as checkpointed_layers does.
    want = lambda m, x, key: jnp.sum(eqx.nn.Sequential(m)(x, key=key) ** 3)
    x, key = jnp.ones(3), jr.key(1)
    assert not jnp.allclose(want(layers, x, key), want(layers, x, jr.key(2)))
    _assert_close(_grads(got, layers, x, key), _grads(want, layers, x, key))


def _index(stacked, i):
    """Layer (or state) `i` of a stack."""
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, stacked)


def _stack_like(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *[eqx.filter(t, eqx.is_array) for t in trees])


def _batch_norm_run(model, state, x):
    run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    y, state = run(x, state)
    return jnp.sum(y**3), state


def test_batch_norm_gradients_and_state_equal():
    make = lambda: eqx.nn.Sequential([BatchNormBlock(k) for k in jr.split(jr.key(0), 4)])
    model, state = eqx.nn.make_with_state(make)()
    x = jr.normal(jr.key(1), (6, 4))
    ref_grads, ref_state = eqx.filter_jit(eqx.filter_grad(_batch_norm_run, has_aux=True))(
        model, state, x
    )
    ckpt = lambda m, s, x: _batch_norm_run(checkpoint_layers(m), s, x)
    grads, new_state = eqx.filter_jit(eqx.filter_grad(ckpt, has_aux=True))(model, state, x)
    _assert_close(grads, ref_grads)
    _assert_close(new_state, ref_state)
    assert not jnp.allclose(jax.tree.leaves(ref_state)[0], jax.tree.leaves(state)[0])


class RunningMean(eqx.Module):
    """A batch-level stateful layer: centres by the batch mean, keeps its running average."""

    linear: eqx.nn.Linear
    index: eqx.nn.StateIndex

    def __init__(self, key, width=4):
        self.linear = eqx.nn.Linear(width, width, key=key)
        self.index = eqx.nn.StateIndex(jnp.zeros(width))

    def __call__(self, x, state, *, key=None):
        h = jnp.tanh(jax.vmap(self.linear)(x))
        mean = jnp.mean(h, axis=0, keepdims=True)
        state = state.set(self.index, 0.9 * state.get(self.index) + 0.1 * mean[0])
        return h - mean, state


@pytest.mark.slow
def test_checkpointed_layers_with_state():
    make = lambda k: eqx.nn.make_with_state(RunningMean)(k)
    stacked, state = eqx.filter_vmap(make)(jr.split(jr.key(0), 7))
    x = jr.normal(jr.key(1), (6, 4))

    def run(layers, state, x, c):
        if c is None:  # the reference: a Python loop over the layers
            for i in range(7):
                x, sub = _index(layers, i)(x, _index(state, i))
                state = jax.tree.map(lambda s, n, i=i: s.at[i].set(n), state, sub)
        else:
            x, state = checkpointed_layers(layers, x, state=state, checkpoints=c)
        return jnp.sum(x**3), state

    grad = eqx.filter_jit(eqx.filter_grad(run, has_aux=True))
    ref_grads, ref_state = grad(stacked, state, x, None)
    assert float(jnp.max(jnp.abs(jax.tree.leaves(ref_state)[0]))) > 0
    grads, new_state = grad(stacked, state, x, 2)
    _assert_close(grads, ref_grads)
    _assert_close(new_state, ref_state)


# By default: batch norm in test_batch_norm_gradients_and_state_equal, a state through
# checkpointed_layers in test_checkpointed_layers_with_state, lax.pmean under vmap in
# test_checkpointed_scan_keeps_unbatched_outputs_unbatched_under_vmap.
@pytest.mark.slow
def test_checkpointed_layers_batch_norm_under_vmap():
    # `lax.pmean` over the named vmap axis inside the checkpointed loop, forward and reverse;
    # the batch statistics in the state come back unbatched (`out_axes=None`).
    stacked, state = eqx.filter_vmap(eqx.nn.make_with_state(BatchNormBlock))(jr.split(jr.key(0), 5))
    x = jr.normal(jr.key(1), (6, 4))

    def loss(layers, state, x, c):
        if c is None:  # the reference: a Python loop over the layers

            def model(x, state):
                for i in range(5):
                    x, sub = _index(layers, i)(x, _index(state, i))
                    state = jax.tree.map(lambda s, n, i=i: s.at[i].set(n), state, sub)
                return x, state
        else:
            model = lambda x, state: checkpointed_layers(layers, x, state=state, checkpoints=c)
        return _batch_norm_run(model, state, x)

    grad = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))
    ref_grads, ref_state = grad(stacked, state, x, None)
    assert not jnp.allclose(jax.tree.leaves(ref_state)[0], jax.tree.leaves(state)[0])
    for c in (2, 5):
        grads, new_state = grad(stacked, state, x, c)
        _assert_close(grads, ref_grads)
        _assert_close(new_state, ref_state)


def test_checkpointed_scan_keeps_unbatched_outputs_unbatched_under_vmap():
    # The carry `(a, b, m)`: `a` per example, `b` from the shared `w` only, `m` a batch mean
    # (`lax.pmean`): `b` and `m` are unbatched (`out_axes=None`), in forward and reverse mode.
    def f(carry, x):
        a, b, m = carry
        a = jnp.sin(a) * b + x * (a - lax.pmean(a, "batch"))
        return (a, jnp.cos(b) * 1.1, m + lax.pmean(a**2, "batch")), None

    def run(scan, w, a0):
        (a, b, m), _ = scan(f, (a0, w, jnp.zeros(())), jnp.linspace(0.5, 1.5, 20))
        return a, b, m

    def loss(scan, w, a0s):
        go = lambda a0: run(scan, w, a0)
        a, b, m = jax.vmap(go, axis_name="batch", out_axes=(0, None, None))(a0s)
        return jnp.sum(a**2) + b**3 + jnp.sin(m)

    ckpt = lambda f, init, xs: checkpointed_scan(f, init, xs, checkpoints=3)
    w, a0s = jnp.array(0.7), jnp.linspace(0.1, 1.0, 4)
    grads = jax.grad(loss, argnums=(1, 2))
    _assert_close(grads(ckpt, w, a0s), grads(lax.scan, w, a0s))
    tangents = (jnp.array(0.3), jnp.linspace(-1.0, 1.0, 4))
    jvp = lambda scan: jax.jvp(partial(loss, scan), (w, a0s), tangents)
    _assert_close(jvp(ckpt), jvp(lax.scan))


def test_policy_passes_through():
    model = eqx.nn.Sequential(_mlp_blocks(4, width=16, hidden=64))
    x = jr.normal(jr.key(1), (32, 16))
    saving = jax.checkpoint_policies.everything_saveable
    loss = lambda m, x, policy=None: jnp.sum(checkpoint_layers(m, policy=policy)(x) ** 2)
    ref = lambda m, x: jnp.sum(m(x) ** 2)
    _assert_close(_grads(partial(loss, policy=saving), model, x), _grads(ref, model, x))
    # Saving every intermediate stores each block's [32, 64] activations: more memory.
    more = _temp_bytes(partial(loss, policy=saving), model, x)
    assert more > _temp_bytes(loss, model, x) + 4 * 32 * 64 * 8


def test_where_picks_submodules():
    model = BlockList(_mlp_blocks(3))
    ckpt = checkpoint_layers(model, where=lambda m: m.blocks[1])
    assert [isinstance(b, Checkpointed) for b in ckpt.blocks] == [False, True, False]
    every = checkpoint_layers(model, where=lambda m: m.blocks)
    assert all(isinstance(b, Checkpointed) for b in every.blocks)
    x = jr.normal(jr.key(1), (2, 4))
    loss = lambda m, x: jnp.sum(m(x, key=jr.key(0)) ** 2)
    _assert_close(_grads(loss, ckpt, x), _grads(loss, model, x))


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="selected nothing"):
        checkpoint_layers(BlockList(_mlp_blocks(2)), where=lambda m: ())
    with pytest.raises(ValueError, match="pass where="):
        checkpoint_layers(eqx.nn.Linear(2, 2, key=jr.key(0)))
    with pytest.raises(TypeError, match="not a layer"):
        checkpoint_layers(eqx.nn.Linear(2, 2, key=jr.key(0)), where=lambda m: m.weight)
    mixed = [eqx.nn.Linear(2, 2, key=jr.key(0)), eqx.nn.Linear(2, 3, key=jr.key(1))]
    with pytest.raises(ValueError, match="use checkpoint_layers"):
        checkpointed_layers(mixed, jnp.ones(2))
    with pytest.raises(ValueError, match="share a leading axis|leading sizes"):
        checkpointed_layers(MLPBlock(2, 3, jr.key(0)), jnp.ones((1, 2)))
    stacked = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))(jr.split(jr.key(0), 3))
    with pytest.raises(ValueError, match="checkpoints=1"):
        checkpointed_layers(stacked, jnp.ones(2), checkpoints=0)


def _temp_bytes(loss, model, x):
    grad, params = _array_grad(loss, model)
    return jax.jit(grad).lower(params, x).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "depth, batch, width, hidden",
    [
        # activations dominate: 4 MiB per block against 64 KiB of parameters
        pytest.param(8, 2048, 32, 256, marks=pytest.mark.slow),
        (12, 256, 128, 512),  # 1 MiB of activations per block against 0.5 MiB of parameters
    ],
)
def test_memory_checkpoint_layers_falls_to_inputs_plus_one_block(depth, batch, width, hidden):
    blocks = _mlp_blocks(depth, width, hidden)
    blocks = [jax.tree.map(lambda a: a.astype(jnp.float32), b) for b in blocks]
    x = jnp.ones((batch, width), jnp.float32)
    loss = lambda m, x: jnp.sum(m(x) ** 2)
    plain = _temp_bytes(loss, eqx.nn.Sequential(blocks), x)
    ckpt = _temp_bytes(loss, checkpoint_layers(eqx.nn.Sequential(blocks)), x)
    inputs = depth * batch * width * 4
    block_activations = 2 * batch * hidden * 4  # `up(x)` and its tanh
    block_params = sum(a.size * 4 for a in jax.tree.leaves(blocks[0]))
    # The parameters stay apart: one block's copy and one block's gradient at a time. (Stacked
    # parameters and their stacked gradient, 2 * depth * block_params = 12 MiB in the second
    # case, would exceed the plain model's 6.5 MiB on their own.)
    bound = inputs + block_activations + 2 * block_params + 2**20
    assert ckpt <= bound and ckpt < 0.6 * plain, (ckpt, bound, plain)


# checkpointed_layers is a checkpointed_scan: test_checkpointed_scan.py's memory checks.
@pytest.mark.slow
def test_memory_checkpointed_layers_flat_in_depth():
    make = lambda k: MLPBlock(16, 64, k, dtype=jnp.float32)
    x = jnp.ones((256, 16), jnp.float32)
    loss = lambda m, x: jnp.sum(checkpointed_layers(m, x, checkpoints=4) ** 2)
    stacked = lambda depth: eqx.filter_eval_shape(eqx.filter_vmap(make), jr.split(jr.key(0), depth))
    temps = [_temp_bytes(loss, stacked(depth), x) for depth in (16, 64, 256)]
    # Four [256, 16] snapshots and one block's activations, whatever the depth (a plain
    # lax.scan at depth 256 holds 256 blocks' activations: 33 MiB).
    assert max(temps) <= 1.1 * min(temps) and max(temps) < 2**20, temps


def test_forward_mode_from_a_python_float_input():
    """A stack applied to a Python float (its primal in the custom JVP rule is the float
    itself) keeps its tangent: `jacfwd == jacrev`."""
    model = checkpoint_layers(eqx.nn.Sequential([eqx.nn.Lambda(jnp.sin)] * 3))
    f = lambda x: model(x)
    fwd = jax.jacfwd(f)(1.0)
    _assert_close(fwd, jax.jacrev(f)(1.0))
    _assert_close(fwd, jax.jacrev(lambda x: jnp.sin(jnp.sin(jnp.sin(x))))(1.0))


# Forward mode through a stack by default: test_forward_mode_from_a_python_float_input and
# test_forward_mode_and_gradients_on_the_original_leaves.
@pytest.mark.slow
def test_layers_closing_over_a_differentiated_value():
    """A repeated layer whose function closes over the differentiated input (a Python float, or
    an array): the stack is scanned, and jacfwd == jacrev == the plain model's derivative."""

    def loss(scale, wrap):
        layer = eqx.nn.Lambda(lambda h: jnp.sin(h) * scale)
        return jnp.sum(wrap(eqx.nn.Sequential([layer] * 4))(jnp.array([0.3, 1.1])))

    ours, plain = partial(loss, wrap=checkpoint_layers), partial(loss, wrap=lambda m: m)
    for scale in (1.2, jnp.array([1.2, 0.7])):
        ref = jax.jacrev(plain)(scale)
        _assert_close(jax.jacfwd(ours)(scale), ref)
        _assert_close(jax.jacrev(ours)(scale), ref)
