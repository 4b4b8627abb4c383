"""The engine's sweeps carry a loop's state raveled (`_tree.Raveled`): its small leaves as one
vector per dtype.

A while loop's carry costs XLA a copy per leaf wherever the body reads a state it also
overwrites (the forward sweep keeps the state before the step, the reverse sweep the state in
hand), and each copy, store and restore is a kernel of its own. Raveled, a step state of a
dozen scalars and small arrays is a few arrays, so these cost a few kernels per step. The
raveling is exact (slices and concatenations), so the sweeps compute the same values; large
leaves stay whole.
"""

import dataclasses

from .._autodiff import _tree
from ._loop import EngineLoop, LoopInputs, Stepped


def flat_loop(loop: EngineLoop) -> EngineLoop:
    """`loop` over raveled states: its `step` and `cond` take a `Raveled` state (and `step`
    returns one), and its snapshots hold what `loop`'s do. The reverse sweep differentiates
    `loop`'s own steps (`EngineLoop.unraveled`)."""
    pack, unpack, loop_cond = loop.pack, loop.unpack, loop.cond

    def step(params, flat, x, i, recorded=None) -> Stepped:
        stepped = loop.step(params, flat.unravel(), x, i, recorded)
        return stepped._replace(state=_tree.ravel(stepped.state))

    cond = None
    if loop_cond is not None:
        cond = lambda params, flat: loop_cond(params, flat.unravel())
    flat_pack = flat_unpack = None
    if pack is not None:
        flat_pack = lambda params, flat: pack(params, flat.unravel())
    if unpack is not None:
        flat_unpack = lambda params, packed: _tree.ravel(unpack(params, packed))
    elif pack is not None:
        flat_unpack = lambda params, state: _tree.ravel(state)
    progress = None if loop.progress is None else loop.progress.raveled()
    return dataclasses.replace(
        loop, step=step, cond=cond, pack=flat_pack, unpack=flat_unpack, progress=progress,
        unraveled=loop,
    )  # fmt: skip


def flat_inputs(inputs: LoopInputs) -> LoopInputs:
    """`inputs` with the initial state raveled."""
    return inputs._replace(init=_tree.ravel(inputs.init))


def flat_out(out):
    """A sweep's `(state, buffers)` with the raveled state rebuilt."""
    state, buffers = out
    return state.unravel(), buffers
