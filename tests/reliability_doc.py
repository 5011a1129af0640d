"""The fault matrix as a table: collected from ``@pytest.mark.fault`` marks, written to docs/reliability.md.

    python tests/reliability_doc.py          # print the table
    python tests/reliability_doc.py --write  # rewrite docs/reliability.md's table

tests/unit/test_reliability_doc.py fails when the document and the tests disagree,
so the table cannot drift from what is tested.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "reliability.md"
BEGIN, END = "<!-- fault-matrix:begin -->", "<!-- fault-matrix:end -->"


def collect() -> list[tuple[str, str, str]]:
    """(case, expected, 'tier/file::test') for every fault-marked test, in file-name order
    (so a row keeps its number when a file moves between the tiers' folders)."""
    rows = []
    for path in sorted(TESTS.glob("*/test_*.py"), key=lambda p: p.name):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if (
                    isinstance(decorator, ast.Call)
                    and ast.unparse(decorator.func) in ("pytest.mark.fault", "fault")
                    and len(decorator.args) == 2
                ):
                    case, expected = (ast.literal_eval(a) for a in decorator.args)
                    rows.append((case, expected, f"{path.parent.name}/{path.name}::{node.name}"))
    return rows


def table() -> str:
    lines = ["| # | case | expected | test |", "|---|---|---|---|"]
    for i, (case, expected, test) in enumerate(collect(), 1):
        lines.append(f"| {i} | {case} | {expected} | `{test}` |")
    return "\n".join(lines)


def rendered(doc: str) -> str:
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(rendered(DOC.read_text()))
    else:
        print(table())
