"""Lazy public namespaces (PEP 562).

`odeckpt.checkpointing.schedules` is pure Python and must be importable without JAX, so the package
namespaces above it import their JAX-based members on first attribute access instead of at import.
"""

import importlib
import sys
from collections.abc import Callable


def lazy_namespace(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """Return a module `__getattr__` and `__dir__` for `package`.

    **Arguments:**

    - `package`: the `__name__` of the package being populated.
    - `exports`: public name -> relative module that defines it (e.g. `{"solve": "._solve"}`),
        or the relative name of a public subpackage itself (`{"checkpointing": ".checkpointing"}`).
    """

    def __getattr__(name: str) -> object:
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        imported = importlib.import_module(module, package)
        is_submodule = imported.__name__ == f"{package}.{name}"
        value = imported if is_submodule else getattr(imported, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
