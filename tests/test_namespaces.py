"""The public namespaces: their run-time registries match the imports type checkers read, and
they work from a sourceless (bytecode-only) install."""

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def type_checking_imports(init: Path) -> dict[str, set[str]]:
    """`{relative module: names}` imported under `if TYPE_CHECKING:` in `init`; `from . import x`
    counts as module `.x` defining `x`."""
    imports: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(init.read_text())):
        if not (isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
            for alias in statement.names:
                assert alias.asname == alias.name, f"re-export as `{alias.name} as {alias.name}`"
                module = "." * statement.level + (statement.module or alias.name)
                imports.setdefault(module, set()).add(alias.name)
    return imports


@pytest.mark.parametrize("package", ["odeckpt", "odeckpt.checkpointing"])
def test_registry_matches_type_checking_imports(package):
    namespace = importlib.import_module(package)
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    registry = namespace._PUBLIC
    names = [name for module_names in registry.values() for name in module_names]
    assert len(names) == len(set(names)), "a public name is registered twice"
    assert {module: set(names) for module, names in registry.items()} == type_checking_imports(init)
    assert namespace.__all__ == sorted(names)


def test_public_namespace_without_sources(tmp_path):
    shutil.copytree(ROOT / "odeckpt", tmp_path / "odeckpt")
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-b", str(tmp_path / "odeckpt")], check=True
    )
    for source in (tmp_path / "odeckpt").rglob("*.py"):
        source.unlink()
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import odeckpt, odeckpt.checkpointing\n"
        f"assert odeckpt.__file__.startswith({str(tmp_path)!r}), odeckpt.__file__\n"
        "assert not list(__import__('pathlib').Path(odeckpt.__file__).parent.rglob('*.py'))\n"
        "assert callable(odeckpt.solve) and callable(odeckpt.checkpointing.checkpointed_scan)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
