"""Differentiation rules of our own, for the checkpointing engine and the adjoints alike: one
custom rule for forward and reverse mode from a pair of sweeps (`differentiable`), a linear
map with a custom transpose (`linear_call`), values that forward mode may not differentiate
(`forward_only`), and the pytree tools they share (`_tree`). Generic JAX, no ODE knowledge."""

from . import _tree as _tree
from ._custom import Sweeps as Sweeps, convert as convert, differentiable as differentiable
from ._linear import (
    NoForwardMode as NoForwardMode,
    forward_only as forward_only,
    linear_call as linear_call,
)
from ._varying import (
    ClosureConverted as ClosureConverted,
    closure_convert as closure_convert,
    cond as cond,
    filled as filled,
    like as like,
    manual_axes as manual_axes,
    mesh_of as mesh_of,
    on_auto_axes as on_auto_axes,
    on_mesh_of_inputs as on_mesh_of_inputs,
    replicated as replicated,
    scan as scan,
    sharded_by_type as sharded_by_type,
    stack as stack,
    switch as switch,
    take as take,
    varying as varying,
    while_loop as while_loop,
)
