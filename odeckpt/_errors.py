"""The one place that decides how a run-time failure raises.

Under a plain `jax.jit` (or no `jit`), through `eqx.error_if`: a host callback that raises when
the failing value is computed. While `odeckpt.jit` traces a program, as `checkify` checks
instead: the failure bits travel beside the program's outputs and `odeckpt.jit` raises on the
host when the call returns, so the compiled program holds no host callback and JAX's persistent
compilation cache can store it (see docs/failures.md). A solve whose status is known when it
returns (outside `jit`) raises in Python instead: see `_on_failure.raised`.
"""

import contextlib
import contextvars
import os
from collections.abc import Iterator, Sequence

import equinox as eqx
import jax.numpy as jnp
from jax.experimental import checkify

from ._types import BoolScalar

_ON_HOST = contextvars.ContextVar("odeckpt_failures_on_host", default=False)


@contextlib.contextmanager
def failures_on_host() -> Iterator[None]:
    """While active, failures are recorded as `checkify` checks (for `odeckpt.jit`, which
    functionalises them) instead of host callbacks."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def raising() -> bool:
    """Whether failures raise: unless equinox's `EQX_ON_ERROR` asks for another behaviour
    (`nan`: failed outputs are NaN; `off`: unchecked; `breakpoint`: a debugger, through its
    callback)."""
    return os.environ.get("EQX_ON_ERROR", "raise") == "raise"


def on_host() -> bool:
    """Whether failures are being recorded for `odeckpt.jit` (see `failures_on_host`): while it
    traces, if failures raise (with `EQX_ON_ERROR` set otherwise, no callback is needed either,
    or a debugger's is)."""
    return _ON_HOST.get() and raising()


def error_if(token, pred: BoolScalar, message: str):
    """`token` unchanged; a run-time error with `message` where `pred` holds (any lane under
    `vmap`). Always rebind the result: under a plain `jit` the check lives on its data path."""
    if on_host():
        checkify.check(~jnp.asarray(pred), _literal(message))
        return token
    return eqx.error_if(token, pred, message)


def branched_error_if(token, pred: BoolScalar, index, messages: Sequence[str]):
    """`token` unchanged; a run-time error with `messages[index]` where `pred` holds."""
    if on_host():
        pred = jnp.asarray(pred)
        for i, message in enumerate(messages):
            checkify.check(~(pred & (index == i)), _literal(message))
        return token
    return eqx.branched_error_if(token, pred, index, list(messages))


def _literal(message: str) -> str:
    """`message` as a `checkify` format string that prints it unchanged."""
    return message.replace("{", "{{").replace("}", "}}")
