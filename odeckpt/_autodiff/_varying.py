"""Loops and closure conversion that also work inside `jax.shard_map` with its type checks:
there every value carries the manual mesh axes it varies over, and a loop's carry that starts
replicated becomes varying after one step, which `lax.while_loop` refuses (carry types must
not change) and a function closure-converted for the one refuses for the other. Here loop
carries and the arguments of converted functions vary over every manual axis in scope, so
each sees one type. Outside `shard_map` there are no manual axes and nothing changes."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes in scope: those of the enclosing `jax.shard_map` (none outside)."""
    mesh: Any = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()))


def _cast(x, axes):
    """The array `x` cast to vary over the mesh axes `axes` too (those it lacks)."""
    if not eqx.is_array(x):
        return x
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def varying(tree):
    """`tree` with every array cast to vary over all the manual mesh axes in scope (inside
    `jax.shard_map`; unchanged elsewhere)."""
    manual = manual_axes()
    if not manual:
        return tree
    return jax.tree.map(lambda x: _cast(x, manual), tree)


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
