"""What a ``%%distributed`` cell needs from the notebook and what it binds (pure: no shell, no ranks)."""

from __future__ import annotations

import ast

from air_magic.notebook.cell_analysis import names_assigned, names_deleted, names_read, star_imports


def parse(source: str) -> ast.Module:
    return ast.parse(source)


def test_updated_and_deleted_names_are_needed_from_the_notebook():
    tree = parse("x += 1\nfor i in range(3):\n    acc += i\ndel gone\nmine = 1\nmine += 1\ndel mine\n")
    read = names_read(tree)
    assert {"x", "range", "acc", "gone"} <= set(read)
    assert "mine" not in read  # the cell binds it before updating and deleting it
    assert names_deleted(tree) == ["gone", "mine"]


def test_globals_updated_or_deleted_inside_functions_are_needed():
    tree = parse(
        "def bump():\n    global total, old\n    total += 1\n    del old\n"
        "def local_only():\n    count = 0\n    count += 1\n"
        "bump()\n"
    )
    read = names_read(tree)
    assert "total" in read and "old" in read and "count" not in read


def test_star_imports_are_listed_and_not_taken_for_names():
    tree = parse("from string import *\nimport os\nif True:\n    from json import *\n")
    assert star_imports(tree) == ["string", "json"]
    assert "*" not in names_assigned(tree)
