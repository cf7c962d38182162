"""The package's shape, checked by parsing its source (nothing is imported).

Arrows point one way: `config -> data -> model -> memory -> run -> train | evaluate -> cv -> cli`.
- `memory/` works on any `nn.Module`: it imports torch, the standard library, `config` and itself only.
- `augment/` (the device-side augmentation) is a leaf any layer may use (`train` and the config's recipe
  check do): it imports torch, numpy, MONAI (the mild recipe), the standard library and itself only.
- `train/` and `evaluate/` never import each other; what both need lives in `run/`.
- `data/` knows nothing of the model, training, evaluation or memory; `model/` nothing of training,
  evaluation or memory.
- Nothing below the CLI imports `brats_swap.cli`.
- No function in `brats_swap/` is longer than 80 lines, so every function reads in one screen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "brats_swap"
MAX_FUNCTION_LINES = 80

# Functions allowed over the limit, with the reason. Empty: keep it that way.
LONG_FUNCTION_EXCEPTIONS: dict[str, str] = {}

# Third-party imports memory/ may use besides torch and the standard library: numpy is the simulator's
# array library (the planner replays traces as arrays), matplotlib is absent on purpose.
MEMORY_THIRD_PARTY = {"torch", "numpy"}
# The same for augment/: it works on tensors and draws with numpy; the mild recipe is MONAI's transforms.
AUGMENT_THIRD_PARTY = {"torch", "numpy", "monai"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute dotted name of `from X import ...` (X relative to `package` when it starts with dots)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in the file (functions included), as absolute dotted names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(name, path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            found.add(module)
            # `from brats_swap import cli` imports the subpackage itself.
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _area(module: str) -> str:
    """`brats_swap.train.loop` -> `train`; top-level modules (`brats_swap.atomic`) are their own area."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "brats_swap" else parts[0]


MODULES = _modules()
IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _package_imports(name: str) -> set[str]:
    """The brats_swap modules that `name` imports (only names that exist, so `from x import func` is fine)."""
    return {imported for imported in IMPORTS[name] if imported in MODULES}


def _violations(source_areas: set[str], forbidden_areas: set[str]) -> list[str]:
    return sorted(f"{name} imports {imported}" for name in MODULES if _area(name) in source_areas
                  for imported in _package_imports(name) if _area(imported) in forbidden_areas)


def test_the_parser_sees_the_package():
    # A guard for the tests below: an empty or mis-parsed package would pass them vacuously.
    assert {"memory", "train", "evaluate", "data", "model", "cli", "config", "run"} <= {_area(m) for m in MODULES}
    assert "brats_swap.memory.engine" in _package_imports("brats_swap.memory")


def _outside_imports(area: str, package_areas: set[str], third_party: set[str]) -> list[str]:
    """Imports of `area`'s modules outside the given package areas, third-party packages and the stdlib."""
    import sys

    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name, imported in IMPORTS.items():
        if _area(name) != area:
            continue
        for module in imported:
            top = module.split(".")[0]
            if top == "brats_swap":
                if module in MODULES and _area(module) not in package_areas:
                    bad.append(f"{name} imports {module}")
            elif top and top not in stdlib and top not in third_party and top != "__future__":
                bad.append(f"{name} imports {module}")
    return bad


def test_memory_imports_only_config_torch_and_itself():
    assert _outside_imports("memory", {"memory", "config"}, MEMORY_THIRD_PARTY) == []


def test_augment_is_a_leaf_of_torch_numpy_and_the_standard_library():
    assert any(_area(name) == "augment" for name in MODULES)
    assert _outside_imports("augment", {"augment"}, AUGMENT_THIRD_PARTY) == []


def test_train_and_evaluate_do_not_import_each_other():
    assert _violations({"train"}, {"evaluate"}) == []
    assert _violations({"evaluate"}, {"train"}) == []


def test_data_and_model_stay_below_training():
    assert _violations({"data"}, {"model", "train", "evaluate", "memory", "run", "cv"}) == []
    assert _violations({"model"}, {"train", "evaluate", "memory", "run", "cv"}) == []


