"""Loops and closure conversion that also work inside `jax.shard_map` with its type checks:
there every value carries the manual mesh axes it varies over, and a loop's carry that starts
replicated becomes varying after one step, which `lax.while_loop` refuses (carry types must
not change) and a function closure-converted for the one refuses for the other. Here loop
carries and the arguments of converted functions vary over every manual axis in scope, so
each sees one type. Outside `shard_map` there are no manual axes and nothing changes.

Under `jax.jit` over a mesh with `Explicit` axes (`jax.set_mesh`) shardings are part of the
types too: there a constant (no mesh) and a traced value (on the mesh) of one shape differ, so
`varying` also places constants on the mesh (`on_mesh`). Where a batched and an unbatched
operand meet, some of JAX's batching or sharding rules lose or refuse the `vmap`ped axis's
sharding: `stack` builds its result another way there, and `on_auto_axes` (with `take`, a
lane's entry of a shared table) runs such code with those axes made `Auto`. Without an
`Explicit` axis in scope each is the plain operation."""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes in scope: those of the enclosing `jax.shard_map` (none outside)."""
    mesh: Any = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()))


def explicit_axes() -> tuple[str, ...]:
    """The mesh axes in scope whose shardings are part of the types: the `Explicit` axes of
    the mesh set by `jax.set_mesh` (none outside one)."""
    mesh: Any = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "explicit_axes", ()))


@contextlib.contextmanager
def mesh_of(tree) -> Iterator[None]:
    """While active, the mesh that the arrays of `tree` carry in their types is the one in
    scope, if it has `Explicit` axes and no mesh is in scope: `jax.jit` of arrays placed on
    such a mesh without `jax.set_mesh` traces with none, where the helpers here need it."""
    meshes = {
        jax.typeof(x).sharding.mesh
        for x in jax.tree.leaves(tree)
        if eqx.is_array(x) and isinstance(jax.typeof(x).sharding, NamedSharding)
    }
    explicit = [m for m in meshes if not m.empty and getattr(m, "explicit_axes", ())]
    if len(explicit) != 1 or not jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with jax.sharding.use_abstract_mesh(explicit[0]):
        yield


def on_mesh_of_inputs(fn: Callable) -> Callable:
    """`fn`, traced with the mesh its array arguments carry in their types in scope
    (`mesh_of`): for the public entry points."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with mesh_of((args, kwargs)):
            return fn(*args, **kwargs)

    return traced


def sharded_by_type(x) -> bool:
    """Whether the array `x` is sharded by its type: over `Explicit` mesh axes in scope."""
    if not explicit_axes():
        return False
    return any(axis is not None for axis in jax.typeof(x).sharding.spec)


def _cast(x, axes):
    """The array `x` cast to vary over the mesh axes `axes` too (those it lacks)."""
    if not eqx.is_array(x):
        return x
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _on_mesh(x):
    """The array `x` placed, replicated, on the mesh in scope if it is on none (a constant)."""
    if not eqx.is_array(x) or not jax.typeof(x).sharding.mesh.empty:
        return x
    return jax.sharding.reshard(x, PartitionSpec())


def on_mesh(tree):
    """`tree` with every array that is on no mesh (a constant) placed, replicated, on the mesh
    in scope, under a mesh with `Explicit` axes; unchanged elsewhere.

    Where such a constant meets a batched value in a primitive that `vmap` broadcasts it for
    (a loop's carry, `concatenate`), JAX gives it the batch axis's sharding on its own mesh,
    which has no such axis."""
    if not explicit_axes():
        return tree
    return jax.tree.map(_on_mesh, tree)


def sharding_of(x) -> NamedSharding | None:
    """The sharding that the type of `x` (an array, a `jax.ShapeDtypeStruct` or an abstract
    value) carries over the `Explicit` mesh axes in scope, on the mesh in scope; `None` where
    it is sharded over none of them (or none is in scope)."""
    if not explicit_axes():
        return None
    aval = jax.typeof(x) if eqx.is_array(x) else x
    spec = tuple(getattr(getattr(aval, "sharding", None), "spec", None) or ())
    if all(axis is None for axis in spec):
        return None
    return NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec(*spec))


def filled(x, fill_value=0, rows: int | None = None) -> jax.Array:
    """An array of the dtype of `x` (an array, a `jax.ShapeDtypeStruct` or an abstract value)
    holding `fill_value`, of its shape, or with `rows` rows of it (`[rows, *x.shape]`: a
    buffer of states like `x`).

    Where `x` is sharded by its type over `Explicit` mesh axes in scope (`sharding_of`), so
    is the result, along the axes of `x` (a buffer gets a leading `None`): a row of `x`
    written into such a buffer, or a zero standing for a cotangent of `x`, then has the type
    of `x`, and no device holds the whole of it. Elsewhere it is the plain `jnp.full`."""
    shape = tuple(jnp.shape(x)) if rows is None else (rows, *jnp.shape(x))
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    sharding = sharding_of(x)
    if sharding is None:
        return jnp.full(shape, fill_value, dtype)
    spec = sharding.spec if rows is None else PartitionSpec(None, *sharding.spec)
    return jnp.full(shape, fill_value, dtype, out_sharding=spec)


def replicated(x) -> jax.Array:
    """The array `x` replicated over the `Explicit` mesh axes in scope where its type shards it
    over them (`sharding_of`; an all-gather), for an operation JAX only runs on whole arrays
    (the LU factorisation of a Jacobian, a solve with its factors); `x` elsewhere."""
    if sharding_of(x) is None:
        return x
    return jax.sharding.reshard(x, PartitionSpec())


