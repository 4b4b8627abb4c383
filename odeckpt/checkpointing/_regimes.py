"""How a loop in the engine's normal form is differentiated under a `Plan`: its regime's sweeps.

- `residuals`: `jax.vjp` of a masked `lax.scan` stores every step's VJP residuals (while loops;
    scans use `lax.scan` itself, see `checkpointed_scan`).
- `states`, `binomial`: snapshots of the state, replayed by the reverse sweep (`_loop`).
- `offload="host"`: snapshots every `segment` steps in host memory, Revolve on the device
    between them (`_offload`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .._autodiff import Sweeps, _tree, cond, differentiable, scan
from . import _loop, _offload
from ._flat import flat_inputs, flat_loop, flat_out
from ._loop import EngineLoop, LoopInputs
from ._vmap import any_lane
from .schedules import Plan


def run(loop: EngineLoop, make_plan: Callable[[], Plan], inputs: LoopInputs):
    """Run `loop` on `inputs`, returning `(state, buffers)`, differentiable in both modes as
    the plan says; `make_plan()` makes it, and is called only when the run is differentiated.
    """

    def sweeps() -> Sweeps:
        plan = make_plan()
        if plan.regime == "residuals":
            return _residuals(loop)
        if plan.offload is not None:
            return _offloaded(loop, plan)
        return _snapshots(loop, plan)

    primal = lambda inputs: _loop.forward(loop, inputs, None)[0]
    # A while loop's derivatives are while loops too, which JAX cannot transpose.
    error = None if loop.cond is None else SECOND_ORDER_ERROR
    return differentiable(primal, sweeps, inputs, second_order_error=error)


SECOND_ORDER_ERROR = (
    "Reverse-mode differentiation of a derivative of a while loop (an adaptive "
    "`odeckpt.solve`, `bounded_while_loop`), as `jax.jacrev(jax.jacfwd(f))` or "
    "`jax.grad(jax.grad(f))` take it, is not supported: the derivative runs a while loop, which "
    "JAX cannot reverse. Fix: take second derivatives forward over reverse, "
    "`jax.jacfwd(jax.jacrev(f))` or `jax.hessian(f)`."
)


def check_plan(plan, where: str, maker: str, snapshot_bytes: int, steps: int | None = None,
               **budget) -> None:  # fmt: skip
    """Raise, naming the fix, unless `plan` is a `Plan` that `maker` made for this loop (its
    snapshots of `snapshot_bytes`, its `steps` if given), passed without the arguments it was
    made from (`budget`: their values, `None` where not given)."""
    given = [name for name, value in budget.items() if value is not None]
    if given:
        raise ValueError(
            f"{where} takes plan= or {', '.join(given)}, not both: the plan already holds "
            f"them. Fix: pass them to {maker}(...) and only plan= here, or leave out plan="
        )
    fix = f"make the plan with {maker}(...) for this loop"
    if not isinstance(plan, Plan):
        raise TypeError(f"{where}: plan must be a Plan, as {maker}(...) returns; got {plan!r}")
    if steps is not None and plan.steps != steps:
        raise ValueError(
            f"{where}: the plan was made for {plan.steps} steps and this loop runs {steps}; {fix}"
        )
    if plan.snapshot_bytes != max(snapshot_bytes, 1):
        raise ValueError(
            f"{where}: the plan was made for snapshots of {plan.snapshot_bytes} bytes and this "
            f"loop's hold {snapshot_bytes} (another init or snapshot=); {fix}"
        )


def _flat(sweeps: Sweeps) -> Sweeps:
    """`sweeps` of a `flat_loop`, taking and returning the loop's own states."""

    def forward(inputs: LoopInputs):
        out, saved = sweeps.forward(flat_inputs(inputs))
        return flat_out(out), saved

    def reverse(inputs: LoopInputs, saved, ct_out, want: LoopInputs) -> LoopInputs:
        # The reverse sweep's cotangents have the structure of the loop's own states.
        return sweeps.reverse(flat_inputs(inputs), saved, ct_out, want)

    return Sweeps(forward, reverse)


