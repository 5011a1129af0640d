"""The package's layers, read from its imports (ast): one way down, no circles.

The rule (docs/architecture.md, top): surfaces -> calls -> backends -> launch ->
protocol / worker; display and tracking are consumers and never import a backend;
the rank side (worker) imports nothing of the caller's side. Every import counts,
also those inside functions: a lazy import is still an arrow.

``python tests/unit/test_layers.py [PACKAGE_DIR]`` prints the numbers: modules, floors,
arrows that run back up, circles, the largest module, function and class;
``python tests/unit/test_layers.py --write`` rewrites the layer table of
docs/architecture.md from this map (a test fails when the two disagree).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "air_magic"  # tests/unit/ -> the repository


# Each module's layer, by the longest matching prefix.
LAYER_OF = {
    "air_magic": "face",  # __init__: re-exports, load_ipython_extension
    "air_magic._version": "base",
    "air_magic.errors": "base",
    "air_magic.former_names": "base",
    "air_magic.paths": "base",
    "air_magic.private_files": "base",
    "air_magic.process_tree": "base",
    "air_magic.user_warnings": "base",
    "air_magic.threads": "base",
    "air_magic.protocol": "protocol",
    "air_magic.worker": "worker",
    "air_magic.data": "data",
    "air_magic.launch": "launch",
    "air_magic.outcome": "outcome",
    "air_magic.node": "node",
    "air_magic.backends": "backends",
    "air_magic.display": "display",
    "air_magic.tracking": "tracking",
    "air_magic.calls": "calls",
    "air_magic.decorator": "surface",
    "air_magic.autoload": "surface",
    "air_magic.notebook": "surface",
    "air_magic.cli": "surface",
    "air_magic.torchrun_flags": "surface",
    "air_magic.__main__": "surface",
    "air_magic.verbs": "surface",
    "air_magic.runtime": "worker",  # inside a rank: where it stands (reads its environment only)
}
# What each layer is for, in the order of the table in docs/architecture.md (top to bottom).
JOBS = {
    "face": "re-exports (lazily: a rank pays for none of the caller's side), `load_ipython_extension`",
    "surface": "what the user calls",
    "calls": "the one place that picks a backend and wires the consumers of a call; where it runs "
    "(foreground, a background thread, a detached supervisor, a persistent session)",
    "backends": "how a call's ranks are placed and followed: one call loop; the local backend, the Ray "
    "backend and its agents, the scripted one for tests",
    "node": "what runs on each node: its rank group (start, watch, stop), the warm starter, the "
    "rendezvous store, a session's pipes; the same for the local backend and a Ray agent",
    "display": "show a call; never drives processes",
    "tracking": "record a call in MLflow; never drives processes",
    "outcome": "how a call ended: the one ledger of its ranks' facts and the root-cause rule, its texts, "
    "its ranks' stacks; knows no backend",
    "launch": "what to run and where: settings, accelerators, payload, each rank's environment; "
    "knows no backend",
    "data": "a library for training code inside a rank (docs/data.md)",
    "worker": "runs inside a rank",
    "base": "the error tree; every folder name; private files; the one stop-a-tree function",
    "protocol": "what caller, backends and ranks agree on",
}
BELOW_CALLS = {"display", "tracking", "outcome", "launch", "worker", "protocol", "base"}
# What each layer may import besides itself.
MAY_IMPORT = {
    "protocol": set(),
    "base": {"protocol"},
    "worker": {"protocol", "air_magic.errors"},  # the rank side: nothing of the caller's
    "data": {"worker", "protocol", "base"},  # rank-side library: nothing of the caller's
    "launch": {"protocol", "base"},
    "outcome": {"launch", "protocol", "base"},
    "node": {"outcome", "launch", "worker", "protocol", "base"},
    "backends": {"node", "outcome", "launch", "worker", "protocol", "base"},
    "display": {"outcome", "launch", "protocol", "base"},  # consumers never drive processes
    "tracking": {"outcome", "launch", "protocol", "base"},
    "calls": {"backends", "node"} | BELOW_CALLS,
    "surface": {"calls"} | BELOW_CALLS,  # never a backend: the call layer picks it
    "face": {"surface", "calls", "backends", "node"} | BELOW_CALLS,
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


MAX_CLASS_LINES = 300  # issue 49: a class larger than this does more than one job


def largest_class(package: Path = PACKAGE) -> tuple[int, str]:
    """(lines, module.Class) of the longest class, its decorators included."""
    biggest = (0, "")
    for name, path in modules(package).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                biggest = max(biggest, ((node.end_lineno or node.lineno) - start + 1, f"{name}.{node.name}"))
    return biggest


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


# -- the tests -------------------------------------------------------------------------------


def unplaced(names: list[str]) -> list[str]:
    """Modules no entry of LAYER_OF names (the root package's entry covers only itself)."""
    return [
        name
        for name in names
        if name != "air_magic"
        and not any(p != "air_magic" and (name == p or name.startswith(p + ".")) for p in LAYER_OF)
    ]


def test_every_module_has_a_layer():
    missing = unplaced(list(modules()))
    assert missing == [], f"modules in no layer (add them to LAYER_OF): {missing}"


def test_a_module_in_no_layer_is_caught():
    assert unplaced(["air_magic", "air_magic.outcome.ledger", "air_magic.newthing"]) == ["air_magic.newthing"]


def table(package: Path = PACKAGE) -> str:
    """The layer table of docs/architecture.md: each layer's modules, job and what it may import."""
    by_layer: dict[str, list[str]] = {name: [] for name in JOBS}
    for name, path in modules(package).items():
        shown = str(path.relative_to(package)).replace("/__init__.py", "/")
        if path.name == "__init__.py" and name != "air_magic":
            continue  # the folder stands for its package
        by_layer[layer(name)].append(shown)
    lines = ["| layer | modules | job | may import |", "|---|---|---|---|"]
    for name, job in JOBS.items():
        folders: dict[str, list[str]] = {}
        for shown in sorted(by_layer[name]):
            folder, _, file = shown.rpartition("/")
            folders.setdefault(folder, []).append(file)
        parts = [
            f"`{folder}/` ({', '.join(f'`{f}`' for f in files)})"
            if folder
            else ", ".join(f"`{f}`" for f in files)
            for folder, files in sorted(folders.items())
        ]
        allowed = sorted(MAY_IMPORT[name]) if name != "face" else ["anything"]
        lines.append(f"| {name} | {'; '.join(parts)} | {job} | {', '.join(allowed) or 'nothing of ours'} |")
    return "\n".join(lines)


DOC = PACKAGE.parent / "docs" / "architecture.md"
BEGIN, END = "<!-- layer-table:begin -->", "<!-- layer-table:end -->"


def rendered(doc: str) -> str:
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def test_the_architecture_documents_layer_table_matches_the_map():
    doc = DOC.read_text()
    assert BEGIN in doc and doc == rendered(doc), "stale: run `python tests/unit/test_layers.py --write`"


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


def test_no_class_does_more_than_one_job():
    lines, name = largest_class()
    assert lines <= MAX_CLASS_LINES, f"{name} is {lines} lines (at most {MAX_CLASS_LINES}): split it by job"


def main() -> None:
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(rendered(DOC.read_text()))
        print(f"wrote the layer table of {DOC}")
        return
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
    class_lines, biggest_class = largest_class(package)
    print(f"largest class: {biggest_class} ({class_lines} lines)")


if __name__ == "__main__":
    main()
