"""Checkpointed loops for JAX: `checkpointed_scan`, `bounded_while_loop`, and layer stacks
(`checkpoint_layers`, `checkpointed_layers`).

`odeckpt.checkpointing.schedules` (pure Python, imported without JAX) plans the schedules; the
loops here execute them. Plan once with `scan_plan` or `while_loop_plan`, run with `plan=`, and
read what the plan keeps (`Plan.slots`) and recomputes (`recomputed_steps`). Members load lazily
so that importing `schedules` does not import JAX; the public names are the `TYPE_CHECKING`
imports and, for run time, the `_PUBLIC` registry (checked equal by a test).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_namespace

if TYPE_CHECKING:
    from . import schedules as schedules
    from ._checkpoint_layers import checkpoint_layers as checkpoint_layers
    from ._layers import checkpointed_layers as checkpointed_layers
    from ._recomputation import recomputed_steps as recomputed_steps
    from ._scan import checkpointed_scan as checkpointed_scan, scan_plan as scan_plan
    from ._vmap import any_lane as any_lane, lockstep_while_loop as lockstep_while_loop
    from ._while_loop import (
        bounded_while_loop as bounded_while_loop,
        while_loop_plan as while_loop_plan,
    )
    from .schedules import Plan as Plan, parse_memory as parse_memory

_PUBLIC = {
    ".schedules": ("schedules", "Plan", "parse_memory"),
    "._checkpoint_layers": ("checkpoint_layers",),
    "._layers": ("checkpointed_layers",),
    "._recomputation": ("recomputed_steps",),
    "._scan": ("checkpointed_scan", "scan_plan"),
    "._vmap": ("any_lane", "lockstep_while_loop"),
    "._while_loop": ("bounded_while_loop", "while_loop_plan"),
}

__getattr__, __dir__, __all__ = lazy_namespace(__name__, _PUBLIC)
