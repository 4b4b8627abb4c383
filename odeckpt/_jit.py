"""`odeckpt.jit`: compile a program that calls `odeckpt.solve` into one that JAX's persistent
compilation cache can store, with failures raised on the host after the call."""

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import numpy as np
from jax.experimental import checkify

from ._errors import failures_on_host
from ._failed_lane import readable

# `jax.jit` options that name argument positions, which `odeckpt.jit` repacks.
_POSITIONAL_OPTIONS = ("donate_argnums", "donate_argnames", "in_shardings")


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] | None = None,
    static_argnames: str | Sequence[str] | None = None,
    **jit_options,
):
    """Compile `fun` like `jax.jit`, with every failure of an `odeckpt.solve` inside it raised on
    the host when the call returns instead of by a host callback inside the program, so that the
    compiled program holds no host callback from odeckpt and JAX's persistent compilation cache
    can store it: a later process loads it instead of compiling again.

    A drop-in for `jax.jit` and `equinox.filter_jit`. Arrays and Python `float`/`complex`
    numbers (anywhere in the arguments: tolerances, `args` leaves, times) are traced, so a new
    value reuses the compiled program; Python `int`s, `bool`s, strings, functions and other
    objects are static (part of the cache key), as with `equinox.filter_jit`, and so are the
    arguments named by `static_argnums` / `static_argnames`. Other keywords go to `jax.jit`
    (`device`, `backend`, `keep_unused`, `out_shardings`, `compiler_options`, ...); the ones that
    name argument positions (`donate_argnums`, `in_shardings`) are not taken.

    A solve that fails inside the program (with `throw=True`) raises
    `equinox.EquinoxRuntimeError` with the message `solve` gives under `jax.jit`, naming the fix,
    when the call returns; the checks of the checkpointing engine and of the adjoints' backward
    passes raise the same way. Derivatives of a failed solve are NaN, as everywhere. What a user
    asks for explicitly keeps its callback: `progress=True`, `on_backward`, and host callbacks
    of the user's own code (these stop the persistent cache from storing the program).

    **Arguments:**

    - `fun`: the function to compile (also usable as a decorator, with or without keywords).
    - `static_argnums`, `static_argnames`: as for `jax.jit`.
    - `jit_options`: further keywords of `jax.jit`.

    **Returns:**

    The compiled function. It also has `lower(*args, **kwargs)`, as a `jax.jit` function does.
    Make it the outermost transformation (`odeckpt.jit(jax.grad(loss))`, not
    `jax.grad(odeckpt.jit(loss))`): called inside another transformation or `jit`, it calls
    `fun` as it is, and the outer program raises as under `jax.jit`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, odeckpt

    jax.config.update("jax_compilation_cache_dir", "/tmp/jax-cache")  # cache across processes

    def loss(args):
        sol = odeckpt.solve(lambda t, y, a: -a * y, jnp.array([1.0]), (0.0, 1.0), args)
        return sol.ys[-1, 0]

    grad = odeckpt.jit(jax.grad(loss))
    grad(0.5)  # compiled once; a new process with the same cache loads it
    ```
    """
    if fun is None:
        return functools.partial(
            jit, static_argnums=static_argnums, static_argnames=static_argnames, **jit_options
        )
    for option in _POSITIONAL_OPTIONS:
        if option in jit_options:
            raise TypeError(
                f"odeckpt.jit does not take {option}=. Fix: use `jax.jit(..., {option}=...)` "
                "for this program (failures then raise through host callbacks, and the "
                "persistent compilation cache does not store it)."
            )
    return _Compiled(fun, _positions(static_argnums), _names(static_argnames), jit_options)


