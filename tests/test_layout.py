"""The folder layout is the architecture: mist_core is the library (no Ray, no pipelines),
its subpackages layered data < scoring < measures < distill over errors, reasons and models,
with no import circle; each product folder under pipelines/ (job, evaluation, loop, bench)
imports common/ and mist_core, never another product; common/ imports no product. Read from
the source (every import, lazy ones inside functions included), so a test fails on the line
that breaks it."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTS = ("job", "evaluation", "loop", "bench")
# The library's layers, lowest first: a module imports from its own layer and those below,
# never from one above. BASE is mist_core's own top-level modules, which every subpackage may
# use; mist_core/__init__.py (the public API) stands above every layer.
BASE = ("errors", "reasons", "models")
LAYERS = ("data", "scoring", "measures", "distill")
# What loads without torch: `import mist_core`, `mist --help` and `mist report` need no model.
TORCH_FREE = ("mist_core", *(f"mist_core.{m}" for m in ("errors", "reasons")),
              *(f"mist_core.data.{p.stem}" for p in sorted((ROOT / "mist_core/data").glob("*.py"))
                if p.stem != "__init__"),
              "mist_core.scoring.choices", "mist_core.scoring.prune", "mist_core.measures.answers",
              "mist_core.measures.retention", "mist_core.measures.taxonomy",
              "mist_core.measures.stats", "pipelines.cli", "pipelines.evaluation.report")


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


def _library_id(path: Path) -> str:
    return str(path.relative_to(ROOT / "mist_core"))


@pytest.mark.parametrize("path", _files("mist_core"), ids=_library_id)
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


def _layer(module: str) -> int | None:
    """The layer of a mist_core module or name (0 = BASE, 1.. = LAYERS, len(LAYERS) + 1 =
    the package's own names, the public API), None outside mist_core."""
    parts = module.split(".")
    if parts[0] != "mist_core":
        return None
    if len(parts) == 1 or not ((ROOT / "mist_core" / parts[1]).is_dir()
                               or (ROOT / "mist_core" / f"{parts[1]}.py").is_file()):
        return len(LAYERS) + 1  # mist_core itself, or a name its __init__ hands on
    return LAYERS.index(parts[1]) + 1 if parts[1] in LAYERS else 0


@pytest.mark.parametrize("path", _files("mist_core"), ids=_library_id)
def test_library_layers_import_only_downwards(path):
    own = _layer(_module(path))
    names = ("base",) + LAYERS + ("mist_core",)
    bad = [(line, m, names[_layer(m)]) for line, m in imports(path)
           if _layer(m) is not None and _layer(m) > own]
    assert not bad, f"{path.relative_to(ROOT)} ({names[own]}) imports from a higher layer: {bad}"


def test_every_library_module_sits_in_a_layer():
    top = {p.stem for p in (ROOT / "mist_core").glob("*.py")}
    folders = {p.name for p in (ROOT / "mist_core").iterdir()
               if p.is_dir() and p.name != "__pycache__"}
    assert top == {"__init__", *BASE} and folders == set(LAYERS)
    assert all((ROOT / "mist_core" / f / "__init__.py").is_file() for f in LAYERS)


def _library_graph() -> dict[str, set[str]]:
    """Each mist_core module -> the mist_core modules it imports (a name imported from a
    module counts as the module)."""
    modules = {_module(p): p for p in _files("mist_core")}

    def owner(target: str) -> str:
        while target not in modules:
            target = target.rpartition(".")[0]
        return target

    return {m: {owner(t) for _, t in imports(p) if t.split(".")[0] == "mist_core"} - {m}
            for m, p in modules.items()}


def test_library_has_no_import_circle():
    graph, done, path = _library_graph(), set(), []

    def visit(module: str):
        if module in path:
            circle = path[path.index(module):] + [module]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if module in done:
            return
        path.append(module)
        for imported in sorted(graph[module]):
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_light_modules_load_without_torch():
    """One fresh interpreter imports each in turn and names the first that brings torch."""
    code = ("import importlib, sys\n"
            f"for m in {TORCH_FREE!r}:\n"
            "    importlib.import_module(m)\n"
            "    if 'torch' in sys.modules:\n"
            "        sys.exit(f'{m} imports torch')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
