"""The engine with two memory levels: snapshots every `segment` steps in host memory, Revolve on
the device within each segment (`schedules.offload_cost`, `schedules.simulate_offload`).

Both sweeps are two nested loops whose outer loop moves exactly one snapshot between host and
device per iteration, unconditionally: a host buffer is only ever written by a
`dynamic_update_slice` of a value just moved to the host and read by a `dynamic_slice` moved
straight back, outside every `lax.cond` (see `_host`). The inner loops are the single-level
engine's: the forward one holds one step function, the reverse one `reverse_body` (one step
and one VJP), so compile time depends on neither `n` nor `segment`.
"""

import jax.numpy as jnp
from jax import lax

from . import _host, _tree
from ._loop import Loop, cotangent_zeros, reverse_body
from ._vmap import any_lane
from .schedules import offline_schedule

_INT = jnp.int32


def forward(loop: Loop, params, init, xs, buffers, segment: int, slots: int):
    """Run the loop, storing the state at positions `0, segment, 2 segment, ...` in host memory.

    Returns `(state, buffers, residuals)`; `residuals = (n, held, host, tape)`: the number of
    steps run, the state before the last step, the host buffers (`slots` snapshots) and each
    step's recorded decisions or `None`.
    """
    record = loop.decisions is not None
    tape = _tree.stack_zeros(loop.decisions, loop.steps) if record else None
    host = _host.allocate(loop.packed(params, init), slots, (init, params, xs))
    pred = jnp.array(True) if loop.cond is None else loop.cond(params, init)

    def going(i, pred):
        going = i < loop.steps
        return going if loop.cond is None else going & any_lane(pred)

    def run_segment(carry):
        i, state, prev, host, buffers, pred, tape = carry
        # The segment's start goes to the host only now that its first step is known to run.
        host = _host.store(host, loop.packed(params, state), i // segment)
        stop = jnp.minimum(i + segment, loop.steps)

        def body(inner):
            i, state, _, buffers, _, tape = inner
            new, idx, values, made = loop.step(params, state, _x(xs, i), i)
            buffers = _tree.write(buffers, idx, values)
            if record:
                tape = _tree.update(tape, made, i)
            pred = jnp.array(True) if loop.cond is None else loop.cond(params, new)
            return i + 1, new, state, buffers, pred, tape

        inner = (i, state, prev, buffers, pred, tape)
        inner = lax.while_loop(lambda c: (c[0] < stop) & going(c[0], c[4]), body, inner)
        i, state, prev, buffers, pred, tape = inner
        return i, state, prev, host, buffers, pred, tape

    carry = (jnp.array(0, _INT), init, init, host, buffers, pred, tape)
    carry = lax.while_loop(lambda c: going(c[0], c[5]), run_segment, carry)
    n, state, held, host, buffers, _, tape = carry
    return state, buffers, (n, held, host, tape)


def reverse(
    loop: Loop, params, xs, residuals, ct_state, ct_buffers, segment: int, checkpoints: int,
    want: tuple[bool, bool] = (True, True),
):  # fmt: skip
    """Reverse the segments last to first: copy the segment's start from the host into device
    slot 0, then run the single-level reverse sweep down to it with `checkpoints` device slots.

    Returns `(ct_params, ct_init, ct_xs, ct_buffers)` as `_loop.reverse`.
    """
    n, held, host, tape = residuals
    c = checkpoints
    ct_params, ct_xs = cotangent_zeros(params, xs, want)
    perm = jnp.arange(c, dtype=_INT)
    # Revolve on each segment from its start, the only state stored in it (with a slot for
    # every step of the segment too: the sweep must still advance); one-step segments have
    # nothing to advance
    binomials = offline_schedule(segment, c).binomials if segment > 1 else None
    body = reverse_body(loop, params, xs, tape, c, binomials, perm, want)
    snaps = _tree.stack_zeros(loop.packed(params, held), c)

    def run_segment(carry):
        end, cur, j, held, snaps, ct_state, ct_params, ct_xs, ct_buffers = carry
        bottom = j * segment
        snaps = _tree.update(snaps, _host.load(host, j), 0)
        stack = jnp.full((c,), -1, _INT).at[0].set(bottom)
        inner = (end, cur, jnp.array(1, _INT), stack, held, snaps, ct_state, ct_params, ct_xs,
                 ct_buffers)  # fmt: skip
        inner = lax.while_loop(lambda inner: inner[0] > bottom, body, inner)
        end, cur, _, _, held, snaps, ct_state, ct_params, ct_xs, ct_buffers = inner
        return end, cur, j - 1, held, snaps, ct_state, ct_params, ct_xs, ct_buffers

    last = (n - 1) // segment
    carry = (n, n - 1, last, held, snaps, ct_state, ct_params, ct_xs, ct_buffers)
    out = lax.while_loop(lambda carry: carry[0] > 0, run_segment, carry)
    ct_state, ct_params, ct_xs, ct_buffers = out[5:]
    return ct_params, ct_state, ct_xs, ct_buffers


def _x(xs, i):
    return None if xs is None else _tree.index(xs, i)
