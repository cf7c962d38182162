"""The package's shape, checked by parsing its source (nothing is imported).

Arrows point one way: `config -> data -> model -> memory -> run -> train | evaluate -> cv -> cli`.
- `memory/` works on any `nn.Module`: it imports torch, the standard library, `config` and itself only.
- `augment/` (the device-side augmentation) is a leaf any layer may use (`train` does): it imports torch,
  numpy, the standard library and itself only.
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
# The same for augment/: it works on tensors and draws with numpy.
AUGMENT_THIRD_PARTY = {"torch", "numpy"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, anywhere in the file (functions included), as absolute dotted names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
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
