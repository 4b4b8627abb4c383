"""The engine with two memory levels: snapshots every `segment` steps in host memory, Revolve on
the device within each segment (`schedules.offload_cost`, `schedules.simulate_offload`).

Both sweeps are two nested loops whose outer loop moves exactly one snapshot between host and
device per iteration, unconditionally: a host buffer is only ever written by a
`dynamic_update_slice` of a value just moved to the host and read by a `dynamic_slice` moved
straight back, outside every `lax.cond` (see `_host`). The inner loops are the single-level
engine's: the forward one holds one step function, the reverse one `reverse_body` (one step
and one VJP).
"""

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._autodiff import _tree, while_loop
from . import _host
from ._loop import (
    EngineLoop,
    LoopInputs,
    Reversal,
    initial_cotangents,
    reporting_while_loop,
    reverse_body,
    step_forward,
)

_INT = jnp.int32


class HostSnapshots(NamedTuple):
    """What the two-level forward sweep leaves for the reverse sweep: the number of steps run,
    the state before the last step, the host buffers (a snapshot per segment), and as
    `_loop.Snapshots` the `tape` of recorded decisions and the `final` state (or `None`)."""

    steps: jax.Array
    held: Any
    host: Any
    tape: Any
    final: Any


class _Segments(NamedTuple):
    """The two-level forward sweep's outer carry (see `_loop._Forward`)."""

    i: jax.Array
    state: Any
    prev: Any
    host: Any
    buffers: Any
    pred: jax.Array
    tape: Any
    target: Any  # the progress target (`_loop.reporting_while_loop`), or `None`


class _Steps(NamedTuple):
    """The carry of the steps within one segment."""

    i: jax.Array
    state: Any
    prev: Any
    buffers: Any
    pred: jax.Array
    tape: Any


def forward(loop: EngineLoop, inputs: LoopInputs, segment: int, slots: int):
    """Run the loop, storing the state at positions `0, segment, 2 segment, ...` in host memory
    (`slots` snapshots). Returns `((state, buffers), saved)`, `saved` the `HostSnapshots`."""
    params, init, xs, buffers = inputs
    tape = None if loop.decisions is None else _tree.stack_zeros(loop.decisions, loop.tape_length)
    host = _host.allocate(loop.packed(params, init), slots, (init, params, xs))
    pred = loop.predicate(params, init)

    def run_segment(carry: _Segments) -> _Segments:
        # The segment's start goes to the host only now that its first step is known to run.
        host = _host.store(carry.host, loop.packed(params, carry.state), carry.i // segment)
        stop = jnp.minimum(carry.i + segment, loop.steps)
        steps = _Steps(carry.i, carry.state, carry.prev, carry.buffers, carry.pred, carry.tape)
        within = lambda steps: steps.i < stop
        steps, target = reporting_while_loop(
            loop, params, partial(step_forward, loop, params, xs), steps, carry.target, within
        )
        return _Segments(steps.i, steps.state, steps.prev, host, steps.buffers, steps.pred,
                         steps.tape, target)  # fmt: skip

    target = None if loop.progress is None else loop.progress.report(params, init)
    carry = _Segments(jnp.array(0, _INT), init, init, host, buffers, pred, tape, target)
    carry = while_loop(lambda carry: loop.running(carry.i, carry.pred), run_segment, carry)
    final = carry.state if loop.checks_chain else None
    saved = HostSnapshots(carry.i, carry.prev, carry.host, carry.tape, final)
    return (carry.state, carry.buffers), saved


class _SegmentReversal(NamedTuple):
    """The two-level reverse sweep's outer carry: segment `j` is next (see `_loop.Reversal`)."""

    end: jax.Array
    cur: jax.Array
    j: jax.Array
    held: Any
    snaps: Any
    cts: LoopInputs


def reverse(
    loop: EngineLoop, inputs: LoopInputs, saved: HostSnapshots, ct_out, segment: int,
    checkpoints: int, binomials: np.ndarray | None, want: LoopInputs,
) -> LoopInputs:  # fmt: skip
    """Reverse the segments last to first: copy the segment's start from the host into device
    slot 0, then run the single-level reverse sweep down to it with `checkpoints` device slots
    and Revolve's `binomials` for one segment (`None` for one-step segments: no advance).

    Returns the cotangents of `inputs` as `_loop.reverse`.
    """
    c = checkpoints
    perm = jnp.arange(c, dtype=_INT)
    body = reverse_body(loop, inputs, saved, c, binomials, perm, want)
    snaps = _tree.stack_zeros(loop.packed(inputs.params, saved.held), c)

    def run_segment(carry: _SegmentReversal) -> _SegmentReversal:
        bottom = carry.j * segment
        snaps = _tree.update(carry.snaps, _host.load(saved.host, carry.j), 0)
        stack = jnp.full((c,), -1, _INT).at[0].set(bottom)
        one = jnp.array(1, _INT)
        inner = Reversal(carry.end, carry.cur, one, stack, carry.held, snaps, carry.cts)
        inner = while_loop(lambda inner: inner.end > bottom, body, inner)
        return _SegmentReversal(inner.end, inner.cur, carry.j - 1, inner.held, inner.snaps,
                                inner.cts)  # fmt: skip

    n = saved.steps
    cts = initial_cotangents(inputs, ct_out, want)
    carry = _SegmentReversal(n, n - 1, (n - 1) // segment, saved.held, snaps, cts)
    return while_loop(lambda carry: carry.end > 0, run_segment, carry).cts
