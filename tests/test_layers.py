"""The house's floors, checked from the code's own imports: every module of `app/` stands on one
layer, nothing imports from a higher layer, and no files or packages import each other in a circle.
Lazy imports inside functions count the same as those at the top: they run too.

The README's module map lists the same layers, in the same order (checked below)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. A module may import from its own layer or any below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("app", "app.compat", "app.batch", "app.nodes")),
    ("base", ("app.config", "app.config_reference", "app.storage", "app.lease", "app.cluster", "app.hub")),
    ("model", ("app.model",)),
    ("data", ("app.data",)),
    ("observe", ("app.observe",)),
    ("elastic", ("app.elastic",)),
    ("plan", ("app.plan", "app.kube")),
    ("eval", ("app.export", "app.eval")),
    ("rl", ("app.rl",)),
    ("train", ("app.train",)),
    ("serve", ("app.serve",)),
    ("front", ("app.cli", "app.report", "app.dev")),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def app_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "app").rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The app modules a file imports, anywhere in it; `from app.x import y` names app.x.y when
    that is a module, else app.x."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "app"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "app":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return found


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "app" is the package's own __init__, not a prefix of every module.
            covers = module == prefix or (prefix != "app" and module.startswith(prefix + "."))
            if covers and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} stands on no layer: add it to LAYERS in tests/test_layers.py "
                             f"(and to the README's module map)")
    return best


def package_of(module: str) -> str:
    """The room a module belongs to: app.<package> for a package's files, else the module."""
    parts = module.split(".")
    return ".".join(parts[:2])


def build_graph() -> dict[str, set[str]]:
    modules = app_modules()
    known = set(modules)
    return {name: {m for m in imported_modules(path, known) if m != name} for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_every_module_stands_on_a_layer():
    for module in app_modules():
        layer_of(module)


def test_no_module_imports_from_a_higher_layer():
    upward = [f"{importer} ({LAYERS[layer_of(importer)][0]}) imports {imported} ({LAYERS[layer_of(imported)][0]})"
              for importer, targets in build_graph().items() for imported in sorted(targets)
              if layer_of(imported) > layer_of(importer)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_circles_between_files():
    assert find_cycles(build_graph()) == []


def test_no_import_circles_between_packages():
    packages: dict[str, set[str]] = defaultdict(set)
    for importer, targets in build_graph().items():
        packages[package_of(importer)] |= {package_of(t) for t in targets} - {package_of(importer)}
    assert find_cycles(packages) == []


def test_the_check_catches_an_upward_import_and_a_circle(tmp_path):
    """The rules bite: a data module importing the loop is upward; two files importing each
    other are a circle."""
    assert layer_of("app.train.loop") > layer_of("app.data.stream")
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    planted = tmp_path / "x.py"
    planted.write_text("def f():\n    from app.train.loop import setup\n    from app.data import stream\n")
    assert imported_modules(planted, {"app.train.loop", "app.data.stream"}) == {"app.train.loop", "app.data.stream"}


def test_readme_module_map_lists_the_layers_in_order():
    """The README's module map names each layer's modules, lowest layer last (as a picture of
    floors reads), one layer a line: `layer: app/x, app/y/`."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- module-map -->", 2)
    assert len(block) == 3, "README.md: no <!-- module-map --> ... <!-- module-map --> section"
    shown = []
    for line in block[1].strip().splitlines():
        match = re.match(r"^\s*(?:- )?\**(\w+)\**:?\s+(.*)$", line.strip("`"))
        if match and match.group(1) in {name for name, _ in LAYERS}:
            paths = re.findall(r"app/[\w/]*|app\.\w+", match.group(2))
            shown.append((match.group(1), tuple(sorted(p.rstrip("/").replace("/", ".").removesuffix(".py")
                                                       for p in paths))))
    expected = [(name, tuple(sorted(p for p in prefixes if p != "app"))) for name, prefixes in reversed(LAYERS)]
    assert shown == expected


@pytest.mark.parametrize("name", [name for name, _ in LAYERS])
def test_each_layer_holds_code(name):
    prefixes = dict(LAYERS)[name]
    assert any(layer_of(m) == [n for n, _ in LAYERS].index(name) for m in app_modules() if m != "app"), \
        f"layer {name} ({prefixes}) holds no module: drop it"
