"""What a ``%%distributed`` cell reads from the notebook and what it assigns.

Pure functions over the cell's source (no IPython, no processes):

- :func:`names_read`: names the cell needs from outside before (or without)
  assigning them itself: read, updated (``x += 1``) or deleted (``del x``), at
  module level or as globals inside the functions and classes it defines.
  Those are the candidates to send from the notebook.
- :func:`names_assigned`: names the cell binds or deletes at module level
  (assignments, ``def``, ``class``, imports, ``for``/``with`` targets, ``del``),
  in order. Those are the names brought back from rank 0.
- :func:`names_deleted`: the names of ``del`` statements at module level (deleted
  in the notebook too when rank 0 ends without them).
- :func:`star_imports`: the modules of ``from m import *`` (the rank brings back
  the names they bound: they cannot be read from the source).
"""

from __future__ import annotations

import ast
import symtable
from collections.abc import Iterable, Iterator

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def names_read(tree: ast.Module) -> list[str]:
    """Names the cell reads, updates or deletes before assigning them, in order of first use."""
    assigned: set[str] = set()
    read: dict[str, None] = {}
    for stmt in tree.body:
        for name in _loads(stmt):
            if name not in assigned:
                read.setdefault(name, None)
        stores = _stores(stmt)
        # Nested bodies run later, once this statement has bound its own names (def f: ... f()).
        for name in _nested_globals(stmt) + _nested_global_updates(stmt) + _comprehension_reads(stmt):
            if name not in assigned and name not in stores:
                read.setdefault(name, None)
        assigned.update(stores)
    return list(read)


def names_assigned(tree: ast.Module) -> list[str]:
    out: dict[str, None] = {}
    for stmt in tree.body:
        for name in _stores(stmt):
            out.setdefault(name, None)
    return list(out)


def names_deleted(tree: ast.Module) -> list[str]:
    return _unique(n.id for n in _cell_level(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Del))


def star_imports(tree: ast.Module) -> list[str]:
    """Modules the cell star-imports at module level (``from m import *``; relative ones cannot run there)."""
    return _unique(
        n.module
        for n in _cell_level(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and any(a.name == "*" for a in n.names)
    )


def _cell_level(tree: ast.Module) -> Iterator[ast.AST]:
    for stmt in tree.body:
        yield from _walk_scope(stmt)


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """Nodes of ``node`` that run at the cell's own level, not inside a nested scope.

    Of a ``def``, ``class``, ``lambda`` or comprehension, only what runs where it
    is written is included: decorators, defaults, base classes, the first iterable.
    """
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stack.extend(current.decorator_list + current.args.defaults)
            stack.extend(d for d in current.args.kw_defaults if d is not None)
        elif isinstance(current, ast.ClassDef):
            stack.extend(current.decorator_list + current.bases + [k.value for k in current.keywords])
        elif isinstance(current, ast.Lambda):
            stack.extend(current.args.defaults)
        elif isinstance(current, _COMPREHENSIONS):
            stack.append(current.generators[0].iter)
        else:
            stack.extend(ast.iter_child_nodes(current))


def _loads(stmt: ast.stmt) -> list[str]:
    """Names ``stmt`` needs bound when it runs: read, updated in place or deleted."""
    names: list[str] = []
    for node in _walk_scope(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Load, ast.Del)):
            names.append(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            # The target of ``x += 1`` is a Store, yet x is read first.
            names.append(node.target.id)
    return names


def _stores(stmt: ast.stmt) -> list[str]:
    names: list[str] = []
    for node in _walk_scope(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.append(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    names.append(alias.asname or alias.name.split(".")[0])
    return names


def _comprehension_reads(stmt: ast.stmt) -> list[str]:
    """Names a comprehension at the cell's level reads, less its own loop variables."""
    names: list[str] = []
    for comp in (n for n in _walk_scope(stmt) if isinstance(n, _COMPREHENSIONS)):
        inner = [n for n in ast.walk(comp) if isinstance(n, ast.Name)]
        own = {n.id for n in inner if isinstance(n.ctx, ast.Store)}
        names += [n.id for n in inner if isinstance(n.ctx, ast.Load) and n.id not in own]
    return names


def _nested_global_updates(stmt: ast.stmt) -> list[str]:
    """Globals that functions defined by ``stmt`` update or delete (``global acc; acc += 1``).

    symtable does not count those as referenced, yet they need the notebook's value.
    """
    names: list[str] = []
    for fn in ast.walk(stmt):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = list(_own_nodes(fn))
        declared = {name for node in own if isinstance(node, ast.Global) for name in node.names}
        for node in own:
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                target = node.target.id
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del):
                target = node.id
            else:
                continue
            if target in declared:
                names.append(target)
    return names


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the scopes nested in it."""
    stack: list[ast.AST] = list(fn.body)
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, _SCOPES):
            stack.extend(ast.iter_child_nodes(current))


def _nested_globals(stmt: ast.stmt) -> list[str]:
    """Globals read inside the functions, classes and lambdas that ``stmt`` defines."""
    if not any(isinstance(n, _SCOPES + _COMPREHENSIONS) for n in ast.walk(stmt)):
        return []
    source = ast.unparse(stmt)
    table = symtable.symtable(source, "<cell>", "exec")
    names: list[str] = []

    def visit(t: symtable.SymbolTable) -> None:
        for child in t.get_children():
            for sym in child.get_symbols():
                if sym.is_global() and sym.is_referenced():
                    names.append(sym.get_name())
            visit(child)

    visit(table)
    return names