def test_nothing_below_the_cli_imports_it():
    # `python -m brats_swap` (`__main__`) is the CLI's other door.
    below_cli = {_area(m) for m in MODULES} - {"cli", "__main__"}
    assert _violations(below_cli, {"cli"}) == []


def _long_functions() -> list[str]:
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                # Count from the decorator or `def` line to the last line of the body.
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                qualified = f"{name}.{node.name}"
                if length > MAX_FUNCTION_LINES and qualified not in LONG_FUNCTION_EXCEPTIONS:
                    found.append(f"{qualified} ({length} lines)")
    return sorted(found)


def test_no_function_is_longer_than_80_lines():
    assert _long_functions() == []


@pytest.mark.parametrize("snippet, expected", [
    ("from brats_swap.train import loop\n", {"brats_swap.train", "brats_swap.train.loop"}),
    ("from . import folder\n", {"brats_swap.run", "brats_swap.run.folder"}),
])
def test_the_import_parser_resolves_relative_and_submodule_imports(tmp_path, snippet, expected):
    path = tmp_path / "mod.py"
    path.write_text(snippet, encoding="utf-8")
    assert _imports("brats_swap.run.mod", path) == expected


# --------------------------------------------------------------------------------------------------
# No import cycle among the imports that run: module level and inside functions alike (an import inside a
# function is still an arrow; it only runs later). Imports under `if TYPE_CHECKING:` never run.


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree` except those in the body of an `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))
    return found


def _runtime_imports(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports when it runs: `from a.b import c` is a.b.c when that is a
    module (only then is the package `a.b` itself not what is asked for), else a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _package_of(name, path)
    found: set[str] = set()
    for node in _runtime_import_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        module = _from_module(node, package)
        submodules = {f"{module}.{alias.name}" for alias in node.names} & set(MODULES)
        found.update(submodules)
        if len(submodules) < len(node.names):
            found.add(module)
    return {imported for imported in found if imported in MODULES and imported != name}


def _import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_no_import_cycle_among_the_imports_that_run():
    graph = {name: _runtime_imports(name, path) for name, path in MODULES.items()}
    assert _import_cycles(graph) == []


def test_the_cycle_check_sees_function_level_imports_and_skips_type_checking(tmp_path):
    # Guards for the test above: it must find a cycle closed by an import inside a function, and must not
    # count one closed only under `if TYPE_CHECKING:`.
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from brats_swap.run import folder\n", encoding="utf-8")
    b.write_text("def f():\n    from brats_swap.run.console import warn\n", encoding="utf-8")
    graph = {"brats_swap.run.console": _runtime_imports("brats_swap.run.console", a),
             "brats_swap.run.folder": _runtime_imports("brats_swap.run.folder", b)}
    assert graph == {"brats_swap.run.console": {"brats_swap.run.folder"},
                     "brats_swap.run.folder": {"brats_swap.run.console"}}
    assert _import_cycles(graph) == [["brats_swap.run.console", "brats_swap.run.folder"]]
    b.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from brats_swap.run.console import warn\n",
                 encoding="utf-8")
    assert _runtime_imports("brats_swap.run.folder", b) == set()


# --------------------------------------------------------------------------------------------------
# The CLI's modules are imported by every `--help`: at module level they import Typer, rich and the standard
# library only (torch, MONAI, nibabel ... load inside a command, after its config is resolved). That the
# package modules they import stay light too is tested by running them: tests/test_cli_startup.py.
CLI_MODULE_LEVEL_THIRD_PARTY = {"typer", "rich", "click"}


def _module_level_imports(path: Path) -> set[str]:
    """The top-level names imported by `path`'s module-level statements (not in a function, not under
    `if TYPE_CHECKING:`)."""
    found: set[str] = set()
    pending = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            pending.extend([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            pending.extend([*node.body, *node.orelse, *node.finalbody])
    return found


def test_the_cli_imports_no_heavy_package_at_module_level():
    import sys

    allowed = set(sys.stdlib_module_names) | CLI_MODULE_LEVEL_THIRD_PARTY | {"brats_swap", "__future__"}
    found = {name: _module_level_imports(path) - allowed for name, path in MODULES.items()
             if _area(name) in {"cli", "__main__"}}
    assert len(found) > 5 and {name: heavy for name, heavy in found.items() if heavy} == {}
