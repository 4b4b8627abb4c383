"""Messages for habits from diffrax, scipy and torchdiffeq: their keyword names, argument orders,
vector-field signatures, solver names and objects, each answered with the odeckpt spelling at
call time.

Names are from diffrax's `diffeqsolve`, scipy's `solve_ivp` and torchdiffeq's `odeint`. Objects
of those libraries (and of torch) are recognised by the module of their type, so that checking
costs nothing and imports none of them."""

import inspect
from collections.abc import Callable

import jax
import numpy as np

# keyword -> (where it comes from, the odeckpt spelling)
FOREIGN_KEYWORDS: dict[str, tuple[str, str]] = {
    "terms": ("diffrax", "the vector field is the first argument: `solve(f, y0, (t0, t1), args)`"),
    "t0": ("diffrax", "`t_span=(t0, t1)`"),
    "t1": ("diffrax", "`t_span=(t0, t1)`"),
    "stepsize_controller": (
        "diffrax",
        "`controller=odeckpt.PIDController(...)` (or just `rtol=`/`atol=` on `solve`)",
    ),
    "progress_meter": ("diffrax", "`progress=True`"),
    "solver_state": ("diffrax", "no equivalent: each solve starts afresh"),
    "method": ("scipy / torchdiffeq", "`solver=` (e.g. `solver='dopri5'`)"),
    "t_eval": ("scipy", "`saveat=ts` (an array of times)"),
    "t": ("torchdiffeq", "`t_span=(t[0], t[-1]), saveat=t`"),
    "fun": ("scipy", "the vector field is the first argument, `f(t, y, args)`"),
    "func": ("torchdiffeq", "the vector field is the first argument, `f(t, y, args)`"),
    "first_step": ("scipy", "`dt0=`"),
    "max_step": ("scipy", "`controller=odeckpt.PIDController(dtmax=...)`"),
    "dense_output": ("scipy", "`saveat=odeckpt.SaveAt(dense=True)`, then `sol.evaluate(t)`"),
    "options": ("torchdiffeq", "keywords of `solve` (`dt0=` for a step size)"),
    "adjoint_params": ("torchdiffeq", "the parameters in `args` (all its arrays get gradients)"),
    "vectorized": ("scipy", "`jax.vmap` over `solve` for many problems"),
}

# A solver name of scipy or torchdiffeq -> the odeckpt name (the same method, or the closest).
FOREIGN_SOLVERS: dict[str, str] = {
    "rk45": "dopri5",
    "rk23": "bosh3",
    "dop853": "dopri8",
    "radau": "radau",
    "bdf": "bdf",
    "lsoda": "bdf' or 'radau",
    "fehlberg2": "heun",
    "adaptive_heun": "heun",
    "explicit_adams": "tsit5",
    "implicit_adams": "kvaerno5",
}


def check_call(positional: tuple, keywords: dict) -> None:
    """Raise a `TypeError` naming the odeckpt spelling for positional arguments after `args`
    and for keywords `solve` does not take."""
    if positional:
        raise TypeError(
            f"solve() takes f, y0, t_span and args positionally, and {len(positional)} more "
            "argument(s) were given. Fix: pass the rest by keyword, e.g. "
            "`solve(f, y0, (t0, t1), args, dt0=0.1, solver='tsit5')` (diffrax's "
            "`diffeqsolve(terms, solver, t0, t1, dt0, y0)` order does not apply)."
        )
    for name in keywords:
        if name in FOREIGN_KEYWORDS:
            source, spelling = FOREIGN_KEYWORDS[name]
            raise TypeError(
                f"solve() got the keyword {name}= ({source}'s name). Fix: in odeckpt use "
                f"{spelling}."
            )
    if keywords:
        raise TypeError(
            f"solve() got unexpected keyword(s) {sorted(keywords)}. Fix: see "
            "`help(odeckpt.solve)` for its keywords."
        )


def solver_hint(name: str) -> str:
    """A sentence naming the odeckpt stepper for a scipy or torchdiffeq solver name, or ""."""
    odeckpt_name = FOREIGN_SOLVERS.get(name.lower())
    if odeckpt_name is None:
        return ""
    return f" For scipy's or torchdiffeq's {name!r}, use solver='{odeckpt_name}'."


