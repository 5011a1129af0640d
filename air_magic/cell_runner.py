"""Runs a ``%%distributed`` cell inside a rank (imported by ranks: no IPython here).

The cell's source runs as a module-level script named like the cell, so a
traceback points at the cell's lines. The namespace starts with the values
the notebook sent and the modules it had imported (re-imported here by name).
Every rank returns the value of the cell's last expression; rank 0 also
returns the names to bring back, each pickled on its own so that one
unpicklable object does not lose the others.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
from dataclasses import dataclass, field
from typing import Any

from air_magic import serialization


@dataclass
class CellOutcome:
    value: bytes | None  # the last expression's value, pickled; None when there is none
    value_error: str | None = None  # why the value could not be pickled
    names: dict[str, bytes] = field(default_factory=dict)  # rank 0 only
    unpicklable: dict[str, str] = field(default_factory=dict)  # name -> reason


def run_cell(
    source: str,
    filename: str,
    values: dict[str, Any],
    modules: dict[str, str],
    pull: list[str],
) -> CellOutcome:
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    for alias, module in modules.items():
        namespace[alias] = importlib.import_module(module)
    namespace.update(values)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    assert last is None or isinstance(last, ast.Expr)
    exec(compile(tree, filename, "exec"), namespace)
    outcome = CellOutcome(value=None)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        try:
            outcome.value = serialization.dumps_result(value)
        except Exception as exc:  # noqa: BLE001
            outcome.value_error = f"{serialization.describe_type(value)}: {exc}"
    if os.environ.get("RANK") == "0":
        for name in pull:
            if name not in namespace:
                continue
            try:
                outcome.names[name] = serialization.dumps_result(namespace[name])
            except Exception as exc:  # noqa: BLE001
                outcome.unpicklable[name] = f"{serialization.describe_type(namespace[name])}: {exc}"
    return outcome
