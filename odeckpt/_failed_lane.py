"""Which lane of a batch failed a run-time check, for its message: the first failing lane of the
`vmap`s around the check (counted row-major over nested `vmap`s, outermost first), and inside
`jax.shard_map` the shard that holds it.

Inside the checked function a lane sees only its own predicate; `locate` is a `custom_vmap`
whose batching rule sees every lane's, so each `vmap` around it reduces its lanes to the first
failing one and hands the result to the next `vmap` out.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from ._autodiff import manual_axes, varying
from ._types import BoolScalar, IntScalar


class FailedLane(eqx.Module):
    """Where a check failed: whether any lane did (`failed`), the message `index` of the first
    failing `lane` of `lanes`, how many failed (`count`), and the `shard` of the enclosing
    `jax.shard_map` they are on (0 outside) of `shards` (1 outside). Under a plain `jax.jit`
    every shard agrees on `failed` and names the first failing shard (`everywhere`)."""

    failed: BoolScalar
    index: IntScalar
    lane: IntScalar
    lanes: IntScalar
    count: IntScalar
    shard: IntScalar
    shards: int = eqx.field(static=True)

    def numbers(self) -> tuple:
        """What `where_text` takes, as arrays: `(lane, lanes, count, shard, shards)`."""
        return (self.lane, self.lanes, self.count, self.shard, jnp.int32(self.shards))

    def everywhere(self) -> "FailedLane":
        """Every shard's view of the first failing shard (collectives over the manual axes):
        so that under a plain `jax.jit` every device raises at the same point and none waits
        for another in a collective."""
        axes = manual_axes()
        if not axes:
            return self
        first = jax.lax.pmin(varying(jnp.where(self.failed, self.shard, self.shards)), axes)
        numbers = jnp.stack([self.index, self.lane, self.lanes, self.count, self.shard])
        numbers = jax.lax.psum(varying(jnp.where(self.shard == first, numbers, 0)), axes)
        index, lane, lanes, count, shard = numbers
        return FailedLane(first < self.shards, index, lane, lanes, count, shard, self.shards)


def locate(pred: BoolScalar, index: IntScalar) -> FailedLane:
    """Where `pred` holds first over the lanes of the enclosing `vmap`s and, inside
    `jax.shard_map`, which shard this is; `index` picks the message of the lane."""
    pred, index = jnp.asarray(pred, bool), jnp.asarray(index, jnp.int32)
    failed, index, lane, lanes, count = _reduced(
        pred, index, jnp.int32(0), jnp.int32(1), pred.astype(jnp.int32)
    )
    axes = manual_axes()
    shards = int(np.prod([jax.sharding.get_abstract_mesh().shape[a] for a in axes]))
    shard = jax.lax.axis_index(axes) if axes else jnp.int32(0)
    return FailedLane(failed, index, lane, lanes, count, shard, shards)


@custom_vmap
def _reduced(failed, index, lane, lanes, count):
    """The check's numbers: unchanged for one lane; under `vmap`, `_first_of_lanes`."""
    return failed, index, lane, lanes, count


@_reduced.def_vmap
def _first_of_lanes(axis_size: int, in_batched, *values):
    """The first failing lane of `axis_size`, numbered row-major with the lanes of the `vmap`s
    inside (`lane` of `lanes` each), and the failures summed; handed on to the `vmap`s
    outside by calling `_reduced` again. Only reductions, no indexing: lanes sharded over
    devices stay where they are (one all-reduce each, no gather)."""
    failed, index, lane, lanes, count = (
        x if batched else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
        for x, batched in zip(values, in_batched, strict=True)
    )
    position = jnp.arange(axis_size, dtype=jnp.int32)
    first = jnp.min(jnp.where(failed, position, axis_size))
    at_first = lambda x: jnp.sum(jnp.where(position == first, x, 0), dtype=jnp.int32)
    inner = jnp.max(lanes)  # (the same in every lane)
    reduced = _reduced(
        first < axis_size, at_first(index), first * inner + at_first(lane),
        inner * jnp.int32(axis_size), jnp.sum(count, dtype=jnp.int32),
    )  # fmt: skip
    return reduced, (False,) * 5


def where_text(lane: int, lanes: int, count: int, shard: int, shards: int) -> str:
    """`"Lane 5 of 8 failed: "` (with how many failed, if more than one; on which shard, inside
    `jax.shard_map`), or `""` for a check on a single lane outside `shard_map`."""
    parts = []
    if lanes > 1:
        parts.append(f"Lane {lane} of {lanes}")
    if shards > 1:
        on = f"shard {shard} of {shards} of the jax.shard_map"
        parts.append(f"on {on}" if parts else on.capitalize())
    if not parts:
        return ""
    more = f" (the first of {count} failing lanes)" if count > 1 else ""
    return " ".join(parts) + f" failed{more}: "


CHECKIFY_PREFIX = "[odeckpt lane {} {} {} {} {}] "
"""A `checkify` format prefix for `FailedLane.numbers()`: `readable` turns it into words."""

_PREFIX = re.compile(r"^(at mapped index \d+: )?\[odeckpt lane (\d+) (\d+) (\d+) (\d+) (\d+)\] ")


def readable(message: str) -> str:
    """A `checkify` message that starts with `CHECKIFY_PREFIX`, in words (the
    mapped index `checkify` adds inside `shard_map` is the shard, named there already)."""
    match = _PREFIX.match(message)
    if match is None:
        return message
    numbers = (int(x) for x in match.groups()[1:])
    return where_text(*numbers) + message[match.end() :]
