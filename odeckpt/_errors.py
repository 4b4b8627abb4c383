"""The one place that decides how a run-time failure raises.

Under a plain `jax.jit` (or no `jit`): a host callback that raises when the failing value is
computed, on every device at once (the failure is agreed over the devices first), so that no
device waits in a collective for one that raised, which XLA would end by aborting the process
after its rendezvous timeout. While `odeckpt.jit` traces a program, as `checkify` checks
instead: the failure bits travel beside the program's outputs and `odeckpt.jit` raises on the
host when the call returns, so the compiled program holds no host callback and JAX's persistent
compilation cache can store it (see docs/failures.md). Both name the first failing lane of the
`vmap`s (and the shard of `jax.shard_map`) around the check (`_failed_lane`). A solve whose
status is known when it returns (outside `jit`) raises in Python instead: see
`_on_failure.raised`. Under equinox's `EQX_ON_ERROR=nan`, `off` or `breakpoint`, and on TPUs
(which do not pass a callback's error on), `eqx.error_if` decides.
"""

import contextlib
import contextvars
import functools
import logging
import os
from collections.abc import Iterator, Sequence

import equinox as eqx
import jax
import jax.core
from jax.experimental import checkify

from ._failed_lane import CHECKIFY_PREFIX, locate, where_text
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
    `vmap`). Always rebind the result: under `EQX_ON_ERROR=nan` it carries the NaNs."""
    return branched_error_if(token, pred, 0, [message])


def branched_error_if(token, pred: BoolScalar, index, messages: Sequence[str]):
    """`token` unchanged; a run-time error with `messages[index]` where `pred` holds, naming
    the first failing lane (see `error_if`)."""
    if not raising() or (not on_host() and jax.default_backend() == "tpu"):
        return eqx.branched_error_if(token, pred, index, list(messages))
    failure = locate(pred, index)
    if on_host():
        for i, message in enumerate(messages):
            failed = failure.failed & (failure.index == i)
            checkify.check(~failed, CHECKIFY_PREFIX + _literal(message), *failure.numbers())
        return token
    failure = failure.everywhere()
    raises = functools.partial(_raise, tuple(messages))
    if not isinstance(failure.failed, jax.core.Tracer):  # (e.g. `vmap` outside `jit`)
        if failure.failed:
            raises(failure.index, *failure.numbers())
        return token
    jax.lax.cond(
        failure.failed,
        lambda: jax.debug.callback(raises, failure.index, *failure.numbers(), partitioned=True),
        lambda: None,
    )
    return token


class _Failed(eqx.EquinoxRuntimeError):
    """A failed check, raised in the host callback of `branched_error_if`."""


def _raise(messages: tuple[str, ...], index, *numbers) -> None:
    lane, lanes, count, shard, shards = (int(x) for x in numbers)
    raise _Failed(where_text(lane, lanes, count, shard, shards) + messages[int(index)])


class _QuietFailures(logging.Filter):
    """Drops JAX's log record of a callback's error when the error is a failed check: the
    check's message reaches the user in the raised error, without a second traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], _Failed))


logging.getLogger("jax._src.debugging").addFilter(_QuietFailures())


def _literal(message: str) -> str:
    """`message` as a `checkify` format string that prints it unchanged."""
    return message.replace("{", "{{").replace("}", "}}")
