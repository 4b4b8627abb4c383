"""Lazy public namespaces (PEP 562).

`odeckpt.checkpointing.schedules` is pure Python and must be importable without JAX, so the package
namespaces above it import their JAX-based members on first attribute access instead of at import.
A package lists its public names twice, checked equal by `tests/test_namespaces.py`: as imports
under `if TYPE_CHECKING:` (which type checkers and editors read) and as a `_PUBLIC` registry, data
read at run time (`{relative module: public names it defines}`; a public subpackage `.x` defines
`x`). Nothing reads source files, so a sourceless (bytecode-only) install works.
"""

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_namespace(
    package: str, public: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """A module `__getattr__`, `__dir__` and `__all__` for `package`, whose public names are
    `public` (`{relative module: public names it defines}`)."""
    exports = {name: module for module, names in public.items() for name in names}

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

    return __getattr__, __dir__, sorted(exports)
