"""Messages for habits from diffrax, scipy and torchdiffeq: their keyword names, argument orders,
vector-field signatures and solver names, each answered with the odeckpt spelling at call time.

Names are from diffrax's `diffeqsolve`, scipy's `solve_ivp` and torchdiffeq's `odeint`."""

import inspect

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
