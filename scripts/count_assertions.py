"""Count the checks the test suite runs: a static count, per collected test, of the `assert` statements in its
function (nested functions included) and of its `pytest.raises`/`pytest.warns` blocks.

A parametrized test counts once per collected instance (each runs its asserts). Asserts in shared helpers
(tests/*_helpers.py) are counted once per file in the "helper" line, not per call: the number to compare before
and after a change to the suite is "per collected test" (a merge of two tests that keeps both tests' asserts in
one function keeps it; a deleted assert lowers it).

    python scripts/count_assertions.py            # totals
    python scripts/count_assertions.py --per-file # and one line per test file
    python scripts/count_assertions.py -- -m slow # anything after -- goes to pytest's collection

Collection imports every test module (a few seconds of CPU); nothing runs.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _is_pytest_check(node: ast.AST) -> bool:
    """`with pytest.raises(...)` / `pytest.warns(...)` (or the bare names imported from pytest)."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest":
        return func.attr in ("raises", "warns")
    return isinstance(func, ast.Name) and func.id in ("raises", "warns")


def _count_checks(function: ast.AST) -> tuple[int, int]:
    """(assert statements, pytest.raises/warns blocks) inside `function`'s body."""
    asserts = sum(isinstance(node, ast.Assert) for node in ast.walk(function))
    raises = 0
    for node in ast.walk(function):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            raises += sum(_is_pytest_check(item.context_expr) for item in node.items)
    return asserts, raises


class _Parsed:
    """Each test file parsed once; a function found by its first line."""

    def __init__(self) -> None:
        self._by_file: dict[Path, dict[int, ast.AST]] = {}

    def function_at(self, path: Path, lineno: int) -> ast.AST | None:
        if path not in self._by_file:
            tree = ast.parse(path.read_text(), filename=str(path))
            self._by_file[path] = {
                node.lineno: node for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
        return self._by_file[path].get(lineno)


class CountPlugin:
    def __init__(self) -> None:
        self.per_file: dict[str, Counter] = {}
        self._parsed = _Parsed()

    def pytest_collection_modifyitems(self, items) -> None:
        import inspect

        for item in items:
            function = getattr(item, "function", None)
            if function is None:
                continue
            function = inspect.unwrap(function)
            code = function.__code__
            node = self._parsed.function_at(Path(code.co_filename), code.co_firstlineno)
            if node is None:  # a decorated function's code starts at its first decorator line
                _, start = inspect.getsourcelines(function)
                node = self._parsed.function_at(Path(code.co_filename), start)
                if node is None:
                    for line in range(start, start + 20):
                        node = self._parsed.function_at(Path(code.co_filename), line)
                        if node is not None:
                            break
            counts = self.per_file.setdefault(item.nodeid.split("::")[0], Counter())
            if node is None:
                counts["unparsed"] += 1
            asserts, raises = _count_checks(node) if node is not None else (0, 0)
            counts["tests"] += 1
            counts["asserts"] += asserts
            counts["raises"] += raises


def helper_asserts() -> dict[str, int]:
    """assert statements per test-support file (anything under tests/ not named test_*.py)."""
    found = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name.startswith("test_"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        count = sum(isinstance(node, ast.Assert) for node in ast.walk(tree))
        if count:
            found[str(path.relative_to(REPO))] = count
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-file", action="store_true", help="one line per test file")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest collection arguments (after --)")
    args = parser.parse_args(argv)
    plugin = CountPlugin()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args.pytest_args],
                       plugins=[plugin])
    if code not in (0, 5):
        print(f"count_assertions: pytest collection failed (exit {code})", file=sys.stderr)
        return 1
    total = Counter()
    for counts in plugin.per_file.values():
        total.update(counts)
    if args.per_file:
        print(f"{'file':48} {'tests':>6} {'asserts':>8} {'raises':>7}")
        for name in sorted(plugin.per_file):
            counts = plugin.per_file[name]
            print(f"{name:48} {counts['tests']:>6} {counts['asserts']:>8} {counts['raises']:>7}")
    helpers = helper_asserts()
    if total["unparsed"]:
        print(f"tests whose function was not found in its file (counted as 0): {total['unparsed']}")
    print(f"collected tests: {total['tests']}")
    print(f"assert statements per collected test (summed): {total['asserts']}")
    print(f"pytest.raises/warns blocks per collected test (summed): {total['raises']}")
    print(f"assert statements in test-support files (static, once each): {sum(helpers.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