class _Compiled:
    """`fun` compiled with its failures returned beside its outputs (see `jit`)."""

    def __init__(self, fun, static_argnums: tuple[int, ...], static_argnames, jit_options):
        self._fun = fun
        self._names = names = _parameter_names(fun)
        # As `jax.jit`: a static argument may be named by position or by name, and passed
        # either way.
        self._static_argnums = frozenset(
            (*static_argnums, *(names.index(n) for n in static_argnames if n in names))
        )
        self._static_argnames = frozenset(
            (*static_argnames, *(names[i] for i in static_argnums if -len(names) <= i < len(names)))
        )
        self._jitted = jax.jit(self._checked, static_argnums=(1,), **jit_options)
        functools.update_wrapper(self, fun)

    def __call__(self, *args, **kwargs):
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
            # Inside another transformation the failure bits cannot reach the host here: the
            # outer program holds the solve, and its failures raise as under `jax.jit`.
            return self._fun(*args, **kwargs)
        dynamic, static = self._split(args, kwargs)
        error, out_dynamic, out_static = self._jitted(dynamic, static)
        # On the host: the failure bits of a sharded program may be sharded arrays (over a
        # mesh's `Explicit` axes, which checkify cannot index).
        message = jax.tree.map(np.asarray, error).get()
        if message is not None:
            raise eqx.EquinoxRuntimeError(readable(_without_location(message)))
        return eqx.combine(out_dynamic, out_static.tree)

    def lower(self, *args, **kwargs):
        """The program for these arguments, lowered (as `jax.jit(f).lower`)."""
        return self._jitted.lower(*self._split(args, kwargs))

    def _split(self, args: tuple, kwargs: dict):
        positions = self._fixed_positions(len(args), kwargs)
        static_args = tuple(
            _StaticLeaf(arg) if i in positions else arg for i, arg in enumerate(args)
        )
        static_kwargs = {
            name: _StaticLeaf(value) if name in self._static_argnames else value
            for name, value in kwargs.items()
        }
        dynamic, static = eqx.partition((static_args, static_kwargs), _traced)
        return dynamic, _Hashable(static)

    def _fixed_positions(self, count: int, kwargs: dict) -> set[int]:
        """The positions of the static arguments among `count` positional ones; raises for a
        `static_argnums` entry that names no argument of the call."""
        names = self._names
        for i in self._static_argnums:
            passed = -count <= i < count or (0 <= i < len(names) and names[i] in kwargs)
            if not passed:
                raise ValueError(
                    f"odeckpt.jit(static_argnums=...) names argument {i}, but the call passes "
                    f"{count} positional argument(s). Fix: pass that argument, or correct "
                    "static_argnums."
                )
        return {i % count for i in self._static_argnums if -count <= i < count}

    def _checked(self, dynamic, static: "_Hashable"):
        args, kwargs = eqx.combine(dynamic, static.tree)
        args = tuple(a.value if isinstance(a, _StaticLeaf) else a for a in args)
        kwargs = {k: v.value if isinstance(v, _StaticLeaf) else v for k, v in kwargs.items()}
        statics = []

        def arrays_out(*args, **kwargs):
            out_dynamic, out_static = eqx.partition(self._fun(*args, **kwargs), eqx.is_array)
            statics.append(out_static)
            return out_dynamic

        with failures_on_host():
            checked = checkify.checkify(arrays_out, errors=checkify.user_checks)
            error, out_dynamic = checked(*args, **kwargs)
        return error, out_dynamic, _StaticOutput(statics[0])


def _parameter_names(fun) -> list[str]:
    """The names of `fun`'s positional parameters (empty if it has no signature)."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _traced(leaf) -> bool:
    """Whether an argument leaf is traced: arrays and Python floating or complex numbers."""
    if isinstance(leaf, bool | int | _StaticLeaf):
        return False
    return eqx.is_array(leaf) or isinstance(leaf, float | complex | np.generic)


class _StaticLeaf:
    """An argument held static whole (named by `static_argnums` / `static_argnames`)."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return hash((type(self.value), self.value))

    def __eq__(self, other):
        if not isinstance(other, _StaticLeaf) or type(other.value) is not type(self.value):
            return False
        return bool(self.value == other.value)


class _Hashable:
    """The static part of the arguments, hashable for `jax.jit`'s cache (a static `1` and a
    static `True` are different keys, as for `jax.jit`)."""

    def __init__(self, tree):
        self.tree = tree
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        for path, leaf in leaves:
            try:
                hash(leaf)
            except TypeError:
                value = leaf.value if isinstance(leaf, _StaticLeaf) else leaf
                kind, rest = ("positional", path[1:]) if path[0].idx == 0 else ("keyword", path[1:])
                raise TypeError(
                    f"odeckpt.jit holds the {kind} argument at {jax.tree_util.keystr(rest)} "
                    f"static (part of the cache key), but a {type(value).__name__} is not "
                    "hashable. Fix: pass it as an array (traced), or as a tuple if it must be "
                    "static."
                ) from None
        self._key = (jax.tree.structure(tree), tuple((type(x), x) for _, x in leaves))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Hashable) and self._key == other._key


class _StaticOutput(eqx.Module):
    tree: Any = eqx.field(static=True)


def _positions(static_argnums) -> tuple[int, ...]:
    if static_argnums is None:
        return ()
    return (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)


def _names(static_argnames) -> frozenset[str]:
    if static_argnames is None:
        return frozenset()
    return frozenset((static_argnames,) if isinstance(static_argnames, str) else static_argnames)


def _without_location(message: str) -> str:
    """`checkify`'s message without the source location it appends."""
    return message.split(" (`check` failed")[0].rstrip()
