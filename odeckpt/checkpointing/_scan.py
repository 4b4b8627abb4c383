"""`checkpointed_scan`: `lax.scan` whose reverse-mode memory is set by a number of snapshots."""

from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._autodiff import _tree, convert, on_mesh_of_inputs, scan
from . import _host, schedules
from ._loop import EngineLoop, LoopInputs, Stepped
from ._regimes import check_plan, run
from .schedules import Plan


def _length(xs, length) -> int:
    lengths = {int(jnp.shape(x)[0]) for x in jtu.tree_leaves(xs)}
    if length is not None:
        lengths.add(int(length))
    if len(lengths) != 1:
        raise ValueError(
            "checkpointed_scan needs one length: pass xs whose leaves share their leading axis "
            f"or length=...; got lengths {sorted(lengths)}"
        )
    (n,) = lengths
    if n < 1:
        raise ValueError(f"checkpointed_scan needs length >= 1, got {n}")
    return n


def _example_x(xs):
    return None if xs is None else _tree.index(xs, 0)


def _check_body(f, init, x):
    out = jax.eval_shape(f, init, x)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError("the scanned function must return a pair (carry, y); got " + repr(out))
    _tree.check_same_structure(
        "the scanned function", init, out[0],
        "return a carry with the same structure, shapes and dtypes as init (cast with "
        "jnp.asarray(..., dtype) or jax.tree.map if needed)",
    )  # fmt: skip
    return out[1]


def scan_plan(
    f: Callable, init: Any, xs: Any = None, length: int | None = None, *,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None,
    offload: Literal["host"] | None = None,
) -> Plan:  # fmt: skip
    """The `Plan` that `checkpointed_scan` with the same arguments follows.

    Pass it to `checkpointed_scan(f, init, xs, length, plan=...)` to plan once (the plan traces
    the step's VJP to size its residuals).

    **Arguments:**

    - `f`, `init`, `xs`, `length`: as `lax.scan` (`length >= 1`); `f` is traced with
        `jax.eval_shape` only, never run.
    - `checkpoints`, `memory_budget`, `offload`: as `checkpointed_scan`, which describes the
        defaults. With `offload="host"`, raises a `ValueError` on a backend without host
        memory.

    **Returns:**

    A `Plan`: the regime (`"residuals"`, `"states"` or `"binomial"`), the number of
    snapshots, the predicted memory and forward steps, and with `offload` the host level
    (`segment`, `host_checkpoints`, `transfers`).

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> from odeckpt.checkpointing import scan_plan
    >>> p = scan_plan(lambda c, x: (c * x, c), jnp.ones(4), jnp.ones((1000, 4)))
    >>> p.regime
    'residuals'
    >>> p = scan_plan(lambda c, x: (c * x, c), jnp.ones(4), jnp.ones((1000, 4)),
    ...               checkpoints={"device": 4, "host": 10}, offload="host")
    >>> p.offload, p.segment, p.checkpoints, p.host_checkpoints
    ('host', 100, 4, 10)

    ```
    """
    n = _length(xs, length)
    init = _tree.strong(init)
    x = _example_x(xs)
    _check_body(f, init, x)
    step = lambda c, x: f(c, x)[0]
    residuals = jax.eval_shape(lambda c, x: jtu.tree_leaves(jax.vjp(step, c, x)[1]), init, x)
    plan = schedules.plan(n, _tree.nbytes(init), _tree.nbytes(residuals), checkpoints=checkpoints,
                          memory_budget=memory_budget, offload=offload)  # fmt: skip
    if offload is not None:
        _host.check_host_memory("checkpointed_scan")
    return plan