def check_signature(f) -> None:
    """Raise a `TypeError` naming the fix unless `f` can be called as `f(t, y, args)`."""
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):  # a builtin or a callable without a signature: try it
        return
    try:
        signature.bind(0.0, np.zeros(()), None)
    except TypeError:
        names = [p.name for p in signature.parameters.values()]
        call = ", ".join(names)
        raise TypeError(
            f"The vector field is called as f(t, y, args), but its signature is f({call}). "
            "odeckpt (like diffrax) always passes `args`, after t and y. Fix: "
            "`def f(t, y, args): ...`, or wrap it: "
            f"`solve(lambda t, y, args: {_wrapped_call(names)}, ...)`."
        ) from None


def _wrapped_call(names: list[str]) -> str:
    """How to call a two- or one-argument vector field from `(t, y, args)`."""
    if len(names) == 2 and (names[0].lower().startswith("y") or names[1] == "t"):
        return "f(y, t)"
    if len(names) == 1:
        return "f(y)"
    return "f(t, y)"


def check_list_state(y0) -> None:
    """Raise a `TypeError` if `y0` is a (nested) Python list of numbers: JAX reads a list as a
    pytree of separate scalars, so `f` would receive a list, not an array."""
    if not isinstance(y0, list):
        return
    flat = np.asarray(y0, dtype=object).ravel() if _rectangular(y0) else None
    if flat is not None and all(isinstance(x, int | float | complex) for x in flat):
        raise TypeError(
            f"y0 is a Python list of numbers ({y0!r}); JAX treats a list as a pytree of "
            "separate scalars, so f would receive a list, not an array. Fix: "
            "`y0 = jnp.array([...])` (a float array; add `dtype=jnp.float64` with "
            "`jax_enable_x64`), or a tuple of arrays for a pytree state."
        )


def _rectangular(y0: list) -> bool:
    try:
        np.asarray(y0, dtype=float)
    except (TypeError, ValueError):
        return False
    return True


_ODES_ONLY = "no equivalent: odeckpt solves ordinary differential equations only"
_SAME_NAME = ("Tsit5", "Dopri5", "Dopri8", "Bosh3", "Euler", "Heun")
_TABLE = "docs/migration.md, 'Which odeckpt stepper for each diffrax stepper'"
_STOCHASTIC = (
    "EulerHeun", "ItoMilstein", "StratonovichMilstein", "SRA1", "SEA", "ShARK", "GeneralShARK",
    "SPaRK", "SlowRK", "ShOULD", "QUICSORT", "ALIGN", "ControlTerm", "WeaklyDiagonalControlTerm",
    "UnderdampedLangevinDriftTerm", "UnderdampedLangevinDiffusionTerm", "VirtualBrownianTree",
    "UnsafeBrownianPath",
)  # fmt: skip


def _imex(order: int) -> str:
    return (
        "odeckpt has no implicit-explicit splitting: solve one vector field, the sum of the "
        f"terms, with `solver=odeckpt.Kvaerno{order}()` (the same order) or "
        f"`solver=odeckpt.Radau5()` ({_TABLE})"
    )


