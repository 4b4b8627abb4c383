"""Lazy public namespaces (PEP 562), registered once.

`odeckpt.checkpointing.schedules` is pure Python and must be importable without JAX, so the package
namespaces above it import their JAX-based members on first attribute access instead of at import.
A package lists its public names once, as the imports in its `if TYPE_CHECKING:` block (which type
checkers and editors read); `lazy_namespace` reads that block from the package's source to know
where each name lives.
"""

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path


def public_names(package: str) -> dict[str, str]:
    """Public name -> relative module that defines it (or the relative name of a public
    subpackage), from the imports under `if TYPE_CHECKING:` in `package`'s `__init__.py`."""
    source = Path(sys.modules[package].__file__).read_text()
    names = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom):
                continue
            module = "." * statement.level + (statement.module or "")
            for alias in statement.names:
                public = alias.asname or alias.name
                names[public] = module if statement.module else module + alias.name
    return names


def lazy_namespace(package: str) -> tuple[Callable[[str], object], Callable[[], list[str]], list]:
    """A module `__getattr__`, `__dir__` and `__all__` for `package`, whose public names are
    its `TYPE_CHECKING` imports (see `public_names`)."""
    exports = public_names(package)

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
