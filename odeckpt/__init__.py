"""odeckpt: differential equation solvers in JAX with memory-efficient gradients.

Members are imported on first use, so that `odeckpt.checkpointing.schedules` (pure Python) can be
imported without JAX. The public names are listed twice, checked equal by a test: as the imports
under `TYPE_CHECKING` (for type checkers and editors) and as the `_PUBLIC` registry (read at run
time by `_lazy`).
"""

from typing import TYPE_CHECKING

from ._lazy import lazy_namespace

__version__ = "0.1.0"

if TYPE_CHECKING:
    from . import checkpointing as checkpointing, plot as plot
    from ._adjoints import (
        AbstractAdjoint as AbstractAdjoint,
        BacksolveAdjoint as BacksolveAdjoint,
        DirectAdjoint as DirectAdjoint,
        ForwardMode as ForwardMode,
        ForwardSensitivity as ForwardSensitivity,
        InterpolatingAdjoint as InterpolatingAdjoint,
        RecursiveCheckpointAdjoint as RecursiveCheckpointAdjoint,
        ReversibleAdjoint as ReversibleAdjoint,
    )
    from ._ensemble import ensemble as ensemble
    from ._jit import jit as jit
    from ._loop import (
        AbstractAdaptiveController as AbstractAdaptiveController,
        AbstractController as AbstractController,
        ConstantStep as ConstantStep,
        Decision as Decision,
        Event as Event,
        PIDController as PIDController,
    )
    from ._mass_matrix import MassMatrix as MassMatrix
    from ._memory import (
        CompiledMemory as CompiledMemory,
        MemoryReport as MemoryReport,
        compiled_memory as compiled_memory,
        memory_report as memory_report,
    )
    from ._saveat import SaveAt as SaveAt
    from ._solution import Solution as Solution, Stats as Stats
    from ._solve import solve as solve
    from ._status import Status as Status
    from ._steppers import (
        BDF as BDF,
        RK4 as RK4,
        AbstractNewton as AbstractNewton,
        AbstractStepper as AbstractStepper,
        Bosh3 as Bosh3,
        Dopri5 as Dopri5,
        Dopri8 as Dopri8,
        Euler as Euler,
        Heun as Heun,
        ImplicitEuler as ImplicitEuler,
        Kvaerno3 as Kvaerno3,
        Kvaerno4 as Kvaerno4,
        Kvaerno5 as Kvaerno5,
        Midpoint as Midpoint,
        Newton as Newton,
        NewtonKrylov as NewtonKrylov,
        Radau5 as Radau5,
        Ralston as Ralston,
        Reversible as Reversible,
        Rodas5 as Rodas5,
        Trapezoid as Trapezoid,
        Tsit5 as Tsit5,
    )

_PUBLIC = {
    ".checkpointing": ("checkpointing",),
    ".plot": ("plot",),
    "._adjoints": (
        "AbstractAdjoint",
        "BacksolveAdjoint",
        "DirectAdjoint",
        "ForwardMode",
        "ForwardSensitivity",
        "InterpolatingAdjoint",
        "RecursiveCheckpointAdjoint",
        "ReversibleAdjoint",
    ),
    "._loop": (
        "AbstractAdaptiveController",
        "AbstractController",
        "ConstantStep",
        "Decision",
        "Event",
        "PIDController",
    ),
    "._memory": ("CompiledMemory", "MemoryReport", "compiled_memory", "memory_report"),
    "._mass_matrix": ("MassMatrix",),
    "._saveat": ("SaveAt",),
    "._solution": ("Solution", "Stats"),
    "._ensemble": ("ensemble",),
    "._jit": ("jit",),
    "._solve": ("solve",),
    "._status": ("Status",),
    "._steppers": (
        "BDF",
        "RK4",
        "AbstractNewton",
        "AbstractStepper",
        "Bosh3",
        "Dopri5",
        "Dopri8",
        "Euler",
        "Heun",
        "ImplicitEuler",
        "Kvaerno3",
        "Kvaerno4",
        "Kvaerno5",
        "Midpoint",
        "Newton",
        "NewtonKrylov",
        "Radau5",
        "Ralston",
        "Reversible",
        "Rodas5",
        "Trapezoid",
        "Tsit5",
    ),
}

__getattr__, __dir__, __all__ = lazy_namespace(__name__, _PUBLIC)
