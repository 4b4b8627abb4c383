"""Compiled memory of a function and of its gradient: "will this fit?" before running."""

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax

from .checkpointing.schedules import parse_memory


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """What XLA reserves to run one compiled function, in bytes (`memory_analysis()`).

    **Fields:**

    - `temp`: working memory: intermediates, loop carries, stored residuals and snapshots.
    - `argument`, `output`: the buffers of the inputs and of the result.
    - `alias`: bytes shared between arguments and outputs (donated buffers).
    - `generated_code`: the size of the compiled program.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> memory = odeckpt.compiled_memory(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(1000))
    >>> memory.argument, memory.output
    (8000, 8)

    ```
    """

    temp: int
    argument: int
    output: int
    alias: int
    generated_code: int

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "CompiledMemory":
        """The memory of an already compiled function (`jax.jit(f).lower(...).compile()`),
        for when it is also to be run."""
        stats = compiled.memory_analysis()
        assert stats is not None  # reported by XLA's CPU, GPU and TPU backends
        return cls(
            temp=int(stats.temp_size_in_bytes),
            argument=int(stats.argument_size_in_bytes),
            output=int(stats.output_size_in_bytes),
            alias=int(stats.alias_size_in_bytes),
            generated_code=int(stats.generated_code_size_in_bytes),
        )

    @property
    def total(self) -> int:
        """Everything the device holds while the function runs."""
        return self.temp + self.argument + self.output - self.alias + self.generated_code


def compiled_memory(fn: Callable, *args) -> CompiledMemory:
    """Compile `fn(*args)` (nothing is run) and return its `CompiledMemory`.

    Arrays in `args` (any pytrees, equinox modules included) are traced; everything else is
    held static, as with `equinox.filter_jit`. Use it for a gradient or any transformed function
    built by hand; `memory_report` measures a loss and its gradient together.

    **Arguments:**

    - `fn`: the function to compile, called as `fn(*args)`.
    - `*args`: its arguments: array leaves are traced, with their shapes and dtypes; other
        leaves are static.

    **Returns:**

    A `CompiledMemory`: the bytes XLA reserves on the default device for the compiled
    `fn(*args)` (`temp`, `argument`, `output`, `alias`, `generated_code`, and `total`).

    **Example:**

    ```python
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> scan = lambda xs: jax.lax.scan(lambda y, x: (jnp.sin(y) * x, None), jnp.ones(1000), xs)
    >>> memory = odeckpt.compiled_memory(jax.grad(lambda xs: scan(xs)[0].sum()), jnp.ones(100))
    >>> memory.temp >= 100 * 1000 * 4  # reverse mode keeps one carry per step
    True

    ```
    """
    dynamic, static = eqx.partition(args, eqx.is_array)
    traced = jax.jit(lambda dynamic: fn(*eqx.combine(dynamic, static)))
    return CompiledMemory.of(traced.lower(dynamic).compile())


def format_bytes(size: float) -> str:
    """`size` bytes as a short human-readable figure (`"1.5 MiB"`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The compiled memory of a function and of its gradient; `print` it for a table.

    **Fields:**

    - `function`: the `CompiledMemory` of `fn(*args)`.
    - `gradient`: the `CompiledMemory` of its gradient with respect to the first argument.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> print(odeckpt.memory_report(lambda x: jnp.sum(jnp.sin(x) ** 2), jnp.ones(1000)))
    ... # doctest: +NORMALIZE_WHITESPACE, +ELLIPSIS
                        function    gradient
    temp                   ...
    argument              7.8 KiB     7.8 KiB
    output                  8 B       7.8 KiB
    generated_code ...
    total ...

    ```
    """

    function: CompiledMemory
    gradient: CompiledMemory

    def fits(self, budget: int | str) -> bool:
        """Whether the gradient's `total` fits in `budget` (bytes, or a string like `"2GB"`)."""
        return self.gradient.total <= parse_memory(budget)

    def __str__(self) -> str:
        rows = [f"{'':<16}{'function':>12}{'gradient':>12}"]
        for field in ("temp", "argument", "output", "generated_code", "total"):
            sizes = (getattr(self.function, field), getattr(self.gradient, field))
            rows.append(f"{field:<16}" + "".join(f"{format_bytes(s):>12}" for s in sizes))
        return "\n".join(rows)


def memory_report(fn: Callable, *args) -> MemoryReport:
    """Compiled memory of `fn(*args)` and of its gradient, in bytes, without running either.

    Both are compiled with XLA for the default device and measured with
    `jax.jit(...).lower(...).compile().memory_analysis()`: deterministic, and cheap next to
    running a long solve. `temp` is the figure that checkpointing controls.

    **Arguments:**

    - `fn`: a function returning a scalar (a loss). The gradient is taken with respect to the
        floating-point arrays of the first argument, as `equinox.filter_grad` does.
    - `args`: example arguments: pytrees of arrays (equinox modules included); anything that
        is not an array is held static.

    **Returns:**

    A `MemoryReport` with the `CompiledMemory` of `fn` and of its gradient; `print` it for a
    table, `report.fits("2GB")` to check a budget.

    **Example:**

    ```python
    >>> import jax.numpy as jnp
    >>> import odeckpt
    >>> def loss(y0):
    ...     sol = odeckpt.solve(lambda t, y, args: -y, y0, (0.0, 1.0), adjoint="direct")
    ...     return jnp.sum(sol.ys**2)
    >>> report = odeckpt.memory_report(loss, jnp.ones(1000))
    >>> report.gradient.temp > report.function.temp, report.fits("1GB")
    (True, True)

    ```
    """
    result = eqx.filter_eval_shape(fn, *args)
    if not (isinstance(result, jax.ShapeDtypeStruct) and result.shape == ()):
        raise ValueError(
            f"`memory_report` differentiates `fn`, so `fn` must return a scalar; it returns "
            f"{result}. Fix: reduce the output to a loss, e.g. `lambda *a: jnp.sum(fn(*a))`."
        )
    return MemoryReport(
        function=compiled_memory(fn, *args),
        gradient=compiled_memory(eqx.filter_grad(fn), *args),
    )
