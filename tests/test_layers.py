"""The package's layers, read from its imports (ast): one way down, no circles.

The rule (docs/architecture.md, top): surfaces -> session -> backends -> launch ->
protocol / worker; display and tracking are consumers and never import a backend;
the rank side (worker) imports nothing of the caller's side. Every import counts,
also those inside functions: a lazy import is still an arrow.

``python tests/test_layers.py [PACKAGE_DIR]`` prints the numbers: modules, floors,
arrows that run back up, circles, the largest module and function.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "air_magic"

# Each module's layer, by the longest matching prefix.
LAYER_OF = {
    "air_magic": "face",  # __init__: re-exports, load_ipython_extension
    "air_magic._version": "base",
    "air_magic.errors": "base",
    "air_magic.paths": "base",
    "air_magic.private_files": "base",
    "air_magic.process_tree": "base",
    "air_magic.user_warnings": "base",
    "air_magic.threads": "base",
    "air_magic.protocol": "protocol",
    "air_magic.worker": "worker",
    "air_magic.data": "data",
    "air_magic.launch": "launch",
    "air_magic.backends": "backends",
    "air_magic.display": "display",
    "air_magic.tracking": "tracking",
    "air_magic.session": "session",
    "air_magic.decorator": "surface",
    "air_magic.autoload": "surface",
    "air_magic.notebook": "surface",
    "air_magic.cli": "surface",
}
BELOW_SESSION = {"display", "tracking", "launch", "worker", "protocol", "base"}
# What each layer may import besides itself.
MAY_IMPORT = {
    "protocol": set(),
    "base": {"protocol"},
    "worker": {"protocol", "air_magic.errors"},  # the rank side: nothing of the caller's
    "data": {"worker", "protocol", "base"},  # rank-side library: nothing of the caller's
    "launch": {"protocol", "base"},
    "backends": {"launch", "worker", "protocol", "base"},
    "display": {"launch", "protocol", "base"},  # consumers never drive processes
    "tracking": {"launch", "protocol", "base"},
    "session": {"backends"} | BELOW_SESSION,
    "surface": {"session"} | BELOW_SESSION,  # never a backend: the session picks it
    "face": {"surface", "session", "backends"} | BELOW_SESSION,
}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The air_magic modules ``name`` imports, anywhere in its code."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            # "from package import module" imports the module; "from module import name" the module.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "import a.b.c" of a non-module attribute
                target = target.rpartition(".")[0]
            if target.startswith("air_magic") and target != name:
                out.add(target)
    return out


def layer(name: str) -> str:
    best = max((p for p in LAYER_OF if name == p or name.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    # A package's __init__ is imported on the way to any of its modules: not an arrow of its own.
    # Except the root's: ``from air_magic import distributed`` inside the package is an arrow to
    # the face, which pulls in the surfaces (its names load lazily).
    return {
        name: {t for t in imports(name, path, known) if t == "air_magic" or not name.startswith(t + ".")}
        for name, path in known.items()
    }


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in edges.items():
        mine = layer(source)
        for target in sorted(targets):
            theirs = layer(target)
            allowed = MAY_IMPORT[mine]
            if theirs != mine and theirs not in allowed and target not in allowed:
                bad.append(f"{source} ({mine}) -> {target} ({theirs})")
    return bad


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def floors(edges: dict[str, set[str]]) -> int:
    """The longest chain of imports (a module importing nothing of ours is floor 1)."""
    depth: dict[str, int] = {}

    def height(v: str, seen: frozenset[str]) -> int:
        if v in depth:
            return depth[v]
        below = [height(w, seen | {v}) for w in edges.get(v, ()) if w not in seen]
        depth[v] = 1 + max(below, default=0)
        return depth[v]

    return max(height(v, frozenset()) for v in edges)


def largest(package: Path = PACKAGE) -> tuple[tuple[int, str], tuple[int, str]]:
    """(lines, module) of the longest module, (lines, function) of the longest function."""
    biggest_module, biggest_function = (0, ""), (0, "")
    for name, path in modules(package).items():
        text = path.read_text()
        biggest_module = max(biggest_module, (len(text.splitlines()), name))
        for node in _functions(ast.parse(text)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            biggest_function = max(biggest_function, (size, f"{name}.{node.name}"))
    return biggest_module, biggest_function


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


# -- the tests -------------------------------------------------------------------------------


def test_every_module_has_a_layer():
    unplaced = [
        name for name in modules() if not any(name == p or name.startswith(p + ".") for p in LAYER_OF)
    ]
    assert unplaced == [], f"modules in no layer (add them to LAYER_OF and docs/architecture.md): {unplaced}"


def test_imports_run_one_way_down():
    assert wrong_way(graph()) == []


def test_no_import_circles():
    assert circles(graph()) == []


def test_the_check_itself_catches_an_arrow_up_and_a_circle(tmp_path):
    """A checker that cannot fail proves nothing: a small package with both faults."""
    package = tmp_path / "air_magic"
    for folder in ("protocol", "backends", "display"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "protocol" / "wire.py").write_text("from air_magic.display import widgets\n")
    (package / "display" / "widgets.py").write_text(
        "def f():\n    from air_magic.backends import local\n    from air_magic.protocol import wire\n"
    )
    (package / "backends" / "local.py").write_text("import air_magic.protocol.wire\n")
    (package / "protocol" / "events.py").write_text("from air_magic import distributed\n")
    edges = graph(package)
    assert "air_magic.protocol.wire (protocol) -> air_magic.display.widgets (display)" in wrong_way(edges)
    assert "air_magic.display.widgets (display) -> air_magic.backends.local (backends)" in wrong_way(edges)
    assert "air_magic.protocol.events (protocol) -> air_magic (face)" in wrong_way(edges)
    assert circles(edges) == [
        ["air_magic.backends.local", "air_magic.display.widgets", "air_magic.protocol.wire"]
    ]


def main() -> None:
    package = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE
    edges = graph(package)
    (module_lines, module), (function_lines, function) = largest(package)
    print(f"modules: {len(edges)}")
    print(f"floors (longest import chain): {floors(edges)}")
    print(f"arrows: {sum(len(t) for t in edges.values())}")
    if package == PACKAGE:
        print(f"arrows that run back up: {len(wrong_way(edges))}")
    print(f"circles: {len(circles(edges))} {circles(edges) or ''}")
    print(f"largest module: {module} ({module_lines} lines)")
    print(f"largest function: {function} ({function_lines} lines)")


if __name__ == "__main__":
    main()