@on_mesh_of_inputs
def checkpointed_scan(
    f: Callable, init: Any, xs: Any = None, length: int | None = None, *,
    checkpoints: int | dict[str, int] | None = None,
    memory_budget: int | str | dict[str, int | str] | None = None,
    offload: Literal["host"] | None = None, plan: Plan | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """`lax.scan` with a reverse pass whose memory you choose: Revolve binomial checkpointing.

    Same semantics as `jax.lax.scan(f, init, xs, length)`: `f(carry, x) -> (carry, y)`, returns
    `(carry, ys)` with `ys` stacked. Snapshots hold the carry only; `ys` are written once into
    their output buffer and never copied into a snapshot.

    **Arguments:**

    - `f`, `init`, `xs`, `length`: as `lax.scan` (`length >= 1`).
    - `checkpoints`: number of carry snapshots `c >= 1` (slot 0 holds `init`). `c >= n` stores
        every carry (each step recomputed once in its VJP); `c < n` follows Revolve with the
        minimal `t(n, c) = r*n - C(c+r, r-1)` forward steps.
    - `memory_budget`: bytes (int) or a string like `"2GB"`, `"512MiB"`: store the VJP
        residuals of every step if they fit (exactly `jax.grad` of `lax.scan`), else every
        carry if they fit, else as many snapshots as fit.
    - Neither: the default budget `schedules.DEFAULT_MEMORY_BUDGET` (64 MiB), at least
        4 snapshots: small states take the fast residual path, large ones stay bounded.
        `scan_plan` reports the choice.
    - `offload`: `"host"` keeps snapshots in host memory (`memory_kind="pinned_host"`), every
        `segment` steps, and reverses each segment on the device by Revolve from its start,
        copied back (one copy each way per segment). Then `checkpoints` and `memory_budget`
        may be dicts `{"device": ..., "host": ...}`; a plain value is the host's; see
        `schedules.plan` for the defaults (device: 4 slots; host: 4 GiB). Raises a
        `ValueError` on a backend without host memory. On CPU host and device memory are the
        same RAM: the schedule runs, nothing is copied.
    - `plan`: a `Plan` made by `scan_plan` for this scan, instead of `checkpoints`,
        `memory_budget` and `offload` (plan once). Raises if both are given, or if the plan
        was made for another length or carry size.

    **Returns:** `(carry, ys)`, differentiable in reverse mode (`jax.grad`, `jax.vjp`: the
    checkpointed reverse sweep) and in forward mode (`jax.jvp`: a forward-mode loop, no
    storage), also under `vmap`.

    **Example:**

    ```python
    >>> import jax, jax.numpy as jnp
    >>> from odeckpt.checkpointing import checkpointed_scan, scan_plan
    >>> def f(c, x):
    ...     c = jnp.sin(c) * x
    ...     return c, c.sum()
    >>> loss = lambda x0: checkpointed_scan(f, x0, jnp.ones((100, 3)), checkpoints=5)[0].sum()
    >>> ref = lambda x0: jax.lax.scan(f, x0, jnp.ones((100, 3)))[0].sum()
    >>> bool(jnp.allclose(jax.grad(loss)(jnp.ones(3)), jax.grad(ref)(jnp.ones(3))))
    True
    >>> host = {"device": 2, "host": 10}  # 10 host snapshots, 2 device slots
    >>> off = lambda x0: checkpointed_scan(
    ...     f, x0, jnp.ones((100, 3)), checkpoints=host, offload="host")[0].sum()
    >>> bool(jnp.allclose(jax.grad(off)(jnp.ones(3)), jax.grad(ref)(jnp.ones(3))))
    True
    >>> plan = scan_plan(f, jnp.ones(3), jnp.ones((100, 3)), checkpoints=5)  # plan once
    >>> planned = lambda x0: checkpointed_scan(f, x0, jnp.ones((100, 3)), plan=plan)[0].sum()
    >>> bool(jnp.allclose(jax.grad(planned)(jnp.ones(3)), jax.grad(ref)(jnp.ones(3))))
    True

    ```

    **References:** Griewank (1992), "Achieving logarithmic growth of temporal and spatial
    complexity in reverse automatic differentiation"; Griewank & Walther (2000), "Algorithm
    799: Revolve", ACM TOMS 26(1); two levels: Stumm & Walther (2009), "MultiStage approaches
    for optimal offline checkpointing", SIAM J. Sci. Comput. 31(3); Aupy & Herrmann (2019),
    "Periodicity in optimal hierarchical checkpointing schemes for adjoint computations".
    """
    if plan is None:
        plan = scan_plan(f, init, xs, length, checkpoints=checkpoints,
                         memory_budget=memory_budget, offload=offload)  # fmt: skip
    else:
        snapshot_bytes, n = _tree.nbytes(_tree.strong(init)), _length(xs, length)
        budget = dict(checkpoints=checkpoints, memory_budget=memory_budget, offload=offload)
        check_plan(plan, "checkpointed_scan", "scan_plan", snapshot_bytes, n, **budget)
        if plan.offload is not None:
            _host.check_host_memory("checkpointed_scan")
    n = plan.steps
    if plan.regime == "residuals":
        return scan(f, init, xs, length=n)
    init = _tree.strong(init)
    x = _example_x(xs)
    y_struct = _check_body(f, init, x)
    params, static = convert(f, init, x)

    def step(params, state, x, i, recorded=None) -> Stepped:
        del recorded
        state, y = eqx.combine(params, static)(state, x)
        return Stepped(state, i[None], jtu.tree_map(lambda a: a[None], y), None)

    buffers = _tree.stack_zeros(y_struct, n)
    return run(EngineLoop(step, None, n), lambda: plan, LoopInputs(params, init, xs, buffers))
