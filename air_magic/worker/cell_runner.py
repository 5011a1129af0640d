"""Runs a ``%%distributed`` cell inside a rank (imported by ranks: no IPython here).

The cell's source runs as a module-level script named like the cell, so a
traceback points at the cell's lines, in the ``__dict__`` of the rank's
``__main__`` module (as IPython runs a cell), so the classes and functions it
defines pickle inside the rank as they do in the notebook. The namespace starts with the values
the notebook sent and the modules it had imported (re-imported here by name).
Every rank returns the value of the cell's last expression; rank 0 also
returns the names to bring back, each pickled on its own so that one
unpicklable object does not lose the others: the names the cell assigned,
the sent values it changed in place (their data fingerprint differs after
the cell), and the names its ``from m import *`` bound.

:func:`compile_cell` is also what the notebook calls before launch, so a
cell that cannot compile here (a top-level ``return``, say) fails there,
with nothing launched.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any

from air_magic.protocol import serialization
from air_magic.worker import main_module


@dataclass
class CellOutcome:
    value: bytes | None  # the last expression's value, pickled; None when there is none
    value_error: str | None = None  # why the value could not be pickled
    names: dict[str, bytes] = field(default_factory=dict)  # rank 0 only
    unpicklable: dict[str, str] = field(default_factory=dict)  # name -> reason
    changed: list[str] = field(default_factory=list)  # sent names that came back changed in place
    star_names: list[str] = field(default_factory=list)  # names a ``from m import *`` bound
    missing: list[str] = field(default_factory=list)  # names to bring back that rank 0 did not have


def run_cell(
    source: str,
    filename: str,
    values: dict[str, Any],
    modules: dict[str, str],
    pull: list[str],
    watch: list[str] | None = None,
    star_modules: list[str] | None = None,
    namespace: dict[str, Any] | None = None,
) -> CellOutcome:
    """Run the cell; ``watch`` names sent values to bring back if the cell changes them in place.

    ``namespace``: the globals to run in, the ``__dict__`` of the rank's ``__main__`` module (a
    persistent session's rank keeps one across cells, worker/session_rank.py); None: a fresh
    ``__main__`` (worker/main_module.py), as for a one-off call.
    """
    if namespace is None:
        namespace = main_module.fresh_main()
    for alias, module in modules.items():
        namespace[alias] = importlib.import_module(module)
    namespace.update(values)
    body, last = compile_cell(source, filename)
    rank_0 = os.environ.get("RANK") == "0"
    before = _fingerprints(namespace, watch or []) if rank_0 else {}
    exec(body, namespace)
    outcome = CellOutcome(value=None)
    if last is not None:
        value = eval(last, namespace)
        try:
            outcome.value = serialization.dumps_result(value)
        except Exception as exc:  # noqa: BLE001
            outcome.value_error = f"{serialization.describe_type(value)}: {exc}"
    if rank_0:
        outcome.changed = [
            n for n, digest in before.items() if n in namespace and _changed(namespace[n], digest)
        ]
        outcome.star_names = _star_bound(namespace, star_modules or [])
        _pickle_names(outcome, namespace, list(dict.fromkeys(pull + outcome.changed + outcome.star_names)))
    return outcome


def compile_cell(source: str, filename: str) -> tuple[types.CodeType, types.CodeType | None]:
    """The cell's statements, and its last expression apart (its value is every rank's output).

    ``dont_inherit``: the cell gets none of this module's ``from __future__``
    flags (annotations stay real objects, as in the notebook).
    """
    tree = ast.parse(source, filename)
    last = tree.body[-1] if tree.body else None
    if not isinstance(last, ast.Expr):
        return compile(tree, filename, "exec", dont_inherit=True), None
    tree.body.pop()
    body = compile(tree, filename, "exec", dont_inherit=True)
    return body, compile(ast.Expression(last.value), filename, "eval", dont_inherit=True)


def _fingerprints(namespace: dict[str, Any], names: list[str]) -> dict[str, bytes]:
    """Each sent value's data digest, before the cell runs; one that cannot be taken is not watched."""
    digests: dict[str, bytes] = {}
    for name in names:
        try:
            digests[name] = serialization.fingerprint(namespace[name])
        except Exception:  # noqa: BLE001 - cannot tell whether it changed: leave it in the notebook
            continue
    return digests


def _changed(value: Any, digest: bytes) -> bool:
    try:
        return serialization.fingerprint(value) != digest
    except Exception:  # noqa: BLE001 - it pickled before the cell: it changed (and is named when sent back)
        return True


def _star_bound(namespace: dict[str, Any], modules: list[str]) -> list[str]:
    """The public names ``from m import *`` bound, as Python picks them (``__all__``, else no ``_``)."""
    names: list[str] = []
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None:  # a ``from m import *`` that did not run (a branch, a caught ImportError)
            continue
        exported = getattr(module, "__all__", None)
        if exported is None:
            exported = [n for n in vars(module) if not n.startswith("_")]
        names += [n for n in exported if not n.startswith("_") and n in namespace]
    return names


def _pickle_names(outcome: CellOutcome, namespace: dict[str, Any], names: list[str]) -> None:
    for name in names:
        if name not in namespace:
            outcome.missing.append(name)
            continue
        try:
            outcome.names[name] = serialization.dumps_result(namespace[name])
        except Exception as exc:  # noqa: BLE001
            outcome.unpicklable[name] = f"{serialization.describe_type(namespace[name])}: {exc}"