def like(x, template) -> jax.Array:
    """The array `x` sharded like `template` where the type of `template` shards it over the
    `Explicit` mesh axes in scope (`sharding_of`), `x` having the shape of `template` or
    leading axes more (rows of arrays like it, those axes unsharded): the solution of a
    replicated solve given back the sharding of its right-hand side (each device keeps its
    block: no collective). `x` elsewhere."""
    sharding = sharding_of(template)
    if sharding is None:
        return x
    spec = (*sharding.spec, *[None] * (jnp.ndim(template) - len(sharding.spec)))
    return jax.sharding.reshard(x, PartitionSpec(*[None] * (x.ndim - len(spec)), *spec))


def varying(tree):
    """`tree` with every array cast to vary over all the manual mesh axes in scope (inside
    `jax.shard_map`) and placed on the mesh if it is on none (`on_mesh`); unchanged
    elsewhere."""
    tree = on_mesh(tree)
    manual = manual_axes()
    if not manual:
        return tree
    return jax.tree.map(lambda x: _cast(x, manual), tree)


def stack(arrays, axis: int = 0) -> jax.Array:
    """`jnp.stack(arrays, axis)`, also where batched and unbatched arrays meet under `vmap`
    over `Explicit` mesh axes: JAX's batching rule of `stack` broadcasts the unbatched ones
    without the batch axis's sharding (and the types then differ); there it is built by
    `concatenate`, whose rule keeps it."""
    if not explicit_axes():
        return jnp.stack(arrays, axis)
    return jnp.concatenate([jnp.expand_dims(x, axis) for x in arrays], axis)


def take(array, index) -> jax.Array:
    """`array[index]`, also where `vmap` over `Explicit` mesh axes batches `index` and not
    `array` (a lane's own entry of a shared table): JAX's sharding rule of the `gather` that
    `vmap` makes of it refuses that case, so there it is read on `Auto` axes
    (`on_auto_axes`)."""
    return on_auto_axes(lambda array, index: array[index], array, index)


def on_auto_axes(fn: Callable, *args) -> Any:
    """`fn(*args)` with the `Explicit` mesh axes in scope made `Auto` (the compiler places
    what it computes) and its results replicated over them, per lane of a `vmap`; `fn(*args)`
    elsewhere.

    For code that `vmap` breaks under explicit axes: some batching rules of JAX drop the
    sharding of the batch axis where a batched operand meets an unbatched one (`stack`; a
    `gather` from an unbatched table at batched indices, whose sharding rule then refuses).
    `fn` may close over no traced array and its results must be arrays."""
    axes = explicit_axes()
    if not axes:
        return fn(*args)
    arrays, rest = eqx.partition(args, eqx.is_array)
    run = lambda arrays: fn(*eqx.combine(arrays, rest))
    return jax.sharding.auto_axes(run, axes=axes, out_sharding=PartitionSpec())(arrays)


def varying_as(x, aval):
    """The array `x` cast to vary over the mesh axes the abstract value `aval` varies over
    (inside `jax.shard_map`; unchanged elsewhere)."""
    return _cast(x, getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def varying_like(tree, like):
    """`tree` with each array cast to vary over the mesh axes its counterpart in `like` (a
    tree of the same structure) varies over: the tangents of a rule's outputs, like the
    outputs (inside `jax.shard_map`; unchanged elsewhere)."""
    if not manual_axes():
        return tree

    def leaf(x, template):
        if not eqx.is_array(template):
            return x
        return _cast(x, jax.typeof(template).manual_axis_type.varying)

    return jax.tree.map(leaf, tree, like)


def while_loop(cond_fun: Callable, body_fun: Callable, init_val):
    """`lax.while_loop` whose carry varies over every manual axis in scope (`varying`), on
    entry and after every step."""
    return jax.lax.while_loop(cond_fun, lambda val: varying(body_fun(val)), varying(init_val))


def cond(pred, true_fun: Callable, false_fun: Callable, *operands):
    """`lax.cond` whose branches' results vary over every manual axis in scope (`varying`),
    so that the two have one type."""
    return jax.lax.cond(
        pred,
        lambda *args: varying(true_fun(*args)),
        lambda *args: varying(false_fun(*args)),
        *varying(operands),
    )


def switch(index, branches, *operands):
    """`lax.switch` whose branches' results vary over every manual axis in scope."""
    return jax.lax.switch(index, [_varied(b) for b in branches], *operands)


def _varied(fn: Callable) -> Callable:
    return lambda *args: varying(fn(*args))


def scan(f: Callable, init, xs=None, length=None):
    """`lax.scan` whose carry varies over every manual axis in scope, on entry and after every
    step (`varying`)."""

    def body(carry, x):
        carry, y = f(carry, x)
        return varying(carry), y

    return jax.lax.scan(body, varying(init), xs, length=length)


class ClosureConverted(eqx.Module):
    """`fn` closure-converted (`eqx.filter_closure_convert`: the arrays it closes over are
    leaves here), called with its arguments cast by `varying`."""

    converted: Any  # an equinox closure conversion

    def __call__(self, *args, **kwargs):
        return self.converted(*varying(args), **varying(kwargs))

    @property
    def out_struct(self):
        """The structure, shapes and dtypes of what it returns."""
        return self.converted.out_struct


def closure_convert(fn: Callable, *example_args) -> ClosureConverted:
    """`fn` closure-converted for arguments like `example_args` (see `ClosureConverted`)."""
    return ClosureConverted(eqx.filter_closure_convert(fn, *varying(example_args)))