def _snapshots(loop: EngineLoop, plan: Plan) -> Sweeps:
    """The states and binomial regimes: the schedule's snapshots, replayed backwards."""
    packed = loop.pack_state
    if packed:
        loop = flat_loop(loop)
    schedule, c = plan.schedule, plan.checkpoints
    # In the states regime every state is stored: nothing to split or advance.
    binomials = None
    if plan.regime == "binomial":
        assert schedule is not None  # planned in the binomial regime
        binomials = schedule.binomials
    sweeps = Sweeps(
        lambda inputs: _loop.forward(loop, inputs, schedule),
        lambda inputs, saved, ct_out, want: _loop.reverse(
            loop, inputs, saved, ct_out, c, binomials, want
        ),
    )
    return _flat(sweeps) if packed else sweeps


def _offloaded(loop: EngineLoop, plan: Plan) -> Sweeps:
    """Snapshots every `plan.segment` steps in host memory, Revolve on the device between."""
    segment, c = plan.segment, plan.checkpoints
    assert segment is not None and plan.schedule is not None  # planned with `offload`
    # Each segment is reversed from its start, the only state stored in it (whatever the
    # regime): only one-step segments have nothing to advance.
    binomials = plan.schedule.binomials if segment > 1 else None
    return Sweeps(
        lambda inputs: _offload.forward(loop, inputs, segment, plan.host_checkpoints),
        lambda inputs, saved, ct_out, want: _offload.reverse(
            loop, inputs, saved, ct_out, segment, c, binomials, want
        ),
    )


def _residuals(loop: EngineLoop) -> Sweeps:
    """The VJP residuals of every step: `jax.vjp` of a masked `lax.scan`."""

    def forward(inputs: LoopInputs):
        masked = lambda params, init, buffers: _masked_scan(loop, params, init, buffers)
        return jax.vjp(masked, inputs.params, inputs.init, inputs.buffers)

    def reverse(inputs: LoopInputs, vjp_fn, ct_out, want: LoopInputs) -> LoopInputs:
        del inputs, want
        ct_params, ct_init, ct_buffers = _tree.split_inexact(vjp_fn(ct_out))[0]
        return LoopInputs(ct_params, ct_init, None, ct_buffers)

    return Sweeps(forward, reverse)


class _Masked(NamedTuple):
    """The carry of `_masked_scan`: step `i` is next, `pred` the loop predicate on `state`."""

    i: jax.Array
    state: Any
    buffers: Any
    pred: jax.Array


def _masked_scan(loop: EngineLoop, params, init, buffers):
    """`lax.scan` over all `max_steps`; past the stop, a cheap skip keyed on `any_lane`. With
    `loop.progress`, it reports before its first step and after its last only: a scan cannot
    run in stretches, and a report that may be an `io_callback` cannot sit in a `lax.cond`
    under `vmap`."""

    def body(carry: _Masked, _) -> tuple[_Masked, None]:
        def advance(state, buffers):
            stepped = loop.step(params, state, None, carry.i)
            return stepped.state, _tree.write(buffers, stepped.index, stepped.values)

        keep = lambda state, buffers: (state, buffers)
        running = any_lane(carry.pred)
        state, buffers = cond(running, advance, keep, carry.state, carry.buffers)
        return _Masked(carry.i + 1, state, buffers, loop.predicate(params, state)), None

    if loop.progress is not None:
        loop.progress.report(params, init)
    carry = _Masked(jnp.array(0, jnp.int32), init, buffers, loop.predicate(params, init))
    carry, _ = scan(body, carry, None, length=loop.steps)
    if loop.progress is not None:
        loop.progress.report(params, carry.state)
    return carry.state, carry.buffers
