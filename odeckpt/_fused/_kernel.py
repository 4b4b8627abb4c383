"""A loop run in one Pallas kernel with one trajectory per lane.

`run_lanes` takes a loop written for one trajectory (`init`, `cond`, `step`, as `LaneLoop`),
traces each to a jaxpr and evaluates it on blocks of lanes (`_lanes`): each program instance of
the kernel holds a block of trajectories, steps them while any still runs (a lane whose `cond`
is false keeps its carry), and writes each step's rows (save times) at each lane's own row.
Every array in the kernel is one lane vector or a scalar, as Pallas' Triton backend needs (sizes
powers of two: inputs and outputs are padded). Off a GPU the kernel runs in Pallas' interpret
mode, which evaluates the same program with XLA's operations.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from . import _lanes

Tree = Any


@dataclasses.dataclass(frozen=True)
class LaneLoop:
    """A loop over one trajectory: `init(lane, uniform) -> (carry, buffers)`, `cond(carry,
    uniform) -> running`, `step(carry, lane, uniform) -> (carry, writes)`.

    `lane` holds the trajectory's own inputs, `uniform` those shared by every trajectory (times,
    tolerances, shared parameters); `buffers` is a list of arrays of rows (`(rows, ...)`), and
    `writes` a list like it of `(index, values)`: the rows `index` (`(k,)` integers; out of range:
    not written) get `values` (`(k, ...)`)."""

    init: Callable
    cond: Callable
    step: Callable


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """How the kernel is laid out: `block` lanes per program instance (a power of two),
    `interpret` (Pallas' interpret mode: any backend, slow), and `num_warps` on a GPU."""

    block: int
    interpret: bool
    num_warps: int = 4


def _power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _flat_size(shape) -> int:
    return int(np.prod(shape, dtype=int))


def _trace(function, *examples) -> jex.ClosedJaxpr:
    flat, tree = jax.tree.flatten(examples)
    shaped = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in flat]

    def flat_function(*leaves):
        result = function(*jax.tree.unflatten(tree, leaves))
        return jax.tree.leaves(result)

    return jax.make_jaxpr(flat_function)(*shaped)