# A diffrax class name -> the odeckpt equivalent (those computed from the object: `_DESCRIBED`).
DIFFRAX_EQUIVALENTS: dict[str, str] = {
    "RecursiveCheckpointAdjoint": (
        "`adjoint=odeckpt.RecursiveCheckpointAdjoint(checkpoints=...)`, or `adjoint='recursive'` "
        "(the default)"
    ),
    "DirectAdjoint": (
        "`adjoint=odeckpt.DirectAdjoint()` (or 'direct'); its memory grows with `max_steps`, "
        "and the default 'recursive' differentiates the same discrete solve"
    ),
    "BacksolveAdjoint": (
        "`adjoint=odeckpt.BacksolveAdjoint()` (or 'backsolve'); on stiff or chaotic problems "
        "the default 'recursive' is safer (docs/which-adjoint.md)"
    ),
    "ForwardMode": "`adjoint=odeckpt.ForwardMode()` (or 'forward')",
    "ImplicitAdjoint": (
        "no equivalent (odeckpt has no steady-state adjoint): use the default `adjoint='recursive'`"
    ),
    **{name: f"`solver=odeckpt.{name}()`" for name in _SAME_NAME},
    **{
        name: (
            f"`solver=odeckpt.{name}()` with `controller=odeckpt.ConstantStep()` (it has no "
            "error estimate in odeckpt); for adaptive steps `solver=odeckpt.Heun()`"
        )
        for name in ("Midpoint", "Ralston")
    },
    "ImplicitEuler": (
        "`solver=odeckpt.ImplicitEuler()` with `controller=odeckpt.ConstantStep()`; for "
        f"adaptive steps `solver=odeckpt.Radau5()` ({_TABLE})"
    ),
    **{
        name: (
            f"`solver=odeckpt.{name}()` at loose tolerances (`rtol >= 1e-4`); "
            f"`solver=odeckpt.Radau5()` for accurate solutions and gradients ({_TABLE})"
        )
        for name in ("Kvaerno3", "Kvaerno4")
    },
    "Kvaerno5": (
        "`solver=odeckpt.Radau5()` for accurate gradients of a stiff problem; "
        f"`solver=odeckpt.Kvaerno5()` when the Jacobian is costly ({_TABLE})"
    ),
    **{name: _imex(int(name[-1])) for name in ("KenCarp3", "KenCarp4", "KenCarp5", "Sil3")},
    "ReversibleHeun": (
        "`solver=odeckpt.Reversible(odeckpt.Heun())` (or `odeckpt.Reversible(odeckpt.Tsit5())`) "
        "with `adjoint='reversible'`"
    ),
    **{
        name: (
            "no counterpart: `solver=odeckpt.Heun()` or `solver=odeckpt.Tsit5()` on the whole state"
        )
        for name in ("LeapfrogMidpoint", "SemiImplicitEuler")
    },
    "HalfSolver": (
        "the wrapped solver's odeckpt equivalent (odeckpt's steppers estimate their own error)"
    ),
    **{name: _ODES_ONLY for name in _STOCHASTIC},
    "ConstantStepSize": "`controller=odeckpt.ConstantStep()`, with `dt0=`",
    "StepTo": (
        "no equivalent: `controller=odeckpt.ConstantStep()` with `dt0=` for even steps, or "
        "`jump_ts=ts` (a keyword of `solve`) for adaptive steps that land on given times"
    ),
    "ClipStepSizeController": (
        "`jump_ts=` (a keyword of `solve`: steps land on those times), with `rtol=`/`atol=`"
    ),
    "MultiTerm": (
        "one vector field, the sum of the terms' fields: "
        "`lambda t, y, args: f1(t, y, args) + f2(t, y, args)`"
    ),
    "TqdmProgressMeter": "`progress=True`",
    "TextProgressMeter": "`progress=True`",
    "NoProgressMeter": "`progress=False`",
    "Event": (
        "`event=odeckpt.Event(fn)`, with `fn(t, y, args)` a real number whose sign change is "
        "the event (a boolean `cond_fn` has no crossing to locate)"
    ),
    "DiscreteTerminatingEvent": "a terminal `event=odeckpt.Event(fn)` (see `help(odeckpt.Event)`)",
    "SteadyStateEvent": (
        "no steady-state event: a terminal `event=odeckpt.Event(fn)` whose `fn` crosses zero "
        "where the vector field's norm falls below a threshold"
    ),
}


def _ode_term(term) -> str:
    field = getattr(term, "vector_field", None)
    name = getattr(field, "__name__", "<lambda>")
    shown = name if name.isidentifier() else "term.vector_field"
    return (
        f"the vector field itself, `odeckpt.solve({shown}, y0, (t0, t1), args)`: odeckpt calls "
        "it as f(t, y, args), as diffrax does"
    )


def _pid_controller(controller) -> str:
    given = [
        f"{name}={value!r}"
        for name in ("rtol", "atol")
        if isinstance(value := getattr(controller, name, None), int | float)
    ]
    keywords = ", ".join(given) or "rtol=..., atol=..."
    return (
        f"`odeckpt.solve(..., {keywords})`, or `controller=odeckpt.PIDController(...)`, which "
        "takes diffrax's pcoeff, icoeff, dcoeff, dtmin, dtmax, factormin, factormax and safety; "
        "diffrax's `jump_ts=` is a keyword of `solve`"
    )


