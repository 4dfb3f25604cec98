"""The package imports its own modules at the top of each file, so a reader sees a module's
neighbours in its first lines. The one exception is a module that needs ``transformers``: it is
imported inside the function that uses it, so posenc installs and runs without transformers."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_path(name: str) -> Path:
    """The file of the dotted module ``name`` under src/."""
    base = SRC.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def imported_names(path: Path, node: ast.ImportFrom) -> list[str]:
    """The dotted modules a ``from X import y`` inside ``path`` reads, relative levels resolved:
    X itself, or X.y for each y where X is a package and y one of its modules."""
    if node.level == 0:
        base = node.module or ""
    else:
        parts = path.relative_to(SRC).with_suffix("").parts
        package = parts[:-1]  # a module's package, and an __init__'s own package
        base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
    submodules = [f"{base}.{a.name}" for a in node.names if module_path(f"{base}.{a.name}").exists()]
    return submodules or [base]


def imports_transformers(name: str) -> bool:
    """True if the module ``name`` imports transformers at its top level."""
    path = module_path(name)
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "transformers" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "transformers":
            return True
    return False


def function_level_imports() -> list[tuple[Path, int, str]]:
    """Every import of a posenc module made inside a function: (file, line, module)."""
    found = []
    for path in sorted((SRC / "posenc").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    found += [(path, sub.lineno, name) for name in imported_names(path, sub)
                              if name.split(".")[0] == "posenc"]
                elif isinstance(sub, ast.Import):
                    found += [(path, sub.lineno, a.name) for a in sub.names if a.name.split(".")[0] == "posenc"]
    return found


def test_the_scan_finds_function_level_imports() -> None:
    """The scan resolves both forms of a relative import inside a function: ``from .extend_hf import
    HFCheckpoint`` in extend/extend.py and ``from . import hf_models`` in study/models.py, each a
    module that imports transformers."""
    found = {(p.relative_to(SRC).as_posix(), name) for p, _, name in function_level_imports()}
    assert ("posenc/extend/extend.py", "posenc.extend.extend_hf") in found
    assert ("posenc/study/models.py", "posenc.study.hf_models") in found
    assert imports_transformers("posenc.study.hf_models")
    assert not imports_transformers("posenc.functional")


def test_function_level_imports_only_keep_transformers_optional() -> None:
    """A posenc module imported inside a function must be one that imports transformers."""
    wrong = [f"{p.relative_to(SRC)}:{line}: {name}" for p, line, name in function_level_imports()
             if not imports_transformers(name)]
    assert not wrong, "import these at the top of the file:\n" + "\n".join(wrong)
