"""`on_backward=`: the user's callback for what a gradient's backward pass measured."""

from collections.abc import Callable

import jax


def check_on_backward(name: str, on_backward) -> None:
    """Raise, naming the fix, unless `on_backward` is `None` or a hashable callable (`jax.jit`
    caches on it)."""
    if on_backward is None:
        return
    if not callable(on_backward):
        raise TypeError(
            f"{name}(on_backward={on_backward!r}) is not callable. Fix: pass a function "
            "taking one dict, e.g. `on_backward=records.append` or `on_backward=print`."
        )
    try:
        hash(on_backward)
    except TypeError:
        raise TypeError(
            f"{name}(on_backward={on_backward!r}) is not hashable, and `jax.jit` caches "
            "on it. Fix: pass a function or a bound method (e.g. "
            "`on_backward=recorder.record`)."
        ) from None


def report(on_backward: Callable[[dict], None], values, describe: Callable[..., dict]) -> None:
    """Hand `describe(values)` to `on_backward` on the host: `values` a pytree of arrays,
    `describe` builds the `dict` of Python values `on_backward` documents from their host
    copies. Under `vmap` `jax.debug.callback` unrolls over the batch: one call per element."""
    jax.debug.callback(lambda values: on_backward(describe(values)), values)
