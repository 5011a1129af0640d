"""Between the notebook and a ``%%distributed`` cell's ranks: what goes there, and what comes back.

Used by ``notebook/magics.py`` for each cell (steps 1-4 of its flow): the cell's
IPython-only lines are refused and its syntax checked as a rank will compile it;
:func:`capture` splits the notebook's values the cell reads into values to
send and modules to re-import (an unpicklable one fails here, named); after the
ranks return, :func:`bring_back` puts rank 0's names into the notebook, deletes
what the cell deleted, and tells a persistent session which names its ranks
now hold (``calls/held_names.py``).
"""

from __future__ import annotations

import ast
import builtins
import linecache
import types
from typing import Any

from IPython.core.error import UsageError

from air_magic.calls import held_names, history, persistent
from air_magic.errors import PayloadError
from air_magic.protocol import serialization
from air_magic.worker import cell_runner


def refuse_magics(cell: str, source: str) -> None:
    """Line magics and shell escapes need the notebook's shell, which a rank does not have."""
    if "get_ipython()" not in source or "get_ipython()" in cell:
        return
    raw = cell.splitlines()
    bad = [
        f"line {i}: {raw[i - 1].strip() if i - 1 < len(raw) else line.strip()}"
        for i, line in enumerate(source.splitlines(), 1)
        if "get_ipython()" in line
    ]
    raise UsageError(
        "%%distributed cannot run IPython magics or shell escapes inside the ranks ("
        + "; ".join(bad)
        + "). Run them in a cell of their own, or use subprocess/os in the cell."
    )


def compile_as_the_rank_will(source: str, filename: str) -> SyntaxError | None:
    """The error every rank would hit on what only a function may hold (``return``, ``await``...)."""
    try:
        cell_runner.compile_cell(source, filename)
    except SyntaxError as exc:
        text = exc.text
        lines = source.splitlines()
        if text is None and exc.lineno is not None and 0 < exc.lineno <= len(lines):
            text = lines[exc.lineno - 1] + "\n"  # compiling a tree leaves it out; IPython shows it
        where = (filename, exc.lineno, exc.offset, text, exc.end_lineno, exc.end_offset)
        return SyntaxError(exc.msg, where)
    return None


def register_source(shell: Any, source: str, number: int) -> str:
    """Name the cell like IPython does and put its lines in linecache, for tracebacks."""
    try:
        return str(shell.compile.cache(source, number))
    except Exception:  # noqa: BLE001 - older IPython: register by hand
        name = f"<distributed-cell-{number}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        return name


def capture(
    shell: Any, names: list[str], pushed: list[str]
) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Split the notebook's values for ``names`` into values to send and modules to re-import."""
    values: dict[str, Any] = {}
    modules: dict[str, str] = {}
    skipped: list[str] = []
    hidden = shell.user_ns_hidden
    for name in dict.fromkeys(names):
        if name not in shell.user_ns:
            if name in pushed:
                raise UsageError(f"--push {name}: no such name in the notebook")
            continue  # a builtin, or a NameError the rank will report
        value = shell.user_ns[name]
        if name in hidden and hidden[name] is value:
            if not hasattr(builtins, name):  # IPython's own open, exit...: the ranks have Python's
                skipped.append(name)
        elif isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            found = serialization.find_unpicklable(value, f"notebook variable {name!r}")
            if found is not None:
                where, error = found
                raise PayloadError(
                    f"cannot send {where} to the ranks: {error}. Create it inside the cell instead, "
                    "or keep it out of the cell."
                )
            values[name] = value
    return values, modules, skipped


def ends_with_expression(tree: ast.Module) -> bool:
    return bool(tree.body) and isinstance(tree.body[-1], ast.Expr)


def imported(tree: ast.Module) -> list[str]:
    return [
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]


def bring_back(
    shell: Any,
    outcomes: list[cell_runner.CellOutcome],
    ends_with_expression: bool,
    imported: set[str],
    deleted: set[str],
    session: persistent.Session | None = None,
    asked: list[str] | None = None,
) -> Any:
    """Put rank 0's names into the notebook; return every rank's last value (None if all are None).

    ``asked``: the names of ``--pull``; one rank 0 does not have after the cell is said, not skipped.

    Imported names (star imports included) come back too (by reference) but
    are not listed: the line names the data the cell made or changed.
    """
    first = outcomes[0]
    loaded: dict[str, Any] = {}
    failed = dict(first.unpicklable)
    for name, data in first.names.items():
        try:
            loaded[name] = serialization.loads(data)
        except Exception as exc:  # noqa: BLE001
            failed[name] = f"could not be loaded here: {exc}"
    shell.user_ns.update(loaded)
    gone = delete_what_the_cell_deleted(shell, first.missing, deleted)
    if session is not None:
        # Every name the cell bound in the ranks, with what the notebook has for it now: the copy that
        # came back, or (not brought back) the old value, which must not overwrite the ranks' own.
        bound = {*first.names, *first.unpicklable}
        session.note_held({n: shell.user_ns.get(n, held_names.ABSENT) for n in bound})
        session.forget(gone)
    hidden = imported | set(first.star_names)
    shown = [k for k, v in loaded.items() if k not in hidden and not isinstance(v, types.ModuleType)]
    said = [f"{k} (changed in place)" if k in first.changed else k for k in shown]
    parts = [f"brought back from rank 0: {', '.join(said)}"] if said else []
    if gone:
        parts.append(f"deleted: {', '.join(gone)}")
    if parts:
        print(f"air_magic: {'; '.join(parts)}")
    if failed:
        print("air_magic: not brought back: " + "; ".join(f"{k} ({v})" for k, v in failed.items()))
    unknown = [n for n in first.missing if n in (asked or []) and n not in gone]
    if unknown:
        print(f"air_magic: --pull {', '.join(unknown)}: rank 0 has no such name after the cell")
    info = history.last_run()
    if not ends_with_expression:
        return None
    values: list[Any] = []
    for rank, outcome in enumerate(outcomes):
        if outcome.value is None:
            print(f"air_magic: rank {rank}'s last value could not be sent back: {outcome.value_error}")
            values.append(None)
        else:
            values.append(serialization.loads(outcome.value))
    if info is not None:
        info.values = values
    # Like IPython, show nothing when there is nothing to show (a final print(), say).
    return None if all(v is None for v in values) else values


def delete_what_the_cell_deleted(shell: Any, missing: list[str], deleted: set[str]) -> list[str]:
    """Names rank 0 ended without because the cell ran ``del`` on them (not a loop that never ran)."""
    gone = [n for n in missing if n in deleted and n in shell.user_ns]
    for name in gone:
        del shell.user_ns[name]
    return gone