def run_lanes(
    loop: LaneLoop, lane: Tree, uniform: Tree, settings: KernelSettings
) -> tuple[Tree, list]:
    """Run `loop` for every trajectory: `lane` holds leaves with a leading axis of trajectories
    (`n`), `uniform` leaves shared by all.

    **Returns:** the final carry and the buffers, each leaf with a leading axis `n`.
    """
    lane_leaves, lane_tree = jax.tree.flatten(lane)
    n = lane_leaves[0].shape[0]
    one = jax.tree.unflatten(lane_tree, [x[0] for x in lane_leaves])
    init_jaxpr = _trace(loop.init, one, uniform)
    carry0, buffers0 = jax.eval_shape(loop.init, one, uniform)
    cond_jaxpr = _trace(loop.cond, carry0, uniform)
    step_jaxpr = _trace(loop.step, carry0, one, uniform)
    carry_leaves, carry_tree = jax.tree.flatten(carry0)
    buffer_leaves = list(buffers0)
    uniform_leaves = jax.tree.leaves(uniform)
    consts = [init_jaxpr.consts, cond_jaxpr.consts, step_jaxpr.consts]
    const_leaves = [jnp.asarray(c) for group in consts for c in group]

    block = settings.block
    padded = -(-n // block) * block
    lane_in = [_lane_input(x, padded) for x in lane_leaves]
    uniform_in = [_uniform_input(x) for x in [*uniform_leaves, *const_leaves]]
    out_specs, out_shapes = [], []
    for leaf in [*carry_leaves, *buffer_leaves]:
        rows = _power_of_two(_flat_size(leaf.shape))
        out_shapes.append(jax.ShapeDtypeStruct((rows, padded), leaf.dtype))
        out_specs.append(pl.BlockSpec((rows, block), lambda i: (0, i)))
    in_specs = [pl.BlockSpec((x.shape[0], block), lambda i: (0, i)) for x in lane_in]
    in_specs += [pl.BlockSpec(x.shape, lambda i: (0,)) for x in uniform_in]

    layout = _Layout(
        lane=[x.shape[1:] for x in lane_leaves],
        uniform=[jnp.shape(x) for x in uniform_leaves],
        consts=[[jnp.shape(c) for c in group] for group in consts],
        carry=[x.shape for x in carry_leaves],
        buffers=[x.shape for x in buffer_leaves],
    )
    kernel = _Kernel(init_jaxpr, cond_jaxpr, step_jaxpr, layout, block)
    compiler = None
    if not settings.interpret:
        compiler = pl_triton.CompilerParams(num_warps=settings.num_warps, num_stages=1)
    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=(padded // block,),
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=settings.interpret,
        compiler_params=compiler,
        name="odeckpt_ensemble",
    )
    outputs = _not_differentiated(call, *lane_in, *uniform_in)
    unpacked = [
        out[: _flat_size(leaf.shape), :n].T.reshape((n, *leaf.shape))
        for out, leaf in zip(outputs, [*carry_leaves, *buffer_leaves], strict=True)
    ]
    carry = jax.tree.unflatten(carry_tree, unpacked[: len(carry_leaves)])
    return carry, unpacked[len(carry_leaves) :]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _not_differentiated(call, *inputs):
    """`call(*inputs)`, refusing to be differentiated: the ensemble's derivatives come from a
    kernel of their own (`_fused._solve`), and a derivative of that (a second derivative)
    would differentiate the kernel itself."""
    return call(*inputs)


@_not_differentiated.defjvp
def _not_differentiated_jvp(call, primals, tangents):
    del call, primals, tangents
    raise ValueError(
        "The fused ensemble kernel computes first derivatives of the solve (jax.jvp, jax.grad, "
        "jax.jacfwd, jax.jacrev); a second derivative (jax.hessian, a jvp of a grad, ...) "
        "would differentiate the kernel itself, which it does not support. Fix: pass "
        "`backend='vmap'` to `odeckpt.ensemble`."
    )


def _lane_input(x: jax.Array, padded: int) -> jax.Array:
    """A per-trajectory input `(n, ...)` as `(rows, padded)`: one row per element, lanes last
    (a lane vector is contiguous), padded with copies of the first trajectory."""
    n = x.shape[0]
    flat = _strong(jnp.reshape(x, (n, -1)).T)
    if padded > n:
        flat = jnp.concatenate([flat, jnp.repeat(flat[:, :1], padded - n, axis=1)], axis=1)
    rows = _power_of_two(flat.shape[0])
    return jnp.pad(flat, ((0, rows - flat.shape[0]), (0, 0)))


def _uniform_input(x) -> jax.Array:
    flat = _strong(jnp.reshape(jnp.asarray(x), (-1,)))
    size = _power_of_two(max(flat.shape[0], 1))
    return jnp.pad(flat, (0, size - flat.shape[0]))


def _strong(x: jax.Array) -> jax.Array:
    """`x` without a weak type: Pallas' Triton lowering of some operations (`abs`, `max`) on a
    weakly typed float64 returns a float32 (JAX 0.10)."""
    return jax.lax.convert_element_type(x, x.dtype)


@dataclasses.dataclass(frozen=True)
class _Layout:
    lane: list
    uniform: list
    consts: list
    carry: list
    buffers: list


@dataclasses.dataclass(frozen=True)
class _Kernel:
    init: jex.ClosedJaxpr
    cond: jex.ClosedJaxpr
    step: jex.ClosedJaxpr
    layout: _Layout
    block: int

    def __call__(self, *refs):
        layout, size = self.layout, self.block
        lane_refs = refs[: len(layout.lane)]
        rest = refs[len(layout.lane) :]
        uniform_refs = rest[: len(layout.uniform)]
        rest = rest[len(layout.uniform) :]
        const_refs = []
        for group in layout.consts:
            const_refs.append(rest[: len(group)])
            rest = rest[len(group) :]
        carry_refs = rest[: len(layout.carry)]
        buffer_refs = rest[len(layout.carry) :]

        lane = [_load_lanes(r, s) for r, s in zip(lane_refs, layout.lane, strict=True)]
        uniform = [_load_uniform(r, s) for r, s in zip(uniform_refs, layout.uniform, strict=True)]
        consts = [
            [_load_uniform(r, s) for r, s in zip(refs_, shapes, strict=True)]
            for refs_, shapes in zip(const_refs, layout.consts, strict=True)
        ]
        out = _lanes.evaluate_with(self.init, consts[0], [*lane, *uniform], size)
        carry, buffers = out[: len(layout.carry)], out[len(layout.carry) :]
        for ref, values in zip(buffer_refs, buffers, strict=True):
            _store_all(ref, values, size)
        shapes = [c.shape for c in carry]
        dtypes = [self._dtype(i) for i in range(len(carry))]

        def as_lanes(flat):
            out, start = [], 0
            for shape in shapes:
                count = _flat_size(shape)
                block = np.empty(count, dtype=object)
                for i in range(count):
                    block[i] = flat[start + i]
                out.append(block.reshape(shape))
                start += count
            return out

        def running(carry_lanes):
            (going,) = _lanes.evaluate_with(self.cond, consts[1], [*carry_lanes, *uniform], size)
            return _vector(going[()], size)

        def keep_going(flat):
            return jnp.max(running(as_lanes(flat)).astype(jnp.int32)) > 0

        def body(flat):
            state = as_lanes(flat)
            going = running(state)
            out = _lanes.evaluate_with(self.step, consts[2], [*state, *lane, *uniform], size)
            new, writes = out[: len(shapes)], out[len(shapes) :]
            for g, (ref, shape) in enumerate(zip(buffer_refs, layout.buffers, strict=True)):
                index, values = writes[2 * g], writes[2 * g + 1]
                _store_rows(ref, shape[0], index, values, going, size)
            new_flat = [e for block in new for e in block.reshape(-1)]
            return [
                jnp.where(going, _vector(a, size), b) for a, b in zip(new_flat, flat, strict=True)
            ]

        flat0 = [
            _vector(e, size).astype(dtype)
            for block, dtype in zip(carry, dtypes, strict=True)
            for e in block.reshape(-1)
        ]
        final = jax.lax.while_loop(keep_going, body, flat0)
        for ref, block in zip(carry_refs, as_lanes(final), strict=True):
            _store_all(ref, block, size)

    def _dtype(self, i: int):
        return self.init.out_avals[i].dtype


def _vector(element, size: int) -> jax.Array:
    return element if _lanes.per_lane(element) else jnp.broadcast_to(element, (size,))


def _load_lanes(ref, shape) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    for position, index in enumerate(np.ndindex(shape)):
        out[index] = ref[position, :]
    return out


def _load_uniform(ref, shape) -> np.ndarray:
    out = np.empty(shape, dtype=object)
    for position, index in enumerate(np.ndindex(shape)):
        out[index] = ref[position]
    return out


def _store_all(ref, values: np.ndarray, size: int) -> None:
    for position, index in enumerate(np.ndindex(values.shape)):
        ref[position, :] = _vector(values[index], size).astype(ref.dtype)


def _store_rows(ref, rows: int, index: np.ndarray, values: np.ndarray, going, size: int) -> None:
    """Write row `index[k]` of each lane's buffer (of `rows` rows) with `values[k]`, where the
    lane is `going` and the index in range."""
    row_shape = values.shape[1:]
    row_size = _flat_size(row_shape)
    lanes = jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
    for k in range(values.shape[0]):
        where = _vector(index[k], size).astype(jnp.int32)
        valid = going & (where >= 0) & (where < rows)
        for offset, element in enumerate(np.ndindex(row_shape)):
            position = where * row_size + offset
            position = jnp.where(valid, position, 0)
            value = _vector(values[(k, *element)], size).astype(ref.dtype)
            pl_triton.store(ref.at[position, lanes], value, mask=valid)
