"""The package's structure rules, checked on its source (no torch needed):

- only ``dtensor_patches/_torch/`` touches private torch names (modules with a ``_`` part,
  private attributes, ``getattr`` of private names); ruff's ``SLF001`` checks the attributes
  too, this test also the imports;
- nothing outside ``dtensor_patches/patches/`` imports a patch module;
- no import cycle among the package's modules (imports inside functions included);
- no module over 600 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dtensor_patches"
BOUNDARY = PACKAGE / "_torch"
PATCHES = PACKAGE / "patches"
MAX_LINES = 600
# Private names of the standard library the package may use.
STDLIB_PRIVATE = {"os._exit"}


def _modules() -> Iterator[Path]:
    yield from sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _private_part(dotted: str) -> str | None:
    for part in dotted.split("."):
        if part.startswith("_") and not part.startswith("__"):
            return part
    return None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_torch_uses(source: str) -> list[str]:
    """Every private torch name ``source`` uses, as ``"line: what"``."""
    tree = ast.parse(source)
    torch_names = {"torch"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_names.add((alias.asname or alias.name).split(".")[0])
                    if _private_part(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "torch":
                continue
            if _private_part(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                torch_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Name) and f"{owner.id}.{node.attr}" in STDLIB_PRIVATE:
                continue
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if called in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    if _is_private(name.value):
                        found.append(f"{node.lineno}: {called}(..., {name.value!r})")
            if called in ("__import__", "import_module"):
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        if arg.value.startswith("torch") and _private_part(arg.value):
                            found.append(f"{node.lineno}: import_module({arg.value!r})")
    return found


def test_the_rule_finds_what_it_must() -> None:
    source = (
        "import torch\n"
        "from torch.utils._pytree import tree_map\n"
        "from torch.distributed.tensor import _op_schema\n"
        "import torch.distributed.tensor._dispatch\n"
        "x = y._spec\n"
        "z = torch._C\n"
        "getattr(t, '_local_tensor')\n"
        "importlib.import_module('torch.distributed.tensor._utils')\n"
        "self._own = 1\n"
        "w = a.__class__\n"
    )
    found = private_torch_uses(source)
    assert [line.split(":")[0] for line in found] == ["2", "3", "4", "5", "6", "7", "8"], found


@pytest.mark.parametrize(
    "path",
    [p for p in _modules() if BOUNDARY not in p.parents],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_only_the_boundary_touches_private_torch_names(path: Path) -> None:
    found = private_torch_uses(path.read_text())
    assert not found, f"{path.relative_to(PACKAGE.parent)} uses private torch names: {found}"


def _imports(path: Path) -> set[str]:
    """Every ``dtensor_patches`` module ``path`` imports, at any depth (inside functions and
    under ``if TYPE_CHECKING:`` too: a layer that names an upper layer's types depends on it)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    )
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("dtensor_patches"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            if not module.startswith("dtensor_patches"):
                continue
            out.add(module)
            for alias in node.names:
                out.add(f"{module}.{alias.name}")
    known = {_module_name(p) for p in _modules()}
    return {m for m in out if m in known}


def test_nothing_outside_patches_imports_a_patch_module() -> None:
    offenders = []
    for path in _modules():
        if PATCHES in path.parents:
            continue
        for module in _imports(path):
            if module.startswith("dtensor_patches.patches."):
                offenders.append(f"{_module_name(path)} imports {module}")
    assert not offenders, offenders


def test_no_import_cycle() -> None:
    graph = {_module_name(p): _imports(p) - {_module_name(p)} for p in _modules()}
    # A package's modules import the package first: that edge is Python's, not a layer's.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_over_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long