def _save_at(saveat) -> str:
    subs = getattr(saveat, "subs", saveat)  # a SubSaveAt is its own
    if isinstance(subs, list | tuple | dict):
        return (
            "`saveat=odeckpt.SaveAt(t0=..., ts=..., steps=..., t1=..., dense=...)`: one set of "
            "points (nested `subs=` have no equivalent; solve once per set)"
        )
    flags = [("t0", "t0=True"), ("ts", "ts=ts"), ("steps", "steps=True"), ("t1", "t1=True")]
    keywords = [shown for name, shown in flags if _present(getattr(subs, name, None))]
    if getattr(saveat, "dense", False):
        keywords.append("dense=True")
    fn = getattr(getattr(subs, "fn", None), "__name__", "save_y")
    after = "" if fn == "save_y" else f" (odeckpt saves y: apply `{fn}` to `sol.ys` afterwards)"
    return f"`saveat=odeckpt.SaveAt({', '.join(keywords) or 't1=True'})`{after}"


def _present(value) -> bool:
    """Whether a diffrax `SubSaveAt` field asks for points (`ts` an array, flags true)."""
    return value is not None and (not isinstance(value, bool | int) or bool(value))


_DESCRIBED: dict[str, Callable[[object], str]] = {
    "ODETerm": _ode_term,
    "PIDController": _pid_controller,
    "SaveAt": _save_at,
    "SubSaveAt": _save_at,
}


def check_objects(**arguments) -> None:
    """Raise a `TypeError` naming the odeckpt equivalent if one of `solve`'s `arguments` (by
    keyword) is an object of diffrax, scipy or torch (or holds one: the leaves of `y0`, the
    events of a tuple)."""
    for argument, value in arguments.items():
        for item in _items(argument, value):
            fix = _equivalent(item, argument)
            if fix is not None:
                raise TypeError(
                    f"{argument}={_shown(item)} comes from {_library(item)}, whose objects "
                    f"odeckpt does not take. Fix: {fix}."
                )


def _items(argument: str, value) -> list:
    if argument == "y0":
        return jax.tree.leaves(value)
    return list(value) if isinstance(value, tuple | list) else [value]


def _library(value) -> str | None:
    """The library an object (or a class) comes from, by its module: diffrax, scipy or torch."""
    kind = value if isinstance(value, type) else type(value)
    root = kind.__module__.split(".")[0]
    return root if root in ("diffrax", "scipy", "torch", "torchdiffeq") else None


def _shown(value) -> str:
    """How the user likely spelled `value`: `diffrax.Tsit5(...)`, `scipy.integrate.RK45`."""
    kind = value if isinstance(value, type) else type(value)
    module = kind.__module__.split(".")[0]
    if kind.__module__.startswith("scipy.integrate"):
        module = "scipy.integrate"
    return f"{module}.{kind.__name__}{'' if isinstance(value, type) else '(...)'}"


def _equivalent(value, argument: str) -> str | None:
    """What to pass instead of a foreign `value` given as `argument`, or `None` if it is not
    foreign."""
    library = _library(value)
    if library is None:
        return None
    name = value.__name__ if isinstance(value, type) else type(value).__name__
    if library == "diffrax":
        if name in _DESCRIBED and not isinstance(value, type):
            return _DESCRIBED[name](value)
        return DIFFRAX_EQUIVALENTS.get(
            name, f"odeckpt has no {name}: see `help(odeckpt.solve)` for what `{argument}=` takes"
        )
    if library == "scipy" and name.lower() in FOREIGN_SOLVERS:
        return f"`solver='{FOREIGN_SOLVERS[name.lower()]}'`"
    if argument == "f":
        return (
            "a JAX function `f(t, y, args)`; a network inside it is an equinox module (e.g. "
            "`equinox.nn.MLP`) passed in `args`"
        )
    if argument == "y0":
        return "JAX arrays, e.g. `jnp.asarray(y0.detach().cpu().numpy())` for a torch tensor"
    return f"see `help(odeckpt.solve)` for what `{argument}=` takes"
