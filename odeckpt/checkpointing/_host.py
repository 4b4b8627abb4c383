"""Snapshots in host memory: one `[slots, ...]` buffer per leaf, written and read a slot at a time.

Each buffer lives in the host memory space (`jax.memory.Space.Host`, "pinned_host"); a store
moves one snapshot there (`jax.device_put`) and writes it with a `dynamic_update_slice`, a load
reads one slot with a `dynamic_slice` and moves it back to the device. That is the pattern
XLA's host offloader turns into direct copies between device and host memory (no compute may
touch a host buffer, so the buffers never pass through a `lax.cond`). On XLA:CPU the host and
device memory spaces are the same RAM and `device_put` to the host lowers to nothing.

Under `vmap` JAX would batch a `dynamic_update_slice` into a `scatter` (and a `dynamic_slice`
into a `gather`), which the host offloader does not treat as a copy. The three operations are
`custom_vmap`s that keep the batch axes in front of the slot axis and stay slices: the buffer of
a batched loop is `[batch, slots, ...]`, written at `(0, j, 0, ...)`.
"""

import functools

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.custom_batching import custom_vmap

from .schedules import MIN_HOST_SLOTS

HOST_MEMORY_KIND = "pinned_host"


def check_host_memory(where: str, device=None) -> None:
    """Raise a `ValueError` naming the fix if `device` (default: the default device) has no
    host memory kind."""
    device = jax.devices()[0] if device is None else device
    kinds = sorted(memory.kind for memory in device.addressable_memories())
    if HOST_MEMORY_KIND not in kinds:
        raise ValueError(
            f"{where}: offload='host' needs a backend with a {HOST_MEMORY_KIND!r} memory kind; "
            f"device {device} ({device.platform}) has the memory kinds {kinds}. Fix: leave out "
            "offload (snapshots stay in device memory), or run on a backend with host memory "
            "(CPU, GPU, TPU)"
        )


def allocate(template, slots: int, witness):
    """Host buffers `[max(slots, MIN_HOST_SLOTS), *leaf.shape]` for the leaves of `template`
    (contents unspecified).

    Under `vmap` every buffer is batched as soon as `template` or `witness` (whatever the
    stored values are computed from) is, so that a store never broadcasts a host buffer.
    """
    batched_any = _any_batched(witness)
    slots = max(slots, MIN_HOST_SLOTS)
    return jtu.tree_map(lambda x: _allocate(0, slots)(x, batched_any), template)


def store(buffers, value, j):
    """`buffers[j] = value` leaf-wise, moving `value` to host memory (`j` unbatched)."""
    return jtu.tree_map(lambda b, v: _store(0)(b, v, j), buffers, value)


def load(buffers, j):
    """`buffers[j]` leaf-wise, moved to device memory (`j` unbatched)."""
    return jtu.tree_map(lambda b: _load(0)(b, j), buffers)


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device)


def _any_batched(tree):
    """A scalar that is batched (under `vmap`) exactly when some leaf of `tree` is."""
    flags = [jnp.zeros((), jnp.bool_)]
    flags += [_batched_flag(x) for x in jtu.tree_leaves(tree) if isinstance(x, jax.Array)]
    return functools.reduce(jnp.logical_or, flags)


@custom_vmap
def _batched_flag(x):
    del x
    return jnp.zeros((), jnp.bool_)


@_batched_flag.def_vmap
def _batched_flag_rule(axis_size, in_batched, x):
    (batched,) = in_batched
    if not batched:
        return _batched_flag(x), False
    # Called again on `x`, so that an enclosing `vmap` over `x` batches the flag too.
    return jnp.broadcast_to(_batched_flag(x), (axis_size,)), True


@functools.cache
def _allocate(lead: int, slots: int):
    """Allocate a buffer whose slot axis sits after `lead` batch axes."""

    @custom_vmap
    def allocate(x, flag):
        del flag
        shape = (*x.shape[:lead], slots, *x.shape[lead:])
        return _to_host(jnp.zeros(shape, x.dtype))

    @allocate.def_vmap
    def rule(axis_size, in_batched, x, flag):
        x_batched, flag_batched = in_batched
        if not (x_batched or flag_batched):
            return _allocate(lead, slots)(x, flag), False
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        if not flag_batched:
            flag = jnp.broadcast_to(flag, (axis_size,))
        return _allocate(lead + 1, slots)(x, flag), True

    return allocate


@functools.cache
def _store(lead: int):
    """Write slot `j` of a buffer whose slot axis sits after `lead` batch axes."""

    @custom_vmap
    def store(buffer, value, j):
        update = _to_host(jnp.expand_dims(value.astype(buffer.dtype), lead))
        start = [jnp.zeros((), jnp.int32)] * buffer.ndim
        start[lead] = jnp.asarray(j, jnp.int32)
        return lax.dynamic_update_slice(buffer, update, start)

    @store.def_vmap
    def rule(axis_size, in_batched, buffer, value, j):
        buffer_batched, value_batched, j_batched = in_batched
        _check_unbatched(j_batched)
        if not (buffer_batched or value_batched):
            return _store(lead)(buffer, value, j), False
        if not value_batched:  # on the device: cheap
            value = jnp.broadcast_to(value, (axis_size, *value.shape))
        if not buffer_batched:  # not reached from `allocate`, which batches the buffers
            buffer = _to_host(jnp.broadcast_to(_to_device(buffer), (axis_size, *buffer.shape)))
        return _store(lead + 1)(buffer, value, j), True

    return store


@functools.cache
def _load(lead: int):
    """Read slot `j` of a buffer whose slot axis sits after `lead` batch axes."""

    @custom_vmap
    def load(buffer, j):
        start = [jnp.zeros((), jnp.int32)] * buffer.ndim
        start[lead] = jnp.asarray(j, jnp.int32)
        sizes = (*buffer.shape[:lead], 1, *buffer.shape[lead + 1 :])
        return _to_device(jnp.squeeze(lax.dynamic_slice(buffer, start, sizes), lead))

    @load.def_vmap
    def rule(axis_size, in_batched, buffer, j):
        del axis_size
        buffer_batched, j_batched = in_batched
        _check_unbatched(j_batched)
        return _load(lead + 1 if buffer_batched else lead)(buffer, j), buffer_batched

    return load


def _check_unbatched(j_batched: bool) -> None:
    if j_batched:
        raise NotImplementedError(
            "odeckpt internal error: a host snapshot slot index is batched; the checkpoint "
            "schedule must stay unbatched under vmap"
        )
