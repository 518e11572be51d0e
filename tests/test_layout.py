"""The folder layout is the architecture: mist_core is the library (no Ray, no pipelines);
each product folder under pipelines/ (job, evaluation, loop, bench) imports common/ and
mist_core, never another product; common/ imports no product. Read from the source (every
import, lazy ones inside functions included), so a test fails on the line that breaks it."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTS = ("job", "evaluation", "loop", "bench")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, relative ones resolved."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


def _folder(module: str) -> str | None:
    """The pipelines folder a module is in (job, common, …), None outside pipelines."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pipelines" and len(parts) > 2 else None


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _files("mist_core"), ids=lambda p: p.name)
def test_library_imports_neither_ray_nor_pipelines(path):
    bad = [(line, m) for line, m in imports(path) if m.split(".")[0] in ("ray", "pipelines")]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _files("pipelines"), ids=lambda p: str(p.relative_to(ROOT)))
def test_products_import_only_common_and_themselves(path):
    own = _folder(_module(path))
    if own is None:  # pipelines/cli.py and the compress shim sit above the products
        return
    allowed = {own, "common"} if own in PRODUCTS else {"common"}
    bad = [(line, m) for line, m in imports(path)
           if _folder(m) is not None and _folder(m) not in allowed]
    assert not bad, f"{path.relative_to(ROOT)} ({own}/) imports {bad}"


def test_every_pipelines_folder_is_a_product_or_common():
    folders = {p.name for p in (ROOT / "pipelines").iterdir()
               if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(PRODUCTS) | {"common"}
