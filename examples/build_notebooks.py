"""Build each example's notebook from its script: the scripts are the source of truth.

    python examples/build_notebooks.py          # write the .ipynb files
    python examples/build_notebooks.py --check  # exit 1 if a notebook is out of date

A script is split into cells at ``# %%`` lines (``# %% [markdown]`` cells are
comment lines turned into Markdown). A cell that is an ``if __name__ ==
"__main__":`` block becomes its body, dedented: in a notebook the call is a cell.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["seed_mlp.py", "ddp_progress.py", "fsdp2_transformer.py", "deepspeed_zero.py", "data_resume.py"]
GUARD = 'if __name__ == "__main__":'


def cells_of(source: str) -> list[dict]:
    cells: list[dict] = []
    kind, lines = None, []

    def close() -> None:
        text = "\n".join(lines).strip("\n")
        if kind is None or not text:
            return
        if kind == "markdown":
            text = "\n".join(
                line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines()
            )
            cells.append({"cell_type": "markdown", "metadata": {}, "source": _split(text)})
            return
        if text.startswith(GUARD):
            text = textwrap.dedent(text[len(GUARD) :].strip("\n"))
        cell = {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": _split(text),
        }
        cells.append(cell)

    for line in source.splitlines():
        if line.startswith("# %%"):
            close()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    close()
    return cells


def _split(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def notebook(script: Path) -> str:
    nb = {
        "cells": cells_of(script.read_text()),
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"{script.stem}-{i}"
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for name in SCRIPTS:
        script = HERE / name
        target = script.with_suffix(".ipynb")
        text = notebook(script)
        if "--check" in argv:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
    if stale:
        print("out of date (run python examples/build_notebooks.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
